"""ronderun end to end: real worker processes started through ``python -m ronde.run``."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from ronde.testing import RanksFailedError, run_ranks, run_ranks_many

PY = sys.executable


def ronderun(*args: str, timeout: float = 30, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "ronde.run", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def rank_lines(text: str, kind: str = "stdout") -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("[") and f"]<{kind}>:" in line:
            rank, rest = line[1:].split(f"]<{kind}>:", 1)
            out.setdefault(int(rank), []).append(rest)
    return out


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


PRINT_ENV = ("import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
             "if k.startswith(('RONDE_', 'HOROVOD_', 'PYTHONUNBUFFERED', 'MY_'))}))")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("np_", [2, 3])
def test_worker_env_per_rank(np_: int) -> None:
    r = ronderun("-np", str(np_), "-x", "MY_SET=1", "-x", "MY_COPIED", "--transport", "tcp",
                 "--fusion-threshold-mb", "2", "--cycle-time-ms", "5", "--", PY, "-c", PRINT_ENV,
                 env={"MY_COPIED": "from-shell"})
    assert r.returncode == 0, r.stderr
    envs = {rank: json.loads(lines[0]) for rank, lines in rank_lines(r.stdout).items()}
    assert sorted(envs) == list(range(np_))
    for rank, e in envs.items():
        assert (e["RONDE_RANK"], e["RONDE_SIZE"]) == (str(rank), str(np_))
        assert (e["RONDE_LOCAL_RANK"], e["RONDE_LOCAL_SIZE"]) == (str(rank), str(np_))
        assert (e["RONDE_CROSS_RANK"], e["RONDE_CROSS_SIZE"]) == ("0", "1")
        assert e["HOROVOD_RANK"] == str(rank) and e["RONDE_HOSTNAME"] == "localhost"
        assert e["RONDE_RENDEZVOUS_ADDR"] == "127.0.0.1" and int(e["RONDE_RENDEZVOUS_PORT"]) > 0
        assert len(bytes.fromhex(e["RONDE_SECRET"])) == 32
        assert e["PYTHONUNBUFFERED"] == "1" and e["RONDE_START_TIMEOUT"] == "30"
        assert (e["MY_SET"], e["MY_COPIED"]) == ("1", "from-shell")
        assert e["RONDE_TRANSPORT"] == "tcp" and e["RONDE_CYCLE_TIME"] == "5"
        assert e["RONDE_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
    assert len({e["RONDE_JOB_ID"] for e in envs.values()}) == 1
    assert len({e["RONDE_SECRET"] for e in envs.values()}) == 1


OUTPUT = ("import os, sys; r = os.environ['RONDE_RANK']; sys.stdout.write(f'a{r}\\nb{r}'); "
          "sys.stderr.buffer.write(b'err ' + r.encode() + b' \\xff\\n')")


@pytest.mark.timeout(30)
def test_output_prefix_and_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = ronderun("-np", "2", "--output-filename", str(tmp_path / "out"), PY, "-c", OUTPUT)
    assert r.returncode == 0, r.stderr
    assert rank_lines(r.stdout) == {0: ["a0", "b0"], 1: ["a1", "b1"]}  # partial line kept
    assert rank_lines(r.stderr, "stderr") == {0: ["err 0 \ufffd"], 1: ["err 1 \ufffd"]}
    assert "]<stderr>:" not in r.stdout and "]<stdout>:" not in r.stderr
    for rank in (0, 1):
        folder = tmp_path / "out" / f"rank.{rank}"
        assert (folder / "stdout").read_bytes() == f"a{rank}\nb{rank}".encode()
        assert (folder / "stderr").read_bytes() == f"err {rank} ".encode() + b"\xff\n"


FAIL_RANK1 = ("import os, sys, time; r = int(os.environ['RONDE_RANK']); "
              "print('about to fail', file=sys.stderr) if r == 1 else None; "
              "sys.exit(3) if r == 1 else time.sleep(60)")


@pytest.mark.timeout(30)
def test_first_failure_exit_code_and_summary() -> None:
    r = ronderun("-np", "3", PY, "-c", FAIL_RANK1)
    assert r.returncode == 3, r.stderr
    lines = r.stderr.splitlines()
    head = next(i for i, line in enumerate(lines) if "failed first" in line)
    assert lines[head] == "ronderun: rank 1 (host localhost) failed first with exit code 3"
    assert not any(line.startswith("[") for line in lines[head:])  # the summary comes last
    assert "    about to fail" in lines[head:]
    assert lines[-1] == "ronderun: other ranks: 0 stopped by ronderun; 2 stopped by ronderun"


SIGKILL_RANK1 = ("import os, signal, time; r = int(os.environ['RONDE_RANK']); "
                 "os.kill(os.getpid(), signal.SIGKILL) if r == 1 else time.sleep(60)")


@pytest.mark.timeout(30)
def test_rank_killed_by_signal_stops_the_others() -> None:
    r = ronderun("-np", "2", PY, "-c", SIGKILL_RANK1)
    assert r.returncode == 128 + signal.SIGKILL
    assert "rank 1 (host localhost) failed first: it was killed by signal SIGKILL" in r.stderr
    assert "0 stopped by ronderun" in r.stderr


# rank 0 reports the root cause to the rendezvous service, then takes a while to exit;
# rank 1 fails sooner "because of it": the reported rank is the first failure, and it is
# given the grace period to exit by itself
REPORTED = """
import os, sys, time
from ronde.runner.rendezvous import report_failure
r = int(os.environ['RONDE_RANK'])
if r == 0:
    addr = (os.environ['RONDE_RENDEZVOUS_ADDR'], int(os.environ['RONDE_RENDEZVOUS_PORT']))
    report_failure(addr, bytes.fromhex(os.environ['RONDE_SECRET']), 0, 'root cause here')
    time.sleep(float(sys.argv[1]))
    sys.exit(7)
