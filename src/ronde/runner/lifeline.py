"""A worker's lifeline to its launcher: the worker stops when ``ronderun`` is gone.

``ronderun`` starts every worker with a pipe it holds open and never writes
(``launch._Job._spawn``): a local worker inherits the read end as the descriptor named
by ``RONDE_LAUNCHER_FD`` (``"fd:inode"``); a remote worker's is its standard input
(``"0"``), which stays open through the remote shell after the secret's line. When the
launcher dies, however it dies (SIGKILL included), the kernel closes its end and a read
of the pipe returns end-of-file. :func:`watch` (called by ``init()``) reads it on a
daemon thread that costs nothing until then; at end-of-file the worker is stopped:
SIGTERM to its process group (a handler can still commit, and a save in progress
finishes: ronde/checkpoint.py), SIGKILL ``RONDE_STOP_GRACE`` seconds later (default 10). Without this, workers went on training under PID 1 until their loop ended.

A process that did not come from ``ronderun`` has no ``RONDE_LAUNCHER_FD`` and no
watcher. The variable is removed from the environment once read, so processes the
worker starts do not take the descriptor (which they do not have) for theirs; a
descriptor that is not the launcher's pipe (another inode, not a pipe) is ignored.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time

log = logging.getLogger(__name__)

#: seconds between the SIGTERM and the SIGKILL once the launcher is gone
GRACE_S = 10.0
_watching = False


def watch() -> bool:
    """Start watching the launcher's pipe, once per process; True when watching."""
    global _watching
    if _watching:
        return True
    raw = os.environ.pop("RONDE_LAUNCHER_FD", "")
    fd = _pipe_fd(raw)
    if fd is None:
        return False
    _watching = True
    threading.Thread(target=_wait, args=(fd,), name="ronde-lifeline", daemon=True).start()
    return True


def _pipe_fd(raw: str) -> int | None:
    """The descriptor ``raw`` names, if it is the launcher's pipe."""
    if not raw:
        return None
    fd_text, _, inode = raw.partition(":")
    try:
        fd = int(fd_text)
        st = os.fstat(fd)
    except (ValueError, OSError):
        return None
    if not (stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
        return None
    if inode and str(st.st_ino) != inode:
        return None
    return fd


def _wait(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 4096)
        except InterruptedError:
            continue
        except OSError:
            return  # closed by the process itself: nothing to watch
        if not data:
            break
    _stop()


def _stop() -> None:
    """The launcher is gone: stop this worker and what it started."""
    log.error("ronde: the launcher (ronderun) is gone; this worker stops (pid %d)", os.getpid())
    own_group = os.getpgrp() == os.getpid()
    from .._config import setting

    try:
        grace_s = float(setting("stop_grace_s") or GRACE_S)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a bad value was refused at init(); stop anyway
        grace_s = GRACE_S
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            if own_group:
                os.killpg(os.getpid(), sig)
            else:
                os.kill(os.getpid(), sig)
        except OSError:
            pass
        time.sleep(grace_s)
