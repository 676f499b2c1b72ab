"""Intruders against a job started the torchrun way (issue #32): no code of theirs runs.

Before, a job given no ``RONDE_SECRET`` authenticated with ``sha256`` of public values
(uid, launcher, run id, ``MASTER_ADDR``, ``MASTER_PORT``), rank 0's rendezvous listened
on every interface, and a second registration for a rank replaced the first: a process
started with the job's public values as ``RANK=1`` took rank 1's place and its pickle
ran on the other ranks. Each test here reproduces one step of that attack with real
processes.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time

import pytest

from ronde import AuthenticationError
from ronde.transport import wire

pytestmark = pytest.mark.timeout(90)

#: a worker: init, then an object allgather (pickles), print what it got
WORKER = """
import os, sys, ronde as hvd
class Payload:
    def __reduce__(self):
        return (open, (os.environ["PWNED_PATH"], "w"))
try:
    hvd.init()
except Exception as exc:
    print("INIT-FAILED", type(exc).__name__, exc, flush=True)
    sys.exit(3)
print("JOINED", hvd.rank(), flush=True)
mine = Payload() if os.environ.get("INTRUDER") else "honest %d" % hvd.rank()
print("GOT", hvd.allgather_object(mine), flush=True)
hvd.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, size: int, port: int, tmp_path, **extra: str) -> dict[str, str]:
    """The torchrun variables of one rank of a job spread over hosts (one rank a host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RONDE_", "HOROVOD_"))}
    env.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": "none", "RONDE_START_TIMEOUT": "20",
                "PWNED_PATH": str(tmp_path / "pwned"), **extra})
    return env


def start(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WORKER], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    return outs


def wait_listening(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def test_a_second_process_claiming_a_rank_fails_the_job_and_runs_nothing(tmp_path) -> None:
    """The real rank 1 registered; a process claiming rank 1 too (the public values
    suffice) no longer replaces it: the start-up fails on every rank, naming both."""
    port = free_port()
    rank0 = start(torchrun_env(0, 3, port, tmp_path))
    wait_listening(port + 1)
    rank1 = start(torchrun_env(1, 3, port, tmp_path))
    time.sleep(3.0)  # rank 1 registers (orchestration only: nothing is timed)
    intruder = start(torchrun_env(1, 3, port, tmp_path, INTRUDER="1"))
    time.sleep(2.0)
    rank2 = start(torchrun_env(2, 3, port, tmp_path))
    outs = finish([rank0, rank1, intruder, rank2])
    assert not (tmp_path / "pwned").exists(), outs
    for out in outs[:3]:  # the two ranks that waited, and the claimant
        assert "INIT-FAILED RendezvousError rank 1 registered twice, from 127.0.0.1:" in out, outs
        assert "and then from 127.0.0.1:" in out
    assert "INIT-FAILED" in outs[3]  # rank 2 came late: the start-up had already failed
    assert not any("JOINED" in out for out in outs), outs


def test_public_values_open_nothing_once_the_job_formed(tmp_path) -> None:
    """Without RONDE_SECRET the job's secret is random, made by rank 0: the old
    derivation from public values opens neither the rendezvous nor any rank's mesh, and
    the public key of the open start-up is refused once every rank has joined."""
    port = free_port()
    hold = "import time; time.sleep(8)\n"
    script = WORKER.replace('print("GOT"', hold + 'print("GOT"')
    procs = [subprocess.Popen([sys.executable, "-c", script], text=True,
                              env=torchrun_env(r, 2, port, tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    try:
        wait_listening(port + 1)
        time.sleep(3.0)  # both ranks joined (orchestration only)
        uid = str(os.getuid())
        derived = hashlib.sha256("\0".join(("ronde", uid, "torchrun", "none", "127.0.0.1",
                                            str(port))).encode()).digest()
        for key in (derived, wire.OPEN_KEY):
            with pytest.raises(AuthenticationError):
                wire.connect("127.0.0.1", port + 1, key, 5.0).close()
    finally:
        outs = finish(procs)
    for r, out in enumerate(outs):
        assert f"JOINED {r}" in out and "GOT ['honest 0', 'honest 1']" in out, outs
    assert not (tmp_path / "pwned").exists()


def test_rank0_listens_only_where_the_ranks_are_told(tmp_path) -> None:
    """Rank 0's rendezvous and every rank's mesh listener bind MASTER_ADDR's address
    (before: 0.0.0.0, every interface, even for MASTER_ADDR=127.0.0.1)."""
    port = free_port()
    probe = WORKER.replace(
        'print("GOT"',
        'from ronde import _runtime as rt, _state\n'
        'print("MESH", hvd.rank(), _state.current().mesh._listener.getsockname()[0])\n'
        'from ronde.runner import meeting\nsrv = meeting._rank0_server\n'
        'print("RDV", hvd.rank(), srv._sock.getsockname()[0] if srv else "-", flush=True)\n'
        'print("GOT"')
    procs = [subprocess.Popen([sys.executable, "-c", probe], text=True,
                              env=torchrun_env(r, 2, port, tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    outs = finish(procs)
    assert "MESH 0 127.0.0.1" in outs[0] and "RDV 0 127.0.0.1" in outs[0], outs
    assert "MESH 1 127.0.0.1" in outs[1], outs
