"""Resident vectors of an shm communicator (the steady lane's gradient buckets): given
from the top of the data region, reduced where they lie after a meeting, and refused
where ``/dev/shm`` cannot back them."""

from __future__ import annotations

import errno
import threading
import uuid

import numpy as np
import pytest

from ronde.collectives.ops import ReduceOp, scale_inplace
from ronde.transport.segments import Names, remove_job_segments
from ronde.transport.shm import ShmCommunicator
from ronde.transport.shm.protocol import RESIDENT_FLOOR

pytestmark = pytest.mark.timeout(30)

SEGMENT = 1 << 20


def _pair(key: str) -> list[ShmCommunicator]:
    made: dict[int, ShmCommunicator] = {}
    threads = [threading.Thread(target=lambda r=r: made.setdefault(
        r, ShmCommunicator(r, [0, 1], Names(key, b"secret").of("t"), SEGMENT, lambda: None, timeout_s=5)))
        for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [made[0], made[1]]


def test_resident_vectors_are_reduced_where_they_lie():
    key = f"test{uuid.uuid4().hex[:8]}"  # (job_key() keeps it as it is)
    comms = _pair(key)
    try:
        count = 10_001  # odd: the two blocks differ in length
        values = [np.random.default_rng(r).standard_normal(count) for r in (0, 1)]
        bufs = [c.resident(count * 8).view(np.float64) for c in comms]
        ats = [c.offset_of(b) for c, b in zip(comms, bufs)]
        # from the top of the data region down, 64-byte aligned, the same on both
        assert ats[0] == ats[1] == (SEGMENT - count * 8) & ~63
        assert comms[0].segment_bytes == ats[0]  # staging shrank by it
        assert comms[0].offset_of(np.zeros(count)) == -1  # not in the segment
        assert comms[0].offset_of(bufs[1]) == -1  # the peer's: not mine
        got: dict[int, tuple] = {}

        scaled: dict[int, np.ndarray] = {}

        def run(r: int) -> None:
            bufs[r][:] = values[r]
            met = comms[r].meet(1, 7, at=ats[r])
            comms[r].allreduce_resident(ats[r], count, np.dtype(np.float64), ReduceOp.SUM)
            got[r] = met
            scaled[r] = bufs[r].copy()
            comms[r].meet(2, 8, at=ats[r])  # an average over 3 (joined ranks): 1/3 after
            comms[r].allreduce_resident(ats[r], count, np.dtype(np.float64), ReduceOp.SUM,
                                        1.0 / 3.0)

        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert got[0] == got[1] == ([7, 7], ats)
        want = values[0] + values[1]  # rank order: the bits of every other path
        for r in (0, 1):
            np.testing.assert_array_equal(scaled[r], want)
        # scaled on each block's owner before the copies: the bits of a scale after
        want = want + want
        scale_inplace(want, 1.0 / 3.0)
        for b in bufs:
            np.testing.assert_array_equal(b, want)
        # what does not fit above the staging floor is refused, and changes nothing
        before = comms[0].segment_bytes
        assert comms[0].resident(before - RESIDENT_FLOOR + 64) is None
        assert comms[0].segment_bytes == before
    finally:
        for c in comms:
            c.close()
        remove_job_segments(key)


class _FullShm:
    """Stands in for the segment's map where ``/dev/shm`` is full: populating fails."""

    def madvise(self, *args: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_dev_shm_that_cannot_back_a_vector_refuses_it():
    # a full tmpfs would kill the process with SIGBUS at the bucket's first write;
    # populating the range first turns that into a refusal (torch's memory then)
    key = f"test{uuid.uuid4().hex[:8]}"  # (job_key() keeps it as it is)
    comms = _pair(key)
    mine = comms[0]._mine
    try:
        comms[0]._mine = _FullShm()  # type: ignore[assignment]
        before = comms[0].segment_bytes
        assert comms[0].resident(4096) is None
        assert comms[0].segment_bytes == before
        comms[0]._mine = mine
        assert comms[0].resident(4096) is not None
    finally:
        comms[0]._mine = mine
        for c in comms:
            c.close()
        remove_job_segments(key)