else:
    time.sleep(0.3)
    sys.exit(5)
"""


@pytest.mark.timeout(30)
def test_reported_failure_wins_over_earlier_exit() -> None:
    r = ronderun("-np", "2", PY, "-c", REPORTED, "1.0")
    assert r.returncode == 7, r.stderr
    assert "rank 0 (host localhost) failed first with exit code 7" in r.stderr
    assert "    root cause here" in r.stderr.splitlines()
    assert r.stderr.endswith("ronderun: other ranks: 1 failed afterwards (exit code 5)\n")


# ranks 0 and 2 report that they lost rank 1 and exit at once; rank 1's process is
# seen to end later (a big process takes a while to die): rank 1 is still the cause
LOST = """
import os, signal, time
from ronde.runner.rendezvous import report_failure
r = int(os.environ['RONDE_RANK'])
if r == 1:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
addr = (os.environ['RONDE_RENDEZVOUS_ADDR'], int(os.environ['RONDE_RENDEZVOUS_PORT']))
report_failure(addr, bytes.fromhex(os.environ['RONDE_SECRET']), r, 'lost rank 1',
               secondary=True, lost=1)
raise SystemExit(5)
"""


@pytest.mark.timeout(30)
def test_rank_reported_lost_is_the_cause_though_seen_to_exit_last() -> None:
    r = ronderun("-np", "3", PY, "-c", LOST)
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    assert "rank 1 (host localhost) failed first: it was killed by signal SIGKILL" \
        in r.stderr
    assert r.stderr.endswith("ronderun: other ranks: 0 failed afterwards (exit code 5); "
                             "2 failed afterwards (exit code 5)\n")


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_reported_failure_that_hangs_is_killed_after_grace() -> None:
    r = ronderun("-np", "2", PY, "-c", REPORTED, "60")
    assert r.returncode == 1, r.stderr
    assert ("rank 0 (host localhost) failed first: it reported an error, then ronderun had "
            "to stop it (killed by signal SIGKILL)") in r.stderr


@pytest.mark.timeout(30)
def test_timeout_kills_hanging_job() -> None:
    r = ronderun("-np", "2", "--timeout", "1", PY, "-c", "import time; time.sleep(60)")
    assert r.returncode == 124
    assert "job timed out after 1s (--timeout); killed the ranks still running: 0, 1" \
        in r.stderr.splitlines()[-1]


SLEEPER = ("import os, subprocess, time; c = subprocess.Popen(['sleep', '60']); "
           "print(os.getpid(), c.pid, flush=True); time.sleep(60)")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_kills_workers(sig: int, code: int) -> None:
    proc = subprocess.Popen([PY, "-m", "ronde.run", "-np", "2", PY, "-c", SLEEPER],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids: list[int] = []
        assert proc.stdout is not None
        while len(pids) < 4:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            pids += [int(p) for p in line.split(":", 1)[1].split()]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == code, err
        assert f"interrupted by {signal.Signals(sig).name}" in err
        deadline = time.monotonic() + 5
        while not all(gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(gone(p) for p in pids), pids
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, match", [
    (["-np", "5", "-H", "localhost:2,127.0.0.1:2", "true"],
     "ronderun: error: -np 5 but the hosts give only 4 slots: localhost:2, 127.0.0.1:2"),
    (["-np", "2"], "ronderun: error: no command given"),
    (["true"], "ronderun: error: -np is required"),
    (["-np", "2", "--bogus", "true"], "ronderun: error: unrecognized arguments: --bogus"),
    (["-np", "1", "-H", "a:0", "true"], "ronderun: error: -H a:0: a host needs at least 1"),
    (["-np", "1", "-x", "RONDE_UNSET_VAR", "true"],
     "ronderun: error: -x RONDE_UNSET_VAR: RONDE_UNSET_VAR is not set in this shell"),
])
def test_bad_input_exits_2(args: list[str], match: str) -> None:
    r = ronderun(*args)
    assert r.returncode == 2
    assert r.stderr.startswith(match) and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.timeout(30)
def test_np_defaults_to_slots() -> None:
    r = ronderun("-H", "localhost:2", PY, "-c", "print('x')")
    assert r.returncode == 0 and sorted(rank_lines(r.stdout)) == [0, 1]


REMOTE = ("import os; print(os.environ.get('RONDE_FAKE_HOST'), os.environ['RONDE_HOSTNAME'], "
          "os.environ['RONDE_RANK'], os.environ['RONDE_CROSS_RANK'], os.getcwd())")


@pytest.mark.timeout(30)
def test_remote_shell_template(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = subprocess.run(
        [PY, "-m", "ronde.run", "--verbose", "-H", "fakehost1:1,fakehost2:1", PY, "-c", REMOTE],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
        env={**os.environ, "RONDE_REMOTE_SHELL": "env RONDE_FAKE_HOST={host} sh -c"})
    assert r.returncode == 0, r.stderr
    assert rank_lines(r.stdout) == {
        0: [f"fakehost1 fakehost1 0 0 {tmp_path}"], 1: [f"fakehost2 fakehost2 1 1 {tmp_path}"]}
    assert "ronderun: rank 1 on fakehost2 (remote): local 0/1, cross 1/2" in r.stderr
    assert "env RONDE_FAKE_HOST=fakehost2 sh -c" in r.stderr
    assert "IFS= read -r RONDE_SECRET" in r.stderr  # from standard input, not argv


LEAKS = ("import glob, os; s = os.environ['RONDE_SECRET'].encode(); n = 0\n"
         "for f in glob.glob('/proc/[0-9]*/cmdline'):\n"
         "    try: n += s in open(f, 'rb').read()\n"
         "    except OSError: pass\n"
         "print('rank', os.environ['RONDE_RANK'], 'secret', len(s), 'in argv', n)")


@pytest.mark.timeout(30)
def test_the_secret_is_in_no_command_line_of_the_job(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every user of a host can read every command line (``ps aux``): the secret of a
    remote rank travels on the remote shell's standard input (it was an ``env
    RONDE_SECRET=...`` argument of ssh, issue #32)."""
    r = subprocess.run(
        [PY, "-m", "ronde.run", "-H", "localhost:1,fakehost2:1", PY, "-c", LEAKS],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
        env={**os.environ, "RONDE_REMOTE_SHELL": "env RONDE_FAKE_HOST={host} sh -c"})
    assert r.returncode == 0, r.stderr
    assert rank_lines(r.stdout) == {0: ["rank 0 secret 64 in argv 0"],
                                    1: ["rank 1 secret 64 in argv 0"]}


