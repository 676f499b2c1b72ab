"""The layout of a shared-memory segment and the meaning of its counters.

Every member of an shm communicator owns one segment: a header of int64 counter
slots that only the owner writes (one per phase of a collective, each raised to the
collective's sequence number ``t`` when the owner reaches it), a table of (address,
length) pairs for the single-copy paths, a data region of ``segment_bytes`` and two
small double-buffered regions for small allreduces. Peers read the counters and
data; :class:`~ronde.transport.shm.communicator.ShmCommunicator` (``publish``,
``wait_for``, ``wait_all``, ``begin``) is the only writer and waiter, and
:mod:`.single_copy` follows the same protocol through those methods.
"""

from __future__ import annotations

from ..balance import even as blocks  # noqa: F401 - the segment path's split (single-copy balances)

#: counters, then a table of (address, length) pairs for single-copy allreduces, then
#: one word per member: which of this owner's counters that member sleeps on (idx + 1,
#: 0 for none; written only by that member), so the owner wakes it (see ``futex.py``)
HEADER_BYTES = 64 * 1024
SLOTS = 16
TABLE_OFFSET = SLOTS * 8
#: members beyond this many never sleep on a futex (they sleep in short steps)
MAX_SLEEPERS = 512
SLEEPERS_OFFSET = HEADER_BYTES - 8 * MAX_SLEEPERS
TABLE_ENTRIES = (SLEEPERS_OFFSET - TABLE_OFFSET) // 16
#: allreduces of at least this size use cross-memory attach when every rank can
CMA_MIN_BYTES = 256 * 1024
CMA_CHUNK_BYTES = 1 << 20
#: allreduces up to this size take the one-synchronisation path through a small,
#: double-buffered region (every rank reduces all contributions itself)
SMALL_BYTES = 64 * 1024
#: how long a wait polls (yielding) before it starts to sleep
YIELD_S = 0.002
WRITTEN, REDUCED, DONE, ATTACHED, PID, PROBE, CMA_OK, NSEG = 0, 1, 2, 3, 4, 5, 6, 7
#: single-copy allreduce: elements of the owner's block reduced so far in this op
PROGRESS = 8
#: single-copy allreduce: nanoseconds this rank took over its block in this op
BUSY = 9
#: the steady lane's meetings (``ShmCommunicator.meet``, ``core/lane.py``): the last
#: meeting this member reached, and the tag it brought to it
MEET, MEET_TAG = 10, 11
#: the steady lane's meetings: where the member's vector lies in its data region (a
#: resident one, ``ShmCommunicator.resident``), or -1
MEET_AT = 12
#: data-region bytes kept for staging below the resident vectors (``resident``)
RESIDENT_FLOOR = 256 * 1024


def segment_total(segment_bytes: int) -> int:
    """The size of a segment file whose data region is ``segment_bytes``: header, data
    region, the two small regions (what ``/dev/shm`` gives it: ``shm_room.py``)."""
    return HEADER_BYTES + segment_bytes + 2 * SMALL_BYTES


#: what every member's probe word holds (peers read it, and write it back, to test)
PROBE_VALUE = 0x726F6E6465
