"""Workers forked from a zygote that imported their modules once (``runner/zygote.py``):
through ``launch.run(preload=...)``, real processes, the same contract as exec'd ones."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

from ronde.runner import launch, zygote

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_modules")
WORKER = os.path.join(HERE, "zygote_worker.py")
ENV = {"PYTHONPATH": HERE, "ZYGOTE_TEST_VAR": "seen"}


def _run(how: str, preload: tuple[str, ...], np_: int = 2, module: bool = False,
         timeout_s: float = 60.0) -> tuple[launch.LaunchResult, dict[int, dict], str]:
    out, err = io.StringIO(), io.StringIO()
    cmd = ([sys.executable, "-m", "zygote_worker", how] if module
           else [sys.executable, WORKER, how])
    result = launch.run(cmd, np_, env=ENV, timeout_s=timeout_s, stdout=out, stderr=err,
                        preload=preload)
    reports = {}
    for line in out.getvalue().splitlines():
        prefix, _, rest = line.partition("]<stdout>:")
        if rest.startswith("{"):
            reports[int(prefix[1:])] = json.loads(rest)
    return result, reports, err.getvalue()


def test_which_commands_a_zygote_runs():
    py = sys.executable
    assert zygote.eligible([py, "-m", "pkg.mod", "x"])
    assert zygote.eligible([py, "train.py", "--lr", "1"])
    assert not zygote.eligible([py, "-u", "train.py"])  # interpreter flags: exec'd
    assert not zygote.eligible([py, "-c", "print(1)"])
    assert not zygote.eligible([py])
    assert not zygote.eligible(["/bin/echo", "train.py"])  # another program
    assert not zygote.eligible([py, "-m"])


@pytest.mark.timeout(120)
def test_forked_workers_get_the_workers_contract_and_their_exit_codes():
    # a script and a module, each forked (the marker module was imported in the
    # zygote, not here), in its own session, with its rank's environment, argv,
    # sys.path[0], stdout/stderr relayed with the rank prefix and the lifeline
    for module in (False, True):
        result, reports, err = _run("ok", ("zygote_marker",), module=module)
        assert result.returncode == 0, err
        assert sorted(reports) == [0, 1]
        for rank, r in reports.items():
            assert r["forked"] and r["session"] and r["lifeline"], r
            assert r["rank"] == str(rank) and r["extra"] == "seen" and r["name"] == "__main__"
            assert r["cwd"] == os.getcwd()
            if module:
                assert r["argv"][1:] == ["ok"] and r["path0"] == os.getcwd()
            else:
                assert r["argv"] == [WORKER, "ok"] and r["path0"] == HERE
        assert "[0]<stderr>:to stderr" in err and "[1]<stderr>:to stderr" in err
        # numpy's unseeded global state is each process's own, as in exec'd ranks
        assert reports[0]["draw"] != reports[1]["draw"], reports
    # the exit codes a launcher sees from exec'd workers: sys.exit(3), an exception
    # (its traceback on stderr), a rank killed by a signal
    result, _, err = _run("exit3", ("zygote_marker",))
    assert result.returncode == 3, err
    result, reports, err = _run("raise", ("zygote_marker",))
    assert result.returncode == 1 and reports[0]["forked"], err
    # handed to sys.excepthook, as the interpreter does (ronde.init() reports the
    # rank's failure to the launcher from there)
    assert "[0]<stderr>:HOOK ValueError" in err and "[1]<stderr>:HOOK ValueError" in err, err
    result, reports, err = _run("sigkill", ("zygote_marker",))
    assert result.returncode != 0 and result.first_failed_rank == 1, err
    assert reports[1]["forked"]
    # a hung forked worker is stopped by the job's timeout (its process group killed)
    result, reports, err = _run("hang", ("zygote_marker",), timeout_s=8.0)
    assert result.returncode == 124 and reports[0]["forked"], err


@pytest.mark.timeout(120)
def test_a_preload_that_starts_a_thread_or_fails_falls_back_to_exec():
    # forking after a module started a thread would copy its locks held: refused, and
    # the workers start the usual way (not forked), as when the import fails
    for preload in (("zygote_marker", "zygote_thread"), ("no_such_module_here",)):
        result, reports, err = _run("ok", preload)
        assert result.returncode == 0, err
        assert sorted(reports) == [0, 1]
        assert not any(r["forked"] for r in reports.values()), reports
        assert all(r["lifeline"] for r in reports.values())


def test_a_zygote_that_does_not_become_ready_in_time_falls_back_to_exec(monkeypatch):
    # an import that hangs (here: sleeps past the start timeout) must not hang the launch
    monkeypatch.setattr(zygote, "START_TIMEOUT_S", 1.0)
    result, reports, err = _run("ok", ("zygote_slow",))
    assert result.returncode == 0, err
    assert sorted(reports) == [0, 1]
    assert not any(r["forked"] for r in reports.values()), reports
