"""Negotiation frames between ranks of one host, through shared memory.

Where it sits: the engine's control thread exchanges one frame with every peer per
negotiation round (see ``core/engine.py``). Between ranks on the same host a
round-trip over a loopback socket costs ~50 us of system calls and wake-ups; through
a shared page it costs well under a microsecond when the peer is awake. This module
carries those frames; the TCP control sockets stay for everything else (peer death
shows as EOF there, failure notices, frames too large for a slot) and for *doorbells*
that wake a peer sleeping in ``select``.

Layout: each rank owns one segment (in ``/dev/shm``: ``segments.py``), written only by
it and mapped read-only in spirit by its same-host peers: a header of int64 counters
and two frame slots. Rounds are lock-step (every rank posts exactly one frame per
round and reads one from each peer before it can post the next), so two slots
suffice: when a rank posts round k+1 into slot (k+1) % 2, every peer has finished
round k-1, hence has read slot (k+1) % 2 already.

Posting round k: write the length and the bytes into slot k % 2, then store ``seq =
k``. On x86-64 (total store order) a reader that sees ``seq == k`` sees the bytes.
A frame larger than a slot is posted as length -1: "this round's frame comes over
the socket".

Sleeping and doorbells (a Dekker handshake): a reader that is about to sleep stores
``sleeping = 1``, fences, and checks every peer's ``seq`` once more; a writer stores
``seq``, fences, and sends a doorbell over the socket if the peer's ``sleeping`` is
set. At least one of the two sees the other's store, so no wake-up is lost. The
fence is an uncontended lock acquire/release (a locked instruction on x86-64).

Every byte read from a peer's slot is untrusted: lengths are bounded by the slot, and
the frame goes through the same parser as a socket frame.

Wanting a round: a rank that holds a round back until the other members of a
collective want it too (``core/holding.py``) stores the round it wants in ``WANT``,
fences, and reads every peer's; the same Dekker handshake makes sure that of two ranks
wanting the same round, at least one sees the other's word, so the last one to want it
starts it.
"""

from __future__ import annotations

import mmap
import threading
import time
from typing import Callable

import numpy as np

from .._errors import ProtocolError
from .segments import OwnedSegment, close_maps, create_segment

SEQ, SLEEPING, ATTACHED, LEN0, LEN1, WANT = 0, 1, 2, 3, 4, 5
_HEADER_BYTES = 4096
#: frame slot size; larger frames (rare: a first round announcing thousands of new
#: tensors, or a stall report) go over the socket
SLOT_BYTES = 512 * 1024
#: the size of a rank's mailbox segment (what ``/dev/shm`` gives it: ``shm_room.py``)
SEGMENT_BYTES = _HEADER_BYTES + 2 * SLOT_BYTES
#: the length recorded for "this round's frame is on the socket"
ON_SOCKET = -1

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (an uncontended lock round trip is a locked instruction)."""
    _fence_lock.acquire()
    _fence_lock.release()


class Mailboxes(OwnedSegment):
    """This rank's outgoing slot pair and its view of every same-host peer's."""

    def __init__(self, rank: int, peers: list[int], path_of: Callable[[int], str],
                 timeout_s: float) -> None:
        self.rank = rank
        self.peers = list(peers)
        total = SEGMENT_BYTES
        self._path = path_of(rank)
        self._mine = create_segment(self._path, total)
        self._maps: dict[int, mmap.mmap] = {}
        self._hdr: dict[int, np.ndarray] = {}
        self._my_hdr = np.frombuffer(self._mine, dtype=np.int64, count=8)
        deadline = time.monotonic() + timeout_s
        for r in self.peers:
            mm = self._open_peer(path_of(r), total, deadline)
            self._maps[r] = mm
            self._hdr[r] = np.frombuffer(mm, dtype=np.int64, count=8)
        self._my_hdr[ATTACHED] = 1

    # -- writer --------------------------------------------------------------------------
    def post(self, round_no: int, payload: bytes) -> bool:
        """Publish this rank's frame for ``round_no``; False if it must go by socket."""
        slot = round_no % 2
        fits = len(payload) <= SLOT_BYTES
        if fits:
            off = _HEADER_BYTES + slot * SLOT_BYTES
            self._mine[off: off + len(payload)] = payload
        self._my_hdr[LEN0 + slot] = len(payload) if fits else ON_SOCKET
        self._my_hdr[SEQ] = round_no
        if not self._unlinked:
            self._unlink_once_mapped()
        return fits

    def sleepers(self) -> list[int]:
        """Peers that may be asleep in ``select`` (call after :meth:`post` and a fence)."""
        out = []
        for r in self.peers:  # a loop, not a comprehension: this runs every round
            if self._hdr[r][SLEEPING]:
                out.append(r)
        return out

    def want(self, round_no: int) -> set[int]:
        """Say that this rank wants to start ``round_no``; return the peers that want it
        too (say it, fence, look: see the module docstring)."""
        self._my_hdr[WANT] = round_no
        fence()
        return self.wanting(round_no)

    def wanting(self, round_no: int) -> set[int]:
        """The peers that want ``round_no`` (after :meth:`want` of it: no store, no
        fence again)."""
        hdr = self._hdr
        out = set()
        for r in self.peers:  # a loop, not a comprehension: once a step
            if hdr[r][WANT] == round_no:
                out.add(r)
        return out

    def set_sleeping(self, flag: bool) -> None:
        self._my_hdr[SLEEPING] = 1 if flag else 0

    # -- reader --------------------------------------------------------------------------
    def ahead(self, round_no: int, gone: "set[int] | frozenset[int]" = frozenset()) -> bool:
        """Whether some peer has posted a round after ``round_no`` (it started one)."""
        hdr = self._hdr
        for r in self.peers:  # a loop, not any(generator): this runs every control cycle
            if hdr[r][SEQ] > round_no and r not in gone:
                return True
        return False

    def take(self, r: int, round_no: int) -> bytes | None | int:
        """Peer ``r``'s frame for ``round_no``: bytes, None (not posted yet) or
        :data:`ON_SOCKET`."""
        hdr = self._hdr[r]
        seq = int(hdr[SEQ])
        if seq < round_no:
            return None
        if seq > round_no + 1:
            raise ProtocolError(f"rank {r} posted negotiation round {seq} while this rank "
                                f"is at round {round_no}")
        slot = round_no % 2
        n = int(hdr[LEN0 + slot])
        if n == ON_SOCKET:
            return ON_SOCKET
        if not 0 <= n <= SLOT_BYTES:
            raise ProtocolError(f"rank {r} posted a negotiation frame of bad length {n}")
        off = _HEADER_BYTES + slot * SLOT_BYTES
        return self._maps[r][off: off + n]

    # -- lifetime ------------------------------------------------------------------------
    def _unlink_once_mapped(self) -> None:
        self._unlink_if(not self._unlinked
                        and all(h[ATTACHED] >= 1 for h in self._hdr.values()))

    def close(self) -> None:
        self._unlink_if(True)
        self._hdr.clear()
        self._my_hdr = None  # type: ignore[assignment]
        close_maps([self._mine, *self._maps.values()])
        self._maps.clear()

