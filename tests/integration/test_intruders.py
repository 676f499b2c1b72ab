"""Intruders against a job started the torchrun way (issues #32 and #50): no code of
theirs runs.

Before issue #32, a job given no ``RONDE_SECRET`` authenticated with ``sha256`` of public
values (uid, launcher, run id, ``MASTER_ADDR``, ``MASTER_PORT``), rank 0's rendezvous
listened on every interface, and a second registration for a rank replaced the first: a
process started with the job's public values as ``RANK=1`` took rank 1's place and its
pickle ran on the other ranks. Before issue #50 such a job started *open* by default, an
intruder that registered first kept the real rank out with "RONDE_SECRET differs", and a
made-up generation was handed the secret. Each test here reproduces one step of those
attacks with real processes; the multi-host ones on simulated hosts
(``ronde.testing.netns``).
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from ronde import AuthenticationError, RendezvousError
from ronde.runner.rendezvous import register_open
from ronde.testing import netns
from ronde.transport import wire

pytestmark = pytest.mark.timeout(90)

#: a worker: init, then an object allgather (pickles), print what it got
WORKER = """
import os, sys, time, ronde as hvd
class Payload:
    def __reduce__(self):
        return (open, (os.environ["PWNED_PATH"], "w"))
try:
    hvd.init()
except Exception as exc:
    print("INIT-FAILED", type(exc).__name__, exc, flush=True)
    sys.exit(3)
print("JOINED", hvd.rank(), flush=True)
go = os.environ.get("GO_PATH")  # wait for the test's signal before the collective
while go and not os.path.exists(go):
    time.sleep(0.05)
mine = Payload() if os.environ.get("INTRUDER") else "honest %d" % hvd.rank()
exec(os.environ.get("BEFORE_GOT", ""))  # a test's probe
try:
    print("GOT", hvd.allgather_object(mine), flush=True)
except Exception as exc:
    print("FAILED", type(exc).__name__, exc, flush=True)
    sys.exit(4)
hvd.shutdown()
"""
OPEN = {"RONDE_OPEN_STARTUP": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, size: int, port: int, tmp_path, master: str = "127.0.0.1",
                 **extra: str) -> dict[str, str]:
    """The torchrun variables of one rank of a job spread over hosts (one rank a host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RONDE_", "HOROVOD_"))}
    env.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master, "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": "none", "RONDE_START_TIMEOUT": "20",
                "PWNED_PATH": str(tmp_path / "pwned"), **extra})
    return env


