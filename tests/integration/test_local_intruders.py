"""Another user of the same host against a one-host job started the torchrun way
(issue #50, items 1-3): nothing it plants in a shared ``/tmp`` or ``/dev/shm`` is read,
followed or mapped; the job finishes right, or refuses with a ``SecurityError``.

Before, the ranks met through ``/tmp/ronde-rdv-<uid>-torchrun-<run id>-<port>.json``,
read with a plain ``open()``: another user wrote it first, with the port of a service
of its own, and rank 1 connected there (and unpickled what it was sent). Rank 0 wrote
it through ``<that name>.<pid>.tmp``, opened without ``O_EXCL``/``O_NOFOLLOW``: a file
planted there (0666, the intruder's) received the job's secret, a link sent it over a
file of the victim's. Shared-memory segments had predictable names in ``/dev/shm`` and
were opened with ``O_CREAT|O_TRUNC``: the job used the intruder's files.

The intruder is a forked child of the test that became ``nobody`` (uid 65534): the tests
need root (CI runs as root). The victim's shared folder is a ``1777`` folder of the
test's own (its ``TMPDIR``), not the machine's ``/tmp``.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from multiprocessing.connection import Connection
from typing import Any, Callable

import pytest

from .test_intruders import finish

NOBODY = 65534
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the intruder is a forked "
                       "child that becomes another user (nobody, uid 65534); CI runs as root"),
]

#: a rank: two inits (a re-init makes new segments), an allreduce and an object
#: allgather (pickles) in each
WORKER = """
import sys, numpy as np, ronde as hvd
for round in (1, 2):
    try:
        hvd.init()
    except Exception as exc:
        print("INIT-FAILED", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    s = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="s%d" % round)
    print("ROUND", round, hvd.rank(), int(s[0]), hvd.allgather_object(hvd.rank()),
          hvd.active_transport(), flush=True)
    hvd.shutdown()
"""
RIGHT = ["ROUND 1 {r} 3 [0, 1] shm", "ROUND 2 {r} 3 [0, 1] shm"]


# -- the intruder --------------------------------------------------------------------------
def _as_nobody(plan: Callable[..., None], conn: Connection, args: tuple[Any, ...]) -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    os.umask(0)
    try:
        plan(conn, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", repr(exc)))


class Intruder:
    """``plan(conn, *args)`` run by a forked child of the test as ``nobody``; the test
    talks to it over ``conn`` (:meth:`ask`)."""

    def __init__(self, plan: Callable[..., None], *args: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_as_nobody, args=(plan, child, args), daemon=True)
        self.proc.start()

    def ask(self, message: Any = None, timeout_s: float = 30.0) -> Any:
        if message is not None:
            self.conn.send(message)
        assert self.conn.poll(timeout_s), "the intruder did not answer"
        answer = self.conn.recv()
        assert not (isinstance(answer, tuple) and answer[:1] == ("error",)), answer
        return answer

    def close(self) -> None:
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _fake_rank0(conn: Connection, paths: list[str], kind: str) -> None:
    """Plant a rendezvous file naming a service of the intruder's at each path (a 0666
    file, or a link to one), count who connects to it, report the count when asked."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    text = '{"port": %d, "secret": "%s"}' % (srv.getsockname()[1], "ab" * 32)
    for path in paths:
        target = f"{path}.target" if kind == "symlink" else path
        with open(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666), "w") as fh:
            fh.write(text)
        if kind == "symlink":
            os.symlink(target, path)
    seen = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                seen.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept)
    t.start()
    conn.send("ready")
    conn.recv()
    stop.set()
    t.join()
    conn.send(len(seen))


# -- the victim ----------------------------------------------------------------------------
@pytest.fixture
def shared():
    """A world-writable sticky folder (what /tmp is), the victim's TMPDIR."""
    path = tempfile.mkdtemp(prefix="ronde-shared-")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(rank: int, port: int, shared: str) -> subprocess.Popen[str]:
    """One rank of a two-rank torchrun job on this host, run id ``none`` (the default)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RONDE_", "HOROVOD_")) and k != "XDG_RUNTIME_DIR"}
    env.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": "none", "RONDE_START_TIMEOUT": "20",
                "RONDE_TRANSPORT": "shm", "TMPDIR": shared})
    return subprocess.Popen([sys.executable, "-c", WORKER], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def assert_right(outs: list[str]) -> None:
    for r, out in enumerate(outs):
        for line in RIGHT:
            assert line.format(r=r) in out, outs


def old_file(shared: str, port: int) -> str:
    """Where the ranks of such a job met before (a name anyone can tell)."""
    return os.path.join(shared, f"ronde-rdv-{os.getuid()}-torchrun-none-{port}.json")


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_a_planted_rendezvous_file_is_never_read(shared, kind) -> None:
    """The intruder's rendezvous file (0666, or a link to one) at the old name: rank 1,
    started first, read it and connected to the intruder's service. Now the ranks meet
    in their user's private directory and never look there."""
    port = free_port()
    intruder = Intruder(_fake_rank0, [old_file(shared, port)], kind)
    try:
        assert intruder.ask() == "ready"
        rank1 = start(1, port, shared)
        try:
            rank1.wait(2.0)  # rank 1 looks for rank 0's file first (orchestration only)
        except subprocess.TimeoutExpired:
            pass
        outs = finish([start(0, port, shared), rank1])
        assert intruder.ask("count") == 0, outs
    finally:
        intruder.close()
    assert_right(outs)


