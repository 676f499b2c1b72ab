"""ronderun's checks of its flags, in process: bad input exits 2 before any worker starts."""

from __future__ import annotations

import pytest

from ronde.runner.cli import main

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("args, message", [
    (["--cycle-time-ms", "nan"], "argument --cycle-time-ms: 'nan' is not a finite number "
                                 "(accepted: > 0 and <= 60000 milliseconds)"),
    (["--cycle-time-ms", "inf"], "argument --cycle-time-ms: 'inf' is not a finite number "
                                 "(accepted: > 0 and <= 60000 milliseconds)"),
    (["--cycle-time-ms", "0"], "argument --cycle-time-ms: '0' is out of range "
                               "(accepted: > 0 and <= 60000 milliseconds)"),
    (["--fusion-threshold-mb", "nan"], "argument --fusion-threshold-mb: 'nan' MiB is not a "
                                       "finite number (accepted: >= 0 and <= 64GiB)"),
    (["--fusion-threshold-mb", "1e9"], "argument --fusion-threshold-mb: '1e9' MiB is out of "
                                       "range (accepted: >= 0 and <= 64GiB)"),
    (["--start-timeout", "nan"], "argument --start-timeout: 'nan' is not a finite number "
                                 "(accepted: > 0 and <= 31536000 seconds)"),
    (["--stall-check-shutdown-time-seconds=-inf"],
     "argument --stall-check-shutdown-time-seconds: '-inf' is not a finite number "
     "(accepted: >= 0 and <= 31536000 seconds)"),
    (["--autotune-gaussian-process-noise", "nan"],
     "argument --autotune-gaussian-process-noise: 'nan' is not a finite number "
     "(accepted: > 0 and <= 1000)"),
    (["--reset-limit", "-1"], "argument --reset-limit: '-1' is out of range "
                              "(accepted: >= 0 and <= 1000000 resets)"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    (["-x", "RONDE_CYCLE_TIME=nan"],
     "RONDE_CYCLE_TIME='nan' is not a finite number (accepted: > 0 and <= 60000 milliseconds)"),
    (["-x", "HOROVOD_FUSION_THRESHOLD=1000GB"],
     "HOROVOD_FUSION_THRESHOLD='1000GB' is out of range (accepted: >= 0 and <= 64GiB)"),
])
def test_bad_numbers_exit_2_naming_the_flag_and_the_range(capsys, args, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        main(["-np", "1", *args, "true"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"ronderun: error: {message}\n"


@pytest.mark.parametrize("env", [{"RONDE_START_TIMEOUT": "nan"},
                                 {"HOROVOD_START_TIMEOUT": "nan"}])
def test_the_launchers_start_timeout_from_the_environment_is_checked(
        capsys, monkeypatch, env) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("RONDE_START_TIMEOUT", raising=False)
    monkeypatch.delenv("HOROVOD_START_TIMEOUT", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit):  # was: "... within nans" once the rendezvous waited
        main(["-np", "1", "true"])
    var = next(iter(env))
    assert capsys.readouterr().err == (
        f"ronderun: error: {var}='nan' is not a finite number "
        "(accepted: > 0 and <= 31536000 seconds)\n")


@pytest.mark.parametrize("args, message", [
    (["-np", "99999999999"], "-np 99999999999: ronderun starts at most 65536 ranks"),
    (["-np", "1", "--max-np", "70000"], "--max-np 70000: ronderun starts at most 65536 ranks"),
    (["--min-np", "1", "--blacklist-cooldown-range", "nan", "1"],
     "--blacklist-cooldown-range nan 1: need 0 <= LO <= HI, finite"),
    (["-H", "localhost:99999999999"],
     "-H localhost:99999999999: host 'localhost' has 99999999999 slots, more than the 4096 "
     "ranks ronderun starts on one host"),
])
def test_absurd_rank_counts_and_ranges_exit_2(capsys, args, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        main([*args, "true"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"ronderun: error: {message}\n"


@pytest.mark.parametrize("flag", ["--version", "-v"])
def test_version_prints_ronderuns_version_and_exits_0(capsys: pytest.CaptureFixture[str],
                                                      flag: str) -> None:
    from ronde import __version__

    with pytest.raises(SystemExit) as exc:
        main([flag])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"ronderun (ronde) {__version__}\n"


def test_check_build_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
    assert ("-cb, --check-build print which transports and frameworks ronde can use on this "
            "machine and exit (the same as 'ronde doctor')") in out
    assert "-v, --version print ronde's version and exit" in out


@pytest.mark.parametrize("args", [["--check-build"], ["-cb"], ["-np", "2", "--check-build"],
                                  ["-H", "a:1", "-cb", "python", "train.py"]])
def test_check_build_runs_the_doctor_wherever_it_stands(monkeypatch: pytest.MonkeyPatch,
                                                        args: list[str]) -> None:
    import ronde.cli

    calls: list[int] = []
    monkeypatch.setattr(ronde.cli, "doctor", lambda: calls.append(1) or 7)
    assert main(args) == 7
    assert calls == [1]