def rank_result(scale: int, *, offset: int = 0) -> dict[str, Any]:
    rank, size = int(os.environ["RONDE_RANK"]), int(os.environ["RONDE_SIZE"])
    return {"rank": rank, "size": size, "value": rank * scale + offset}


def fail_on_rank_1() -> None:
    if os.environ["RONDE_RANK"] == "1":
        raise ValueError("boom from rank 1")
    time.sleep(60)


@pytest.mark.timeout(30)
def test_run_ranks_returns_results_in_rank_order() -> None:
    out = run_ranks(3, rank_result, 10, offset=1)
    assert out == [{"rank": r, "size": 3, "value": 10 * r + 1} for r in range(3)]


@pytest.mark.timeout(30)
def test_run_ranks_raises_with_traceback() -> None:
    with pytest.raises(RanksFailedError, match=r"(?s)rank 1 \(host localhost\) failed first"
                       r".*traceback of rank 1:.*ValueError: boom from rank 1") as info:
        run_ranks(2, fail_on_rank_1, timeout_s=20)
    assert info.value.rank == 1 and info.value.result.returncode == 1


@pytest.mark.timeout(30)
def test_run_ranks_many_runs_each_call_in_one_launch_in_order() -> None:
    first, second = run_ranks_many(2, [(rank_result, 10), (rank_result, 1)])
    assert first == [{"rank": r, "size": 2, "value": 10 * r} for r in range(2)]
    assert second == [{"rank": r, "size": 2, "value": r} for r in range(2)]
    with pytest.raises(RanksFailedError, match=r"(?s)traceback of rank 1:.*fail_on_rank_1"
                       r".*ValueError: boom from rank 1"):
        run_ranks_many(2, [(rank_result, 1), fail_on_rank_1], timeout_s=20)
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks_many(2, [(rank_result, 1), (lambda: 1,)])


