"""Start local workers by forking a process that imported their heavy modules once.

``import torch`` costs a worker about 1.5 s of CPU, TensorFlow about 5 s; every rank of
every job pays it again. A *zygote* is a process that imported them (``preload``) and
nothing else, and forks one child per local worker on request; the child becomes the
worker: its own session and process group, its standard streams on the launcher's
pipes, its environment, working directory and ``sys.argv`` the worker's, and then it
runs the worker's module (``python -m mod ...``) or script (``python script.py ...``)
as the interpreter would. The import is paid once per zygote, and the pages it filled
are shared copy-on-write by its children. ``ronde.testing.run_ranks`` keeps a zygote
per test process for the suite's launches (``RONDE_TESTING_PRELOAD``); ``launch.run``
takes ``preload=``.

What makes forking safe here, and where it is not used:

* The zygote starts no thread: it counts ``/proc/self/task`` after importing numpy
  (whose BLAS pool OpenBLAS itself stops around a fork) and again after the preloaded
  modules, and refuses to serve if they started one (a child would inherit its locks
  held); the launcher then starts workers the usual way. It never initialises a device
  or an OpenMP pool (importing torch does neither).
* It reaps its children itself (``SIGCHLD`` through a wake-up pipe, no thread) and
  reports each exit status to the launcher as ``subprocess`` would (``-N`` for a
  signal); the launcher signals a child's process group directly, as before.
* Only a worker whose command is this interpreter with ``-m module`` or a ``.py``
  script, started on this host, is forked; anything else (other flags, another
  interpreter, a remote rank) starts with ``subprocess`` as before.
* What a fork cannot give: settings the preloaded modules read from the environment
  at import time are the zygote's (the launcher keys its zygotes by that environment,
  so a different one gets another zygote); process state their import left (malloc's
  thresholds); Python's hash seed, which every child of one zygote shares (a set of
  strings iterates in the same order on every rank, where exec'd ranks each draw their
  own seed); and the child skips the interpreter's final clean-up of modules
  (``atexit`` handlers and non-daemon threads still run first). numpy's global random
  state is reseeded in each child, as a fresh process seeds it.

The protocol is one ``SOCK_SEQPACKET`` socket pair: JSON messages, the worker's
standard streams and lifeline passed as descriptors (``SCM_RIGHTS``). Nothing else
can reach it: the pair is created by the launcher and inherited by the zygote alone.
"""

from __future__ import annotations

import atexit
import importlib
import io
import itertools
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from typing import IO, Any, Mapping, Sequence

log = logging.getLogger("ronde")

#: the largest request (a worker's environment, argv and working directory)
_MAX_MESSAGE = 1 << 20
#: how long a zygote may take to import its modules and say it is ready: past it (an
#: import that hangs, or a machine so loaded that forking would not pay), it is stopped
#: and the workers start the usual way
START_TIMEOUT_S = 60.0


class ZygoteUnavailable(RuntimeError):
    """The zygote could not start or may not fork (the launcher falls back to exec)."""


# -- the zygote process ---------------------------------------------------------------------
def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1  # unknown: not served


#: the zygote's own PYTHONPATH entries (a child's sys.path takes the worker's instead)
_OWN_PYTHONPATH: list[str] = []


