"""In-process point-to-point endpoints connected by queues: threads as ranks.

Used by the unit tests of the collective algorithms (and handy for users who
want to test code written against :class:`ronde.collectives.p2p.P2P`). Each
ordered pair of ranks has its own thread-safe FIFO queue. ``send`` copies the
bytes into the queue and never blocks; ``recv`` copies them out and checks that
the message has exactly the expected length.

Example::

    from ronde.transport.loopback import run_threads
    from ronde.collectives import barrier

    run_threads(4, barrier)
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, TypeVar

__all__ = ["LoopbackAbortedError", "LoopbackEndpoint", "LoopbackGroup", "run_threads"]

T = TypeVar("T")

_POLL_S = 0.05


class LoopbackAbortedError(RuntimeError):
    """A ``recv`` gave up because another rank of the loopback group failed."""


class LoopbackGroup:
    """``size`` in-process endpoints, fully connected by queues.

    Args:
        size: Number of ranks (at least 1).
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"LoopbackGroup: size must be at least 1, got {size}")
        self.size = size
        self._queues: dict[tuple[int, int], queue.SimpleQueue[bytes]] = {
            (src, dst): queue.SimpleQueue() for src in range(size) for dst in range(size)
        }
        self._aborted = threading.Event()
        self._endpoints = [LoopbackEndpoint(self, rank) for rank in range(size)]

    def endpoint(self, rank: int) -> LoopbackEndpoint:
        """The endpoint of ``rank``."""
        self._check_rank(rank, "endpoint")
        return self._endpoints[rank]

    def abort(self) -> None:
        """Make every pending and future ``recv`` raise :class:`LoopbackAbortedError`."""
        self._aborted.set()

    def _check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"loopback {what}: rank {rank} is outside 0..{self.size - 1}")

    def _put(self, src: int, dst: int, buf: memoryview) -> None:
        self._check_rank(dst, "send")
        if len(buf) == 0:
            return
        self._queues[(src, dst)].put(bytes(buf.cast("B")))

    def _get(self, src: int, dst: int, buf: memoryview) -> None:
        self._check_rank(src, "recv")
        out = buf.cast("B")
        if len(out) == 0:
            return
        q = self._queues[(src, dst)]
        while True:
            if self._aborted.is_set():
                raise LoopbackAbortedError(f"rank {dst}: recv from {src} aborted, another rank failed")
            try:
                data = q.get(timeout=_POLL_S)
                break
            except queue.Empty:
                continue
        if len(data) != len(out):
            raise ValueError(
                f"rank {dst}: recv from rank {src} expected {len(out)} bytes, the message has "
                f"{len(data)}; the two ranks disagree on counts or dtype"
            )
        out[:] = data


class LoopbackEndpoint:
    """One rank's :class:`~ronde.collectives.p2p.P2P` endpoint in a :class:`LoopbackGroup`."""

    def __init__(self, group: LoopbackGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.size = group.size

    def send(self, peer: int, buf: memoryview) -> None:
        """Copy ``buf`` into the queue towards ``peer`` (never blocks)."""
        self.group._put(self.rank, peer, buf)

    def recv(self, peer: int, buf: memoryview) -> None:
        """Wait for the next message from ``peer`` and copy it into ``buf``."""
        self.group._get(peer, self.rank, buf)

    def sendrecv(
        self, send_peer: int, send_buf: memoryview, recv_peer: int, recv_buf: memoryview
    ) -> None:
        """Send then receive; cannot deadlock because ``send`` never blocks."""
        self.group._put(self.rank, send_peer, send_buf)
        self.group._get(recv_peer, self.rank, recv_buf)


def run_threads(
    size: int, fn: Callable[[LoopbackEndpoint], T], timeout_s: float = 30.0
) -> list[T]:
    """Run ``fn(endpoint)`` for every rank of a fresh :class:`LoopbackGroup`, one thread each.

    Returns:
        The return values, in rank order.

    Raises:
        The first exception raised by a rank (other ranks are then aborted), or
        ``TimeoutError`` when some ranks have not finished after ``timeout_s``
        seconds (typically a mismatched collective: every rank must make the same
        calls).
    """
    group = LoopbackGroup(size)
    done: queue.SimpleQueue[tuple[int, bool, object]] = queue.SimpleQueue()

    def body(rank: int) -> None:
        try:
            done.put((rank, True, fn(group.endpoint(rank))))
        except BaseException as exc:  # reported to the caller below
            done.put((rank, False, exc))

    for rank in range(size):
        threading.Thread(target=body, args=(rank,), name=f"loopback-rank-{rank}", daemon=True).start()

    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < size:
        remaining = deadline - time.monotonic()
        try:
            rank, ok, value = done.get(timeout=max(remaining, 0.0))
        except queue.Empty:
            group.abort()
            if errors:
                break
            missing = sorted(set(range(size)) - results.keys())
            raise TimeoutError(
                f"run_threads: ranks {missing} of {size} did not finish within {timeout_s} s; "
                "probably a deadlock (ranks made different collective calls or counts)"
            ) from None
        if ok:
            results[rank] = value
        else:
            assert isinstance(value, BaseException)
            errors[rank] = value
            if not group._aborted.is_set():
                group.abort()
                # The others now fail fast in recv; give them a moment to report.
                deadline = min(deadline, time.monotonic() + 5.0)
    if errors:
        real = {r: e for r, e in errors.items() if not isinstance(e, LoopbackAbortedError)}
        first = real or errors
        raise first[min(first)]
    return [results[rank] for rank in range(size)]  # type: ignore[misc]