@pytest.mark.timeout(10)
def test_run_ranks_rejects_local_functions() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(2, lambda: 1)


@pytest.mark.timeout(10)
def test_default_remote_shell_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from ronde.runner.workers import _remote_argv

    monkeypatch.delenv("RONDE_REMOTE_SHELL", raising=False)
    monkeypatch.chdir(tmp_path)
    argv = _remote_argv("node1", [PY, "train.py", "a b"],
                        {"RONDE_RANK": "1", "X": "y z", "RONDE_SECRET": "ab" * 32},
                        2222, "/keys/my key")
    assert argv[:-1] == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                         "-p", "2222", "-i", "/keys/my key", "node1"]
    assert argv[-1] == (f"cd {shlex.quote(str(tmp_path))} && IFS= read -r RONDE_SECRET && "
                        "export RONDE_SECRET && exec env RONDE_RANK=1 'X=y z' "
                        f"RONDE_LAUNCHER_FD=0 {PY} train.py 'a b'")


IGNORE_TERM = ("import os, signal, sys, time; r = int(os.environ['RONDE_RANK']); "
               "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
               "time.sleep(60) if r == 0 else (time.sleep(0.5), sys.exit(2))")


@pytest.mark.timeout(30)
def test_api_sigkill_after_grace_for_a_rank_ignoring_sigterm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from ronde.runner import launch

    monkeypatch.setenv("RONDE_STOP_GRACE", "1.5")
    out, err = io.StringIO(), io.StringIO()
    result = launch.run([PY, "-c", IGNORE_TERM], 2, stdout=out, stderr=err)
    assert (result.returncode, result.first_failed_rank) == (2, 1)
    assert result.exit_codes == [-signal.SIGKILL, 2]
    assert result.cause == "rank 1 (host localhost) failed first with exit code 2"
    assert err.getvalue().endswith("ronderun: other ranks: 0 stopped by ronderun\n")
    assert rank_lines(out.getvalue()) == {0: ["ready"], 1: ["ready"]}