def serve(sock: socket.socket, modules: Sequence[str]) -> None:
    """The zygote's loop: import ``modules``, then fork a worker per request until the
    launcher's end of ``sock`` closes."""
    _OWN_PYTHONPATH[:] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        # numpy's BLAS starts its thread pool at import, and stops it around a fork
        # itself (OpenBLAS's pthread_atfork handlers): the baseline, not a risk
        importlib.import_module("numpy")
        baseline = _threads()
        for name in modules:
            importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - told to the launcher, which falls back
        sock.send(json.dumps({"error": f"cannot import: {exc!r}"}).encode())
        return
    threads = _threads()
    if threads != baseline or threads < 1:
        sock.send(json.dumps({"error": f"the imports started {threads - baseline} "
                              "thread(s): forking would copy their locks"}).encode())
        return
    sock.send(json.dumps({"ready": True}).encode())
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock in readable:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 8)
            if not msg:
                return  # the launcher is gone; the workers have their lifelines
            rid = None
            try:  # a request that fails is answered so; the workers running go on
                req = json.loads(msg)
                rid = req["id"]
                pid = os.fork()
            except Exception as exc:  # noqa: BLE001
                pid, error = -1, repr(exc)
            if pid == 0:
                _become_worker(req, fds, [sock.fileno(), wake_r, wake_w])
            for fd in fds:
                os.close(fd)
            reply = {"started": rid, "pid": pid} if pid > 0 else {"started": rid, "error": error}
            sock.send(json.dumps(reply).encode())
        _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become_worker(req: dict[str, Any], fds: list[int], zygote_fds: list[int]) -> None:
    """In the forked child: turn into the worker ``req`` describes, run it, exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in zygote_fds:
            os.close(fd)
        os.setsid()
        for target, fd in zip((0, 1, 2), fds[:3]):
            os.dup2(fd, target)
        for fd in fds[:3]:
            if fd > 2:
                os.close(fd)
        env = dict(req["env"])
        if len(fds) > 3:  # the lifeline: its number here, the same pipe
            os.set_inheritable(fds[3], True)
            env["RONDE_LAUNCHER_FD"] = f"{fds[3]}:{os.fstat(fds[3]).st_ino}"
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req["cwd"])
        _fresh_streams(env.get("PYTHONUNBUFFERED", "") not in ("", "0"))
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # (Python's random reseeds itself after a fork)
            numpy.random.seed()  # its own draws, as a fresh process seeds from the OS
        code = _run(req["argv"], env)
    except BaseException:  # noqa: BLE001 - whatever happens, this process ends here
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    os._exit(code)


def _fresh_streams(unbuffered: bool) -> None:
    """``sys.stdin/stdout/stderr`` on the descriptors 0-2 the child now has."""
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  line_buffering=True, write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True,
                                  write_through=True)


def _run(argv: list[str], env: Mapping[str, str]) -> int:
    """Run the worker's module or script as ``python`` would; its exit code."""
    zygote_path0 = sys.path[0]
    rest = [p for p in sys.path[1:] if p not in _OWN_PYTHONPATH and p != zygote_path0]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[1] == "-m":
        path0, sys.argv = os.getcwd(), [argv[2], *argv[3:]]
    else:
        path0, sys.argv = os.path.dirname(os.path.abspath(argv[1])), list(argv[1:])
    sys.path[:] = [path0, *dict.fromkeys(extra), *rest]
    try:
        try:
            if argv[1] == "-m":
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[1], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:  # noqa: BLE001 - as the interpreter: its excepthook, exit 1
            sys.excepthook(*sys.exc_info())  # ronde's installs a failure report there
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    return code