def _plant_at_pid(conn: Connection, template: str, kind: str, target: str) -> None:
    """Once told rank 0's pid: plant at the name of its temporary file a 0666 file held
    open (to read what is written into it), or a link to a file of the victim's."""
    path = template.format(pid=conn.recv())
    fd = -1
    if kind == "symlink":
        os.symlink(target, path)
    else:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    conn.send("ready")
    conn.recv()
    conn.send(os.pread(fd, 4096, 0) if fd >= 0 else b"")


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_rank0s_temporary_file_cannot_be_planted(shared, tmp_path, kind) -> None:
    """Rank 0 wrote the job's secret through ``<old name>.<pid>.tmp``: a file planted
    there gave the intruder the secret, a link overwrote a file of the victim's. Now its
    temporary file has a random name, in the private directory, made with O_EXCL."""
    port = free_port()
    precious = tmp_path / "precious"
    precious.write_text("precious")
    intruder = Intruder(_plant_at_pid, old_file(shared, port) + ".{pid}.tmp", kind,
                        str(precious))
    try:
        rank0 = start(0, port, shared)
        assert intruder.ask(rank0.pid) == "ready"  # (while rank 0 imports numpy)
        outs = finish([rank0, start(1, port, shared)])
        leaked = intruder.ask("read")
    finally:
        intruder.close()
    assert leaked == b"" and precious.read_text() == "precious", (leaked, outs)
    assert_right(outs)


def _make_private_dir(conn: Connection, path: str, kind: str, port: int) -> None:
    """Make the victim's private directory first: the intruder's own (0700 or 0777), or
    a link to a folder of its own; with a rendezvous file in it naming its service."""
    real = path if kind != "symlink" else f"{path}-intruder"
    os.mkdir(real, 0o777 if kind == "0777" else 0o700)
    if kind == "symlink":
        os.symlink(real, path)
    _fake_rank0(conn, [os.path.join(real, f"rdv-torchrun-none-{port}.json")], "file")


@pytest.mark.parametrize("kind", ["theirs", "0777", "symlink"])
def test_a_private_directory_made_by_another_user_stops_the_job(shared, kind) -> None:
    """The intruder made ``<tmp>/ronde-<uid>`` first: every rank refuses to start with a
    SecurityError naming it and the fix; nothing there is read."""
    port = free_port()
    path = os.path.join(shared, f"ronde-{os.getuid()}")
    intruder = Intruder(_make_private_dir, path, kind, port)
    try:
        assert intruder.ask() == "ready"
        outs = finish([start(r, port, shared) for r in (0, 1)])
        assert intruder.ask("count") == 0, outs
    finally:
        intruder.close()
    wrong = {"theirs": f"is owned by uid {NOBODY}, not by this user",
             "0777": f"is owned by uid {NOBODY}, not by this user",
             "symlink": "is a symbolic link, not a directory"}[kind]
    for out in outs:
        assert f"INIT-FAILED SecurityError ronde's private directory {path} {wrong}" in out, \
            outs
        assert "XDG_RUNTIME_DIR" in out and "TMPDIR" in out


def _plant_segments(conn: Connection, paths: list[str]) -> None:
    """A 0666 file of the intruder's at every other name, a link to one at the rest."""
    for i, path in enumerate(paths):
        if i % 2:
            target = os.path.join("/dev/shm", f"intruder-{uuid.uuid4().hex}")
            with open(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666), "wb") as fh:
                fh.write(b"target")
            os.symlink(target, path)
        else:
            with open(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666), "wb") as fh:
                fh.write(b"attacker")
    conn.send("ready")


def test_planted_shared_memory_segments_are_never_mapped(shared) -> None:
    """The intruder's files and links at every segment name the job used to take (two
    generations: a re-init too): the job maps none of them, its own names cannot be
    told without the job's secret, and it finishes right, leaving nothing behind."""
    port = free_port()
    key = f"torchrun_none_{port}"
    old = [f"/dev/shm/ronde-{key}-g{gen}-{name}-{r}" for gen in (1, 2)
           for name in ("ps0", "ps0-lane", "ctl") for r in (0, 1)]
    intruder = Intruder(_plant_segments, old)
    try:
        assert intruder.ask() == "ready"
        before = {p: (os.lstat(p).st_ino, open(p, "rb").read()) for p in old}
        outs = finish([start(r, port, shared) for r in (0, 1)])
        after = {p: (os.lstat(p).st_ino, open(p, "rb").read()) for p in old}
        assert after == before, outs  # neither truncated, written, followed nor removed
        assert all(data in (b"attacker", b"target") for _, data in after.values())
        assert_right(outs)
        left = [f for f in os.listdir("/dev/shm") if f.startswith(f"ronde-{key}-")
                and os.lstat(os.path.join("/dev/shm", f)).st_uid == os.getuid()]
        assert not left, left
    finally:
        intruder.close()
        for f in os.listdir("/dev/shm"):
            if f.startswith((f"ronde-{key}-", "intruder-")):
                os.unlink(os.path.join("/dev/shm", f))