def start(env: dict[str, str], on: str = "") -> subprocess.Popen[str]:
    """A worker; ``on``: the simulated host (a namespace) to run it in."""
    where = ["ip", "netns", "exec", on] if on else []
    return subprocess.Popen([*where, sys.executable, "-c", WORKER], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(procs: list[subprocess.Popen[str]], timeout_s: float = 60) -> list[str]:
    """Every process's output, in order; one still running after ``timeout_s`` is killed."""
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    return outs


def wait_listening(port: int, timeout_s: float = 20.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {host}:{port}")


def wait_line(proc: subprocess.Popen[str], text: str, seen: list[str],
              timeout_s: float = 30.0) -> None:
    """Read ``proc``'s output into ``seen`` until a line holds ``text``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        seen.append(line)
        if text in line:
            return
        if not line:
            break
    raise AssertionError(f"no {text!r} in {seen}")


def test_a_job_across_hosts_without_a_secret_refuses_to_start(tmp_path) -> None:
    """No secret and ranks on several hosts: every rank refuses with the fix on the
    first line (issue #50: it started open, any process reaching rank 0 could take a
    rank); RONDE_OPEN_STARTUP=1 starts it as before."""
    port = free_port()
    outs = finish([start(torchrun_env(r, 2, port, tmp_path)) for r in range(2)])
    for out in outs:
        assert out.startswith("INIT-FAILED ConfigError export one RONDE_SECRET to every rank "
                              "of this job on every host: export RONDE_SECRET=$(python -c "
                              "'import secrets; print(secrets.token_hex(32))')"), outs
        assert "RONDE_OPEN_STARTUP=1 starts it anyway" in out
    port = free_port()
    outs = finish([start(torchrun_env(r, 2, port, tmp_path, **OPEN)) for r in range(2)])
    for r, out in enumerate(outs):
        assert f"JOINED {r}" in out and "GOT ['honest 0', 'honest 1']" in out, outs


def test_a_made_up_generation_gets_nothing_and_locks_no_one_out(tmp_path) -> None:
    """Registering every rank of a generation 99 with the public key got the job's
    secret and size and locked the real ranks out (issue #50); now each registration
    gets an error that names neither, and the real job starts."""
    port = free_port()
    rank0 = start(torchrun_env(0, 3, port, tmp_path, **OPEN))
    wait_listening(port + 1)
    got: dict[int, object] = {}

    def claim(r: int) -> None:
        try:
            got[r] = register_open(("127.0.0.1", port + 1), {"rank": r, "size": 3,
                                   "generation": 99, "host": "x", "addr": "127.0.0.1",
                                   "port": 1}, 10)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            got[r] = exc

    threads = [threading.Thread(target=claim, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(3):
        assert isinstance(got[r], RendezvousError), got
        assert "only to register one of the ranks its start-up is forming" in str(got[r])
        assert "3" not in str(got[r])
    others = [start(torchrun_env(r, 3, port, tmp_path, **OPEN)) for r in (1, 2)]
    outs = finish([rank0, *others])
    for r, out in enumerate(outs):
        assert f"JOINED {r}" in out and "GOT ['honest 0', 'honest 1', 'honest 2']" in out, outs


@pytest.mark.skipif(not netns.available(), reason="needs root and iproute2")
def test_an_intruder_on_a_third_host_in_a_ranks_place_ends_the_job(tmp_path) -> None:
    """An open start-up (RONDE_OPEN_STARTUP=1) on simulated hosts, an intruder on a third
    host registering first as rank 1 (issue #50: it got rank 1, its code ran on rank 0,
    and the real rank 1 was told "RONDE_SECRET differs").

    While the start-up forms, the real rank 1 arriving fails it on every rank, naming
    the intruder's address: nothing is exchanged. Once the intruder completed it (two
    ranks), the real rank 1 is told the address that took its place, and rank 0's job
    ends on that error: the collective it runs afterwards fails, the intruder's pickle
    never runs. (What a job exchanges before the real rank arrives it exchanges with the
    intruder: only a secret prevents that, docs/security.md.)"""
    with netns.SimulatedHosts(3) as hosts:
        h0, h1, h2 = hosts.namespaces
        a0, a1, a2 = hosts.addresses
        # three ranks: rank 0, the intruder as rank 1, the real rank 1, then rank 2
        port = free_port()
        env = lambda r, **x: torchrun_env(r, 3, port, tmp_path, master=a0, **OPEN, **x)  # noqa: E731
        rank0 = start(env(0), on=h0)
        wait_listening(port + 1, host=a0)
        intruder = start(env(1, INTRUDER="1"), on=h2)
        time.sleep(3.0)  # the intruder registers (orchestration only: nothing is timed)
        rank1 = start(env(1), on=h1)
        time.sleep(2.0)
        rank2 = start(env(2, RONDE_START_TIMEOUT="5"), on=h1)  # rank 0 may be gone
        outs = finish([rank0, intruder, rank1, rank2])
        assert not (tmp_path / "pwned").exists(), outs
        for out in outs[:3]:
            assert f"INIT-FAILED RendezvousError rank 1 registered twice, from {a2}:" in out, outs
            assert f"and then from {a1}:" in out
        assert "INIT-FAILED" in outs[3] and not any("JOINED" in o for o in outs), outs

        # two ranks: the intruder completes the start-up, the real rank 1 comes late
        port = free_port()
        go = tmp_path / "go"
        env = lambda r, **x: torchrun_env(r, 2, port, tmp_path, master=a0, **OPEN,  # noqa: E731
                                          GO_PATH=str(go), **x)
        rank0 = start(env(0), on=h0)
        wait_listening(port + 1, host=a0)
        intruder = start(env(1, INTRUDER="1"), on=h2)
        seen: list[str] = []
        wait_line(rank0, "JOINED 0", seen)
        late = finish([start(env(1), on=h1)])[0]
        assert f"INIT-FAILED RendezvousError rank 1's place in this job was taken by {a2}:" \
            in late, late
        go.touch()
        outs = finish([rank0, intruder])
        rank0_out = "".join(seen) + outs[0]
        assert not (tmp_path / "pwned").exists(), (rank0_out, outs[1])
        assert f"FAILED PeerLostError rank 1 was claimed by {a1}:" in rank0_out, rank0_out
        assert f"after the job had started with {a2}:" in rank0_out
        assert "GOT" not in rank0_out


def test_a_second_process_claiming_a_rank_fails_the_job_and_runs_nothing(tmp_path) -> None:
    """The real rank 1 registered; a process claiming rank 1 too (the public values
    suffice) no longer replaces it: the start-up fails on every rank, naming both."""
    port = free_port()
    rank0 = start(torchrun_env(0, 3, port, tmp_path, **OPEN))
    wait_listening(port + 1)
    rank1 = start(torchrun_env(1, 3, port, tmp_path, **OPEN))
    time.sleep(3.0)  # rank 1 registers (orchestration only: nothing is timed)
    intruder = start(torchrun_env(1, 3, port, tmp_path, INTRUDER="1", **OPEN))
    time.sleep(2.0)
    rank2 = start(torchrun_env(2, 3, port, tmp_path, **{**OPEN,  # rank 0 may be gone
                                                        "RONDE_START_TIMEOUT": "5"}))
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
    the public key of the open start-up is refused once its window closed (it may tell
    a late rank who took its place until then: ``RONDE_START_TIMEOUT``)."""
    port = free_port()
    procs = [start(torchrun_env(r, 2, port, tmp_path, RONDE_START_TIMEOUT="6",
                                BEFORE_GOT="time.sleep(10)", **OPEN)) for r in range(2)]
    try:
        wait_listening(port + 1)
        time.sleep(7.0)  # both ranks joined, the open window closed (orchestration only)
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
    probe = ('from ronde import _state\n'
             'print("MESH", hvd.rank(), _state.current().mesh._listener.getsockname()[0])\n'
             'from ronde.runner import meeting\nsrv = meeting._rank0_server\n'
             'print("RDV", hvd.rank(), srv._sock.getsockname()[0] if srv else "-", flush=True)')
    procs = [start(torchrun_env(r, 2, port, tmp_path, RONDE_SECRET="ab" * 16, BEFORE_GOT=probe))
             for r in range(2)]
    outs = finish(procs)
    assert "MESH 0 127.0.0.1" in outs[0] and "RDV 0 127.0.0.1" in outs[0], outs
    assert "MESH 1 127.0.0.1" in outs[1], outs