def _exit_code(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


# -- the launcher's side --------------------------------------------------------------------
def eligible(argv: Sequence[str]) -> bool:
    """Whether a zygote of this interpreter can run ``argv`` (``python -m mod ...`` or
    ``python script.py ...``, with this very interpreter)."""
    if len(argv) < 2:
        return False
    exe = argv[0] if os.sep in argv[0] else _which(argv[0])
    if exe is None or os.path.realpath(exe) != os.path.realpath(sys.executable):
        return False
    if argv[1] == "-m":
        return len(argv) >= 3 and not argv[2].startswith("-")
    return argv[1].endswith(".py") and not argv[1].startswith("-")


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


class ZygoteProcess:
    """What the launcher holds of a forked worker: ``subprocess.Popen``'s part it uses."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.stdin = None
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("<zygote worker>", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode


class Zygote:
    """A zygote process and the launcher's connection to it."""

    def __init__(self, modules: Sequence[str], env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ronde.runner.zygote", str(theirs.fileno()), *modules],
                env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        self.modules = tuple(modules)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._started: dict[int, Any] = {}
        self._procs: dict[int, ZygoteProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before the pid was handed out
        self.closed = False
        self.sock.settimeout(START_TIMEOUT_S)  # socket.timeout is an OSError: no answer
        reply = self._recv()
        self.sock.settimeout(None)
        if reply is None or not reply.get("ready"):
            if reply is None:  # still importing, perhaps: it would not see the EOF
                self.proc.kill()
            self.close()
            raise ZygoteUnavailable(
                f"preload {', '.join(modules)}: {reply.get('error') if reply else 'no answer'}")
        self._reader = threading.Thread(target=self._read, name="ronde-zygote", daemon=True)
        self._reader.start()

    def _recv(self) -> dict[str, Any] | None:
        try:
            msg = self.sock.recv(_MAX_MESSAGE)
        except OSError:
            return None
        return json.loads(msg) if msg else None

    def _read(self) -> None:
        while True:
            msg = self._recv()
            if msg is None:
                break
            if "started" in msg:
                slot = self._started.pop(msg["started"], None)
                if slot is not None and "pid" in msg:
                    slot.append(msg["pid"])
                    slot[0].set()
                elif slot is not None:
                    slot[0].set()  # the fork failed: spawn() says so
                elif "pid" in msg:  # a fork its spawn() gave up on: nobody owns it
                    try:
                        os.killpg(msg["pid"], signal.SIGKILL)
                    except OSError:
                        pass
            elif "exit" in msg:
                with self._lock:
                    proc = self._procs.pop(msg["exit"], None)
                    if proc is None:
                        self._early[msg["exit"]] = msg["code"]
                if proc is not None:
                    proc._exited(msg["code"])
        # the zygote is gone: its children cannot be waited for any more; stop them
        with self._lock:
            self.closed = True
            left, self._procs = list(self._procs.values()), {}
        for proc in left:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc._exited(-signal.SIGKILL)
        for slot in list(self._started.values()):
            slot[0].set()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str,
              lifeline: int | None) -> ZygoteProcess:
        """Fork a worker running ``argv`` (see :func:`eligible`) with ``env``."""
        if self.closed:
            raise ZygoteUnavailable("the zygote exited")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        fds = [null, out_w, err_w] + ([lifeline] if lifeline is not None else [])
        done = threading.Event()
        slot: list[Any] = [done]
        with self._lock:
            rid = next(self._ids)
            self._started[rid] = slot
        try:
            msg = json.dumps({"id": rid, "argv": list(argv), "env": dict(env), "cwd": cwd})
            with self._lock:
                socket.send_fds(self.sock, [msg.encode()], fds)
            if not done.wait(30.0) or len(slot) < 2:
                raise ZygoteUnavailable("the zygote did not fork the worker")
        except BaseException:
            self._started.pop(rid, None)
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        pid = slot[1]
        proc = ZygoteProcess(pid, os.fdopen(out_r, "rb", buffering=0),
                             os.fdopen(err_r, "rb", buffering=0))
        with self._lock:
            code = self._early.pop(pid, None)
            if code is None and self.closed:  # the zygote died since: nobody reaps it
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                code = -signal.SIGKILL
            if code is None:
                self._procs[pid] = proc
        if code is not None:
            proc._exited(code)
        return proc

    def close(self) -> None:
        """Stop the zygote (a worker of it still running is stopped: nobody could reap it)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # EOF for the zygote, and for our reader
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


#: zygotes of this process, by (modules, the environment they imported under)
_ZYGOTES: dict[tuple[Any, ...], Zygote] = {}
#: zygotes kept at once (each holds its imports' memory)
_KEEP = 2
#: variables that change between launches of one process without changing an import
_VOLATILE = ("PYTEST_CURRENT_TEST",)
_ZYGOTES_LOCK = threading.Lock()
#: keys whose zygote could not serve
_REFUSED: set[tuple[Any, ...]] = set()


def zygote_for(modules: Sequence[str], env: Mapping[str, str]) -> Zygote | None:
    """This process's zygote for ``modules`` under ``env`` (started on first use), or
    None where one cannot serve (the launcher then starts workers the usual way)."""
    # ronde's own settings are read at init() in the worker, never by a preloaded
    # module's import (unless ronde itself is preloaded): they do not split zygotes
    own = not any(m.split(".")[0] == "ronde" for m in modules)
    key = (tuple(modules), tuple(sorted(
        (k, v) for k, v in env.items()
        if k not in _VOLATILE and not (own and k.startswith("RONDE_")))))
    with _ZYGOTES_LOCK:
        z = _ZYGOTES.get(key)
        if z is not None and not z.closed:
            return z
        if key in _REFUSED:
            return None
        for old in list(_ZYGOTES):  # the oldest idle ones (another job may be running)
            if len(_ZYGOTES) < _KEEP:
                break
            if not _ZYGOTES[old]._procs:
                _ZYGOTES.pop(old).close()
        try:
            z = Zygote(modules, env)
        except (ZygoteUnavailable, OSError) as exc:
            _REFUSED.add(key)  # an import that failed, or a thread, stays so: ask once
            log.info("ronde: no zygote for %s (%s); workers start the usual way",
                     ", ".join(modules), exc)
            return None
        _ZYGOTES[key] = z
        return z


@atexit.register
def _close_all() -> None:
    for z in list(_ZYGOTES.values()):
        z.close()
    _ZYGOTES.clear()


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2:])
