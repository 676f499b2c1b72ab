"""Which sockets are ready to read or write: ``select(2)``'s question without its limit.

``select.select`` raises ``ValueError`` for any descriptor numbered ``FD_SETSIZE``
(1024) or more, and a rank of a large job holds that many: the coordinator of a
thousand ranks has a control socket to each. :func:`wait` asks ``select`` (cheapest
for the few sockets of most calls) and, only where it refuses a descriptor, ``poll``,
which has no such limit.
"""

from __future__ import annotations

import contextlib
import os
import select
from typing import Any, Sequence

_IN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_OUT = select.POLLOUT | select.POLLHUP | select.POLLERR


def wait(readers: Sequence[Any], writers: Sequence[Any], timeout_s: float,
         ) -> tuple[list[Any], list[Any]]:
    """The objects of ``readers`` ready to read and of ``writers`` ready to write
    (sockets, descriptors, or anything with ``fileno()``), waiting up to ``timeout_s``."""
    try:
        readable, writable, _ = select.select(readers, writers, [], timeout_s)
        return readable, writable
    except ValueError:
        if any(_fd(s) < 0 for s in (*readers, *writers)):
            raise  # a closed socket: select's own error
    return _poll(readers, writers, timeout_s)


def _fd(s: Any) -> int:
    return s if isinstance(s, int) else s.fileno()


def _poll(readers: Sequence[Any], writers: Sequence[Any], timeout_s: float,
          ) -> tuple[list[Any], list[Any]]:
    masks: dict[int, int] = {}
    objs: dict[int, Any] = {}
    for s in readers:
        fd = _fd(s)
        masks[fd] = masks.get(fd, 0) | select.POLLIN
        objs[fd] = s
    wobjs: dict[int, Any] = {}
    for s in writers:
        fd = _fd(s)
        masks[fd] = masks.get(fd, 0) | select.POLLOUT
        wobjs[fd] = s
    poller = select.poll()
    for fd, mask in masks.items():
        poller.register(fd, mask)
    readable: list[Any] = []
    writable: list[Any] = []
    for fd, ev in poller.poll(max(0, int(timeout_s * 1000))):
        if ev & _IN and fd in objs:
            readable.append(objs[fd])
        if ev & _OUT and fd in wobjs:
            writable.append(wobjs[fd])
    return readable, writable


class Doorbell:
    """A pipe that wakes a thread blocked in :func:`wait` (pass the bell among its
    readers). One byte stays in the pipe until the woken thread drains it, so ringing
    again before then costs nothing.

    A thread that will block may also set :attr:`wanted` first, to be woken when some
    other thread reaches a point it cares about (the engine's control thread, waiting
    for its executor to run out of work): that thread calls :meth:`ring_if_wanted`,
    which costs nothing when nobody asked."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.pending = False  #: rung and not drained yet
        self.wanted = False  #: the woken thread asked for :meth:`ring_if_wanted`'s ring

    def fileno(self) -> int:
        return self._r

    def ring(self) -> None:
        self.pending = True
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._w, b"x")

    def ring_if_wanted(self) -> None:
        """Ring once if :attr:`wanted` (and clear it); nothing otherwise."""
        if self.wanted:
            self.wanted = False
            if not self.pending:
                self.ring()

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._r, 4096):
                pass
        # cleared after reading, so a ring racing with this still leaves a byte
        self.pending = False

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
