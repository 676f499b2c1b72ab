"""The counters of an shm communicator's members, and the waits on them.

Where it sits: ``communicator.py`` and ``single_copy.py`` synchronise only through
:meth:`Counters.publish` (the owner raises one of its counters) and
:meth:`Counters.wait_for` (wait until a member's counter reaches a value); see
``protocol.py`` for what each counter means.

How a wait waits. It spins a few dozen reads (a peer that is already there answers
within them); then, while every member has a core of its own and a thread of this
process waits for a result (``urgent``), it polls with the CPU (and the GIL) yielded for
up to ``YIELD_S`` (peers of a collective usually arrive within that); then it sleeps on
the counter's futex (``transport/futex.py``). With more members than cores it does not
poll at all: a poller takes the core that the member it waits for needs (measured:
yielding pollers made 8 ranks on 2 cores 10x slower than Gloo). Nor while nobody waits
for the result (a gradient bucket's allreduce while the backward pass runs): the
poller's yields hand the core back and forth with the thread that computes, and cost
CPU on both sides, for a result nobody needs yet; the futex costs the peer one wake-up.
Sleeping is a handshake on the owner's segment: the waiter writes which counter it
sleeps on into its own word of the owner's *sleepers* table, fences, looks at the
counter once more and sleeps while it still holds the value seen; the owner stores
the counter, fences and wakes the counter's futex only when some word of its table
names that counter. One of the two always sees the other's store, and the
kernel compares the counter atomically with the wake, so no wake-up is lost, and a
publish costs no system call while nobody sleeps. A sleep lasts at most
``SLEEP_CHECK_S``, so the engine's abort flag and the progress timeout are looked at.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from typing import Callable

import numpy as np

from .. import futex
from ..mailbox import fence
from .protocol import MAX_SLEEPERS, SLEEPERS_OFFSET, SLOTS, YIELD_S

#: the longest a futex sleep lasts before the wait looks at the abort flag again
SLEEP_CHECK_S = 0.05
#: a wait this long warns (Horovod's stall warning comes after 60 s too)
STALL_WARN_S = 60.0

log = logging.getLogger(__name__)


class Counters:
    """Every member's counters (``headers[j]``, int64 views) and the waits on them."""

    def __init__(self, maps: list[mmap.mmap], rank: int, members: list[int],
                 aborted: Callable[[], BaseException | None],
                 progress_timeout_s: float = 0.0,
                 urgent: Callable[[], bool] | None = None,
                 stall_warn_s: float = STALL_WARN_S) -> None:
        self.rank, self.members, self.size = rank, members, len(members)
        #: a wait this long logs a warning naming the member it waits for (once a wait)
        self.stall_warn_s = stall_warn_s
        self._warned = 0.0  #: the start of the wait that warned last
        self._aborted = aborted
        #: whether a thread of this process waits for a result now (waits poll only
        #: then; None: always, where nobody says)
        self._urgent = urgent
        #: fail when a peer makes no progress for this long (0: wait for ever)
        self.progress_timeout_s = progress_timeout_s
        self.headers = [np.frombuffer(mm, dtype=np.int64, count=SLOTS, offset=0)
                        for mm in maps]
        #: per member: its sleepers' words (who sleeps on which of its counters)
        self._sleepers = [np.frombuffer(mm, dtype=np.int64, count=MAX_SLEEPERS,
                                        offset=SLEEPERS_OFFSET) for mm in maps]
        self._my_hdr = self.headers[rank]
        self._addr = [int(h.ctypes.data) for h in self.headers]
        self._my_sleepers = self._sleepers[rank][: self.size]
        #: the same words as a memoryview: ``in`` on it costs 0.1 us where numpy's
        #: ``any()`` cost 1 us and two Python calls, on every publish
        self._marks = memoryview(self._my_sleepers)
        #: waits sleep on futexes (else in short steps)
        self.futex = futex.AVAILABLE and self.size <= MAX_SLEEPERS
        #: more members than cores: waits never poll (see the module docstring)
        self.oversubscribed = self.size > futex.cores()

    def check(self) -> None:
        """Raise the engine's failure, if any."""
        err = self._aborted()
        if err is not None:
            raise err

    def publish(self, idx: int, t: int) -> None:
        """Set my counter ``idx`` to ``t`` (peers waiting for it may go on), and wake
        the members asleep on it (the store, a fence, then a look at their marks: the
        other half of the handshake in :meth:`wait_for`)."""
        self._my_hdr[idx] = t
        if self.futex:
            fence()
            if idx + 1 in self._marks:
                futex.wake(self._addr[self.rank] + 8 * idx)

    def wait_all(self, idx: int, t: int, poll: bool = True) -> None:
        """Wait until every other member's counter ``idx`` reaches ``t``."""
        for j in range(self.size):
            if j != self.rank:
                self.wait_for(j, idx, t, poll)

    def wait_for(self, j: int, idx: int, t: int, poll: bool = True) -> None:
        """Wait until member ``j``'s counter ``idx`` reaches ``t``.

        Spin a little, then (unless :attr:`oversubscribed`, ``poll`` is false, or nobody
        waits for the result: ``urgent``) poll with the CPU (and the GIL) yielded for up
        to ``YIELD_S`` (peers of a collective usually arrive within that), then sleep on
        the counter's futex (mark, fence, look, sleep: the other half is :meth:`publish`),
        waking every ``SLEEP_CHECK_S`` to check the engine's abort flag and the progress
        timeout. ``time.sleep(0)`` is not a yield here: it costs a timer round trip
        (~70 us).
        """
        hdr = self.headers[j]
        if hdr[idx] >= t:
            return
        for _ in range(64):
            if hdr[idx] >= t:
                return
        start = time.monotonic()
        urgent = self._urgent
        if poll and not self.oversubscribed and (urgent is None or urgent()):
            polls = 0
            while hdr[idx] < t:
                polls += 1
                os.sched_yield()
                if polls % 64:
                    continue
                self.check()
                if time.monotonic() - start > YIELD_S:
                    break
        if hdr[idx] >= t:
            return
        if not self.futex:
            sleep_s = 0.00002
            while hdr[idx] < t:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, 0.0002)
                self._wait_checks(j, start)
            return
        mark = self._sleepers[j]
        address = self._addr[j] + 8 * idx
        try:
            while True:
                mark[self.rank] = idx + 1  # "I sleep on your counter idx"
                fence()
                seen = int(hdr[idx])
                if seen >= t:
                    return
                futex.wait(address, seen, SLEEP_CHECK_S)
                if hdr[idx] >= t:
                    return
                self._wait_checks(j, start)
        finally:
            mark[self.rank] = 0

    def _wait_checks(self, j: int, start: float) -> None:
        """A sleeping wait's periodic checks: the engine's abort flag, the stall warning,
        the progress timeout."""
        self.check()
        waited = time.monotonic() - start
        if waited > self.stall_warn_s and self._warned != start:
            self._warned = start
            log.warning("rank %d has waited %.0fs for rank %d in a shared-memory collective "
                        "(or the steady lane's check before one): that rank is slow, stuck, "
                        "or running other collectives", self.members[self.rank], waited,
                        self.members[j])
        if self.progress_timeout_s:
            if waited > self.progress_timeout_s:
                from ..._errors import PeerLostError

                g = self.members[j]
                raise PeerLostError(
                    f"rank {g} made no progress in a shared-memory collective for "
                    f"{waited:.0f}s; the process is alive but not taking part", rank=g)