LINGER = ("import os, time, ronde as hvd; hvd.init(); "
          "print('pid', os.getpid(), flush=True); time.sleep(60)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_workers_die_with_a_killed_launcher(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL of ronderun (it cannot stop anyone) used to leave its workers training on
    under PID 1: a local one now sees its inherited lifeline close, a remote one its
    standard input (issue #32)."""
    launcher = subprocess.Popen(
        [PY, "-m", "ronde.run", "-H", "localhost:1,fakehost2:1", PY, "-c", LINGER],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "RONDE_REMOTE_SHELL": "env RONDE_FAKE_HOST={host} sh -c"})
    pids = []
    assert launcher.stdout is not None
    for line in launcher.stdout:
        if "pid" in line:
            pids.append(int(line.split()[-1]))
        if len(pids) == 2:
            break
    assert all(_alive(p) for p in pids)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 20  # a hang guard; they stop within about a second
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers {left} outlived their launcher"


TORCHRUN_CONTRACT = """
import os, sys
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
print(" ".join(os.environ.get(n, "-") for n in names), int(os.environ["MASTER_PORT"]) > 0)
try:
    import torch, torch.distributed as dist
except ImportError:
    sys.exit(0)
dist.init_process_group("gloo")  # env://, as Lightning, Trainer and accelerate do
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
import ronde.torch as hvd
hvd.init()
print("torch", dist.get_world_size(), t.item(), "ronde", hvd.allreduce(t, op=hvd.Sum).item())
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_workers_get_the_torchrun_contract() -> None:
    """Trainers that read torchrun's variables (Lightning, Hugging Face) used to see
    none under ronderun and trained one whole copy per process (issue #35); -x wins,
    and of the launcher's own environment only MASTER_ADDR/MASTER_PORT are kept."""
    r = ronderun("-np", "2", PY, "-c", TORCHRUN_CONTRACT)
    assert r.returncode == 0, r.stderr
    lines = rank_lines(r.stdout)
    for rank in (0, 1):
        assert lines[rank][0] == f"{rank} 2 {rank} 2 0 127.0.0.1 True"
        if len(lines[rank]) > 1:  # torch installed
            assert lines[rank][1] == "torch 2 3.0 ronde 6.0"
    r = ronderun("-np", "2", "-x", "MASTER_ADDR=localhost", PY, "-c",
                 "import os; print(os.environ['MASTER_ADDR'], os.environ['RANK'])")
    assert r.returncode == 0, r.stderr
    assert rank_lines(r.stdout) == {0: ["localhost 0"], 1: ["localhost 1"]}
    # a WORLD_SIZE=1 left in the shell crashed a -np 2 job in gloo
    r = ronderun("-np", "2", PY, "-c", TORCHRUN_CONTRACT,
                 env={"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    assert r.returncode == 0, r.stderr
    assert rank_lines(r.stdout)[1][0] == "1 2 1 2 0 127.0.0.1 True"


EARLY_EXIT = """
import sys, numpy as np, ronde as hvd
hvd.init()
hvd.allreduce(np.ones(4), name="warm")
if hvd.rank() == 1:
    sys.exit(0)  # leaves while the others go on
for i in range(1000):
    hvd.allreduce(np.ones(4), name="step")
"""


@pytest.mark.timeout(60)
def test_the_summary_names_a_rank_that_left_early_with_exit_code_0() -> None:
    """The ranks that lost rank 1 fail; the summary used to blame rank 0 because rank 1's
    exit code was 0 (issue #32)."""
    r = ronderun("-np", "3", PY, "-c", EARLY_EXIT)
    assert r.returncode == 1, r.stderr
    assert "ronderun: rank 1 (host localhost) left first: it ended (with " in r.stderr, r.stderr
    assert "while the other ranks still needed it" in r.stderr


STOPPED = """
import os, signal, numpy as np, ronde as hvd
hvd.init()
hvd.allreduce(np.ones(4), name="warm")
if hvd.rank() == int(os.environ["STOP_RANK"]):
    os.kill(os.getpid(), signal.SIGSTOP)  # alive, silent: its peers lose it
for i in range(100000):
    hvd.allreduce(np.ones(4), name="step")
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_, stopped", [(3, 1), (4, 2)])
def test_the_summary_leads_with_a_stopped_rank_not_a_survivor(np_: int, stopped: int) -> None:
    """Issue #50: the peers of a SIGSTOPped rank fail with PeerLostError naming it; the
    summary blamed the first survivor to exit, since ronderun then stopped the silent
    rank itself. A stopped rank also takes ronderun's SIGTERM at once (SIGCONT)."""
    r = ronderun("-np", str(np_), PY, "-c", STOPPED, timeout=80,
                 env={"STOP_RANK": str(stopped), "RONDE_STALL_SHUTDOWN_TIME": "2"})
    assert r.returncode == 1, r.stderr
    summary = [line for line in r.stderr.splitlines() if line.startswith("ronderun:")]
    assert summary[0] == (f"ronderun: rank {stopped} (host localhost) failed first: it stopped "
                          "answering while it still ran (its peers lost it; stopped or hung?), "
                          "then ronderun had to stop it (killed by signal SIGTERM)"), r.stderr
    assert f"PeerLostError: rank {stopped} (host localhost) stopped responding" in r.stderr


ELASTIC_EARLY_EXIT = """
import sys, numpy as np, ronde as hvd
from ronde.elastic import ObjectState, run

hvd.init()

@run
def train(state):
    while state.step < 1000:
        hvd.allreduce(np.ones(3), name="x")
        if state.step == 3 and hvd.rank() == 1:
            sys.exit(0)  # leaves the elastic job early
        state.step += 1
        state.commit()

train(ObjectState(step=0))
"""


@pytest.mark.timeout(90)
def test_the_elastic_summary_leads_with_a_rank_that_left_early_with_exit_code_0() -> None:
    """Issue #50: the elastic launcher blamed a survivor (the first to exit non-zero)."""
    r = ronderun("-np", "3", "--min-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                 PY, "-c", ELASTIC_EARLY_EXIT, timeout=80)
    assert r.returncode == 1, r.stderr
    summary = [line for line in r.stderr.splitlines() if line.startswith("ronderun:")
               and not line.startswith("ronderun: elastic: ")]
    assert summary[0].startswith("ronderun: rank 1 (host 127.0.0.2) left first: it ended "
                                 "(with exit code 0) while the other ranks still needed it"), \
        r.stderr


@pytest.mark.timeout(60)
def test_torchrun_variables_can_be_turned_off() -> None:
    """RONDE_TORCHRUN_ENV=0: neither ronderun nor init() sets them (ronde's optimizer
    inside a one-process Trainer loop, docs/huggingface.md)."""
    script = ("import os, ronde as hvd; hvd.init(); "
              "print(os.environ.get('RANK', '-'), os.environ.get('MASTER_PORT', '-'))")
    r = ronderun("-np", "2", "-x", "RONDE_TORCHRUN_ENV=0", PY, "-c", script)
    assert r.returncode == 0, r.stderr
    assert rank_lines(r.stdout) == {0: ["- -"], 1: ["- -"]}
