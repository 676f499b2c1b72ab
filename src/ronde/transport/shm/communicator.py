"""The shm data plane: collectives among ranks of one host through shared memory.

Each member owns one segment (a file in ``/dev/shm``, mapped by every member): a
small header of monotonically increasing counters that only the owner writes, and
a data region. A collective proceeds in *pieces* that fit the data region; for
each piece the owner copies its input in, bumps ``written``, and peers read what
they need straight from its segment. Counters are plain int64 stores: on x86-64
(total store order) a reader that sees a counter also sees the data written before
it, so no lock is needed. Waits (``counters.py``) spin briefly, then poll with the CPU
yielded while every member has a core of its own, then sleep on the counter's futex
until its owner publishes, checking the engine's abort flag, so a dead peer never
leaves a rank spinning.

Allreduce of N bytes among n ranks (per rank): copy in (N), reduce its own block
of N/n reading every member's block (N read, N/n written), copy the other blocks
out of their owners' segments (N(n-1)/n): about three passes over the data, two
when the engine fused straight into the segment (:meth:`staging`). Segment files
are unlinked as soon as every member has mapped them, so a crash leaves nothing in
``/dev/shm``.

Allreduces of at least ``CMA_MIN_BYTES`` skip the segment altogether when every rank
can use cross-memory attach (see ``single_copy.py``): peers read each other's tensors in
place, about one pass over the data plus half a reduction, and fused tensors need no
fusion buffer. The segment then only carries the counters and the address table.

The steady lane's gradient buckets may live in the segment itself (:meth:`resident`):
they are reduced where they lie, with no copy at all (:meth:`allreduce_resident`).

Whether they can is probed and agreed by every member once, when the communicator is
made (each reads, then writes back, a probe value in every peer; ``CMA_OK`` carries
the outcome): from then on which path an op takes is a pure function of its size,
the same on every rank, decided in one place (:meth:`reads_peers` for an allreduce,
:meth:`_single_copy` for the others).
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from typing import Callable

import numpy as np

from ..._errors import RendezvousError
from ...collectives.ops import ReduceOp, reduce_in_rank_order, reduce_into, scale_inplace
from .. import vm
from ..balance import BlockSplit
from .. import strategies
from ..base import Communicator
from ..hugepages import HugePages
from ..segments import OwnedSegment, close_maps, create_segment, shm_dir
from . import single_copy
from .counters import Counters
from .protocol import (ATTACHED, CMA_MIN_BYTES, CMA_OK, DONE, HEADER_BYTES, MEET, MEET_AT,
                       MEET_TAG, PID, PROBE, PROBE_VALUE, REDUCED, RESIDENT_FLOOR, SMALL_BYTES,
                       TABLE_ENTRIES, TABLE_OFFSET, WRITTEN, blocks, segment_total)

#: madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14), which Python's mmap does not name
_MADV_POPULATE_WRITE = 23


class ShmCommunicator(Communicator, OwnedSegment):
    """Collectives among the members of one process set that share a host (member
    ``r``'s segment at ``path_of(r)``: ``segments.Names.of``)."""

    name = "shm"
    allreduce_strategies = strategies.SHARED_MEMORY
    alltoall_takes_max_count = True
    reducescatter_keeps_input = True

    def __init__(self, rank: int, members: list[int], path_of: Callable[[int], str],
                 segment_bytes: int, aborted: Callable[[], BaseException | None],
                 timeout_s: float = 30.0, progress_timeout_s: float = 0.0, cma: bool = True,
                 hugepages: bool = True, urgent: Callable[[], bool] | None = None,
                 stall_warn_s: float = 60.0) -> None:
        self.members = members
        self.rank = members.index(rank)
        self.size = len(members)
        self.segment_bytes = segment_bytes
        self._t = 0
        self._open = 0  # counter of a staged allreduce whose pieces are being read
        self._unlinked = False
        total = segment_total(segment_bytes)
        self._path = path_of(rank)
        self._mine = create_segment(self._path, total)
        self._maps: list[mmap.mmap] = []
        self._data: list[np.ndarray] = []
        self._small: list[list[np.ndarray]] = []
        self.tables: list[np.ndarray] = []
        deadline = time.monotonic() + timeout_s
        for g in members:
            mm = self._mine if g == rank else self._open_peer(path_of(g), total, deadline)
            self._maps.append(mm)
            self.tables.append(np.frombuffer(mm, dtype=np.int64, count=2 * TABLE_ENTRIES,
                                             offset=TABLE_OFFSET))
            self._data.append(np.frombuffer(mm, dtype=np.uint8, count=segment_bytes,
                                            offset=HEADER_BYTES))
            self._small.append([np.frombuffer(mm, dtype=np.uint8, count=SMALL_BYTES,
                                              offset=HEADER_BYTES + segment_bytes + p * SMALL_BYTES)
                                for p in (0, 1)])
        self._scratch = np.empty(SMALL_BYTES, dtype=np.uint8)
        #: where my data region starts, and its size (``offset_of``)
        self._base, self._data_bytes = int(self._data[self.rank].ctypes.data), segment_bytes
        #: every member's counters and the waits on them; ``publish``, ``wait_for`` and
        #: ``wait_all`` are its methods (bound here: one call less on every wait)
        self.counters = Counters(self._maps, self.rank, members, aborted, progress_timeout_s,
                                 urgent, stall_warn_s)
        self.headers = self.counters.headers
        self._my_hdr = self.headers[self.rank]
        self.publish = self.counters.publish
        self.wait_for = self.counters.wait_for
        self.wait_all = self.counters.wait_all
        self._check = self.counters.check
        # single-copy reads need to know who we are; the probe lets peers test them
        self._probe = np.array([PROBE_VALUE], dtype=np.int64)
        if cma:  # before ATTACHED: peers probe this process only after seeing it
            vm.allow_peers()
        #: every member may also write into the others (process_vm_writev): agreed
        #: with ``_cma``; owners then write their reduced blocks into every peer
        self.push_agreed = False
        self._cma_scratch = np.empty(0, dtype=np.uint8)
        #: single-copy tables seen (-> their Layout), and the chunk plans of each set of
        #: layouts (see single_copy.py)
        self.layouts: dict = {}
        self.chunk_plans: dict = {}
        #: every member's process id (single-copy reads and writes address them)
        self.pids: list[int] = []
        #: single-copy allreduce blocks, sized by each owner's measured speed
        self.split = BlockSplit(self.size)
        #: moves memory that peers read onto huge pages (see hugepages.py)
        self.hugepages = HugePages(hugepages and cma)  # malloc: tuned once by init()
        self.publish(PID, os.getpid())
        self.publish(PROBE, int(self._probe.ctypes.data))
        self.publish(ATTACHED, 1)  # I have mapped every peer's segment
        #: every member reads the others' memory in place (single copy): probed and
        #: agreed by all of them here, once (module docstring)
        try:
            self._cma = self.size > 1 and self._agree_on_cma(cma, time.monotonic() + timeout_s)
        except BaseException:
            self.close()  # (this rank's segment file and the maps)
            raise

    # -- synchronisation (the waits are in counters.py) ---------------------------------
    def begin(self) -> int:
        """Start a piece: wait until peers finished reading my segment, return its counter."""
        self._unlink_once_mapped()
        self.wait_all(DONE, self._t)
        self._t += 1
        return self._t

    def meet(self, t: int, tag: int, wait: bool = True, at: int = -1
             ) -> tuple[list[int], list[int]] | None:
        """The steady lane's check before a collective (``core/lane.py``): bring ``tag``
        and ``at`` (:meth:`offset_of`) to meeting ``t``; with ``wait``, every member's
        once all brought theirs (stored before the counter: x86 keeps stores in order). A
        member brings ``t + 1`` only after a collective that every member entered after
        reading ``t``'s, or never (it left the lane): the values read are ``t``'s."""
        self._my_hdr[MEET_TAG], self._my_hdr[MEET_AT] = tag, at
        self.publish(MEET, t)
        if not wait:
            return None
        self.wait_all(MEET, t, False)  # never polls: a peer may be a backward pass away
        return [int(h[MEET_TAG]) for h in self.headers], [int(h[MEET_AT]) for h in self.headers]

    # -- resident vectors (the steady lane's gradient buckets) ----------------------------
    def resident(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of my data region, from its top down, for a vector that lives there
        (a gradient bucket: ``torch/_buckets.py``) and :meth:`allreduce_resident` reduces
        where it lies; None where it does not fit above :data:`RESIDENT_FLOOR` bytes of
        staging (which shrinks by what is given) or in ``/dev/shm``. It stays mapped while
        a view lives (``close_maps``). Members asking alike get the same places (checked
        at every meeting)."""
        top = (self.segment_bytes - nbytes) & ~63
        if nbytes <= 0 or top < RESIDENT_FLOOR or not self._populate(top, nbytes):
            return None
        self.segment_bytes = top
        return self._data[self.rank][top: top + nbytes]

    def _populate(self, at: int, nbytes: int) -> bool:
        """Back ``nbytes`` at ``at`` of my data region with memory now: False where
        ``/dev/shm`` has no room for them (a full tmpfs would kill the process with
        SIGBUS at the first write, where populating reports an error instead)."""
        lo = (HEADER_BYTES + at) & ~(mmap.PAGESIZE - 1)
        try:
            self._mine.madvise(_MADV_POPULATE_WRITE, lo, HEADER_BYTES + at + nbytes - lo)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # (EINVAL: a kernel before 5.14, no such advice)
                return False
            free = os.statvfs(shm_dir())
            return free.f_bavail * free.f_frsize > 2 * nbytes * self.size
        return True

    def offset_of(self, arr: np.ndarray) -> int:
        """Where ``arr`` starts in this rank's resident region, or -1 (elsewhere)."""
        at = int(arr.ctypes.data) - self._base
        return at if self.segment_bytes <= at and at + arr.nbytes <= self._data_bytes else -1

    def allreduce_resident(self, at: int, count: int, dtype: np.dtype, op: ReduceOp,
                           postscale: float = 1.0) -> None:
        """Allreduce in place the ``count`` values every member holds at ``at`` of its data
        region (:meth:`resident`), right after a meeting where all brought ``at`` (so the
        meeting is this op's ``WRITTEN``): reduce my block reading the others' in place,
        in rank order (every path's bits), scale it by ``postscale`` while it is in the
        cache (the same arithmetic as a scale of the whole result after: one pass over
        the vector fewer), then copy the others' reduced blocks."""
        t = self._reduce_own_block(None, count, dtype, op, at, postscale)
        mine = self._view(self.rank, dtype, count, at)
        for j, (a, b) in enumerate(blocks(count, self.size)):
            if j != self.rank:
                self.wait_for(j, REDUCED, t)
                np.copyto(mine[a:b], self._view(j, dtype, count, at)[a:b])
        self.publish(DONE, t)
        self.wait_all(DONE, t)  # nobody reads my values any more: the caller may write

    def _view(self, j: int, dtype: np.dtype, count: int, at: int = 0) -> np.ndarray:
        return self._data[j][at: at + count * dtype.itemsize].view(dtype)

    def _piece_elems(self, dtype: np.dtype) -> int:
        return max(1, self.segment_bytes // dtype.itemsize)

    # -- collectives ---------------------------------------------------------------------
    def staging(self, nbytes: int) -> np.ndarray | None:
        if nbytes > self.segment_bytes or self.size == 1:
            return None
        if not self._unlinked:
            self._unlink_once_mapped()
        if nbytes <= SMALL_BYTES:
            # the next op (counter t+1) uses parity (t+1) % 2; op t-1 used it last
            self.wait_all(DONE, self._t - 1)
            return self._small[self.rank][(self._t + 1) % 2][:nbytes]
        self.wait_all(DONE, self._t)
        return self._data[self.rank][:nbytes]

    def allreduce_staged(self, nbytes: int, dtype: np.dtype, op: ReduceOp
                         ) -> list[tuple[int, np.ndarray]]:
        """Reduce what was packed into :meth:`staging`; return the result's pieces.

        The pieces are ``(element offset, view)``: this rank's block from its own
        segment and every other block straight from its owner's segment, so the
        caller unpacks without a gather copy first. Call :meth:`release` after.
        """
        dtype = np.dtype(dtype)
        m = nbytes // dtype.itemsize
        if nbytes <= SMALL_BYTES:
            return [(0, self._allreduce_small(None, m, dtype, op))]
        t = self._reduce_own_block(None, m, dtype, op)
        pieces = []
        for j, (lo, hi) in enumerate(blocks(m, self.size)):
            if j != self.rank:
                self.wait_for(j, REDUCED, t)
            pieces.append((lo, self._view(j, dtype, m)[lo:hi]))
        self._open = t
        return pieces

    def release(self) -> None:
        """The caller is done reading the pieces of the last staged allreduce."""
        if self._open:
            self.publish(DONE, self._open)
            self._open = 0

    def _allreduce_small(self, buf: np.ndarray | None, m: int, dtype: np.dtype,
                         op: ReduceOp) -> np.ndarray:
        """One synchronisation: everyone writes, everyone reduces all, in rank order."""
        self.wait_all(DONE, self._t - 1)
        self._t += 1
        t = self._t
        nbytes = m * dtype.itemsize
        views = [self._small[j][t % 2][:nbytes].view(dtype) for j in range(self.size)]
        if buf is not None:
            np.copyto(views[self.rank], buf)
        self.publish(WRITTEN, t)
        self.wait_all(WRITTEN, t)
        out = buf if buf is not None else self._scratch[:nbytes].view(dtype)
        np.copyto(out, views[0])
        for j in range(1, self.size):
            reduce_into(out, views[j], op)
        self.publish(DONE, t)
        return out

    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        if buf.nbytes <= SMALL_BYTES:
            self._allreduce_small(buf, buf.size, buf.dtype, op)
            return
        step = self._piece_elems(buf.dtype)
        for s in range(0, buf.size, step):
            self._allreduce_piece(buf[s: s + step], min(step, buf.size - s), buf.dtype, op)

    def _reduce_own_block(self, buf: np.ndarray | None, m: int, dtype: np.dtype,
                          op: ReduceOp, at: int | None = None, postscale: float = 1.0) -> int:
        """Copy in (unless staged), reduce and scale this rank's block; returns the counter.
        ``at``: a resident vector's place, its meeting the ``WRITTEN`` (``allreduce_resident``)."""
        t = self.begin()
        views = [self._view(j, dtype, m, at or 0) for j in range(self.size)]
        mine = views[self.rank]
        if buf is not None:
            np.copyto(mine, buf)
        lo, hi = blocks(m, self.size)[self.rank]  # reduced in rank order: every path's bits
        if at is None:
            self.publish(WRITTEN, t)
            self.wait_all(WRITTEN, t)
        reduce_in_rank_order(self.rank, self.size, lambda j, _buf: views[j][lo:hi],
                             [mine[lo:hi]], op, self.cma_scratch(hi - lo, dtype))
        if postscale != 1.0:  # (the staged paths scale as they unpack)
            scale_inplace(mine[lo:hi], postscale)
        self.publish(REDUCED, t)
        return t

    def _allreduce_piece(self, buf: np.ndarray, m: int, dtype: np.dtype, op: ReduceOp) -> None:
        t = self._reduce_own_block(buf, m, dtype, op)
        for j, (lo, hi) in enumerate(blocks(m, self.size)):
            if j != self.rank:
                self.wait_for(j, REDUCED, t)
            np.copyto(buf[lo:hi], self._view(j, dtype, m)[lo:hi])
        self.publish(DONE, t)

    # -- single-copy allreduce (cross-memory attach, see single_copy.py) ------------------------------
    def reads_peers(self, nbytes: int, n_tensors: int) -> bool:
        """Whether an allreduce of this shape takes the single-copy path (and a round's
        fused groups run as one operation): a pure function of the op, the same on
        every rank, and of what every member agreed when the communicator was made."""
        return self._cma and nbytes >= CMA_MIN_BYTES and 0 < n_tensors <= TABLE_ENTRIES

    def cma_scratch(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A reused scratch buffer of ``count`` elements (for rank-order reductions)."""
        nbytes = count * np.dtype(dtype).itemsize
        if self._cma_scratch.nbytes < nbytes:
            self._cma_scratch = np.empty(nbytes, dtype=np.uint8)
        return self._cma_scratch[:nbytes].view(dtype)

    def _agree_on_cma(self, allowed: bool, deadline: float) -> bool:
        """Probe every peer's memory (read its probe value, then write the same bytes
        back), publish the outcome, and agree: single-copy reads where every member
        can read, pushes (``push_agreed``) where every member can also write. A
        member where single copy is off (``allowed`` False: ``RONDE_CMA=0``) takes
        part and says no. Run once, by :meth:`__init__`, on every member."""
        self._await_all(ATTACHED, deadline, "map every segment")  # pids, probes published
        read = write = allowed and vm.supported()
        self.pids = [int(h[PID]) for h in self.headers]
        for j in range(self.size):
            if j == self.rank or not read:
                continue
            at = [(int(self.headers[j][PROBE]), 8)]
            got = np.zeros(1, dtype=np.int64)
            try:
                vm.read_into(self.pids[j], [(got.ctypes.data, 8)], at)
            except OSError:
                read = write = False
                break
            read = int(got[0]) == PROBE_VALUE
            if write:
                try:
                    vm.write_into(self.pids[j], [(got.ctypes.data, 8)], at)
                except OSError:
                    write = False
        self.publish(CMA_OK, 1 if read and write else (3 if read else 2))
        self._await_all(CMA_OK, deadline, "probe single-copy reads")
        agreed = [int(h[CMA_OK]) for h in self.headers]  # 1 read+write, 3 read only, 2 none
        self.push_agreed = all(v == 1 for v in agreed)
        return all(v in (1, 3) for v in agreed)

    def _await_all(self, idx: int, deadline: float, what: str) -> None:
        """The constructor's waits: every other member's counter ``idx`` set by
        ``deadline`` (``RONDE_START_TIMEOUT`` from the agreement's start). No engine runs
        yet to notice a peer lost during start-up: ``RendezvousError``, as
        ``open_segment``'s, rather than the progress timeout's minutes."""
        for j in range(self.size):
            hdr = self.headers[j]
            while j != self.rank and hdr[idx] < 1:
                if time.monotonic() > deadline:
                    raise RendezvousError(
                        f"rank {self.members[j]}, a shared-memory peer on this host, did not "
                        f"{what} in time: it failed during start-up")
                time.sleep(0.0005)

    def allreduce_scattered(self, bufs: list[np.ndarray], op: ReduceOp, postscale: float
                            ) -> None:
        """Allreduce the concatenation of ``bufs`` in place, reading peers directly
        (where :meth:`reads_peers` said so: agreed when the communicator was made, so
        there is nothing left to decline)."""
        single_copy.allreduce(self, bufs, op, postscale)

    def reducescatter(self, buf: np.ndarray, counts: list[int], op: ReduceOp,
                      out: np.ndarray | None = None) -> np.ndarray:
        """The reduced block of this rank (into ``out`` where that path allows)."""
        if self._single_copy(buf.nbytes):
            return single_copy.reducescatter(self, buf, counts, op, out)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        my_lo, my_hi = int(starts[self.rank]), int(starts[self.rank + 1])
        out = np.empty(my_hi - my_lo, dtype=buf.dtype)
        step = self._piece_elems(buf.dtype)
        for s in range(0, max(buf.size, 1), step):
            m = min(step, buf.size - s)
            t = self.begin()
            views = [self._view(j, buf.dtype, m) for j in range(self.size)]
            np.copyto(views[self.rank], buf[s: s + m])
            self.publish(WRITTEN, t)
            self.wait_all(WRITTEN, t)
            lo, hi = max(my_lo, s), min(my_hi, s + m)
            if lo < hi:
                acc = out[lo - my_lo: hi - my_lo]
                np.copyto(acc, views[0][lo - s: hi - s])
                for j in range(1, self.size):
                    reduce_into(acc, views[j][lo - s: hi - s], op)
            self.publish(DONE, t)
        return out

    def _single_copy(self, nbytes: int) -> bool:
        """Whether a collective of ``nbytes`` (the same on every member) other than an
        allreduce reads peers' buffers directly (see single_copy.py)."""
        return self._cma and nbytes >= CMA_MIN_BYTES

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        if self._single_copy(sum(counts) * send.dtype.itemsize):
            single_copy.allgatherv(self, send, recv, counts)
            return
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        step = self._piece_elems(send.dtype)
        for off in range(0, max(max(counts), 1), step):
            t = self.begin()
            mine_n = max(0, min(step, counts[self.rank] - off))
            np.copyto(self._view(self.rank, send.dtype, mine_n), send[off: off + mine_n])
            self.publish(WRITTEN, t)
            recv[starts[self.rank] + off: starts[self.rank] + off + mine_n] = send[off: off + mine_n]
            for j in range(self.size):
                if j == self.rank:
                    continue
                n = max(0, min(step, counts[j] - off))
                if n:
                    self.wait_for(j, WRITTEN, t)
                    np.copyto(recv[starts[j] + off: starts[j] + off + n],
                              self._view(j, send.dtype, n))
            self.wait_all(WRITTEN, t)
            self.publish(DONE, t)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if self._single_copy(buf.nbytes):
            single_copy.broadcast(self, buf, root)
            return
        step = self._piece_elems(buf.dtype)
        for s in range(0, max(buf.size, 1), step):
            m = min(step, buf.size - s)
            t = self.begin()
            if self.rank == root:
                np.copyto(self._view(root, buf.dtype, m), buf[s: s + m])
                self.publish(WRITTEN, t)
            else:
                self.wait_for(root, WRITTEN, t)
                np.copyto(buf[s: s + m], self._view(root, buf.dtype, m))
                self.publish(WRITTEN, t)
            self.publish(DONE, t)

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int], max_count: int | None = None) -> None:
        if max_count is None:
            raise ValueError("shm alltoallv needs the largest block size of any rank")
        if self._single_copy(max_count * self.size * send.dtype.itemsize):
            single_copy.alltoallv(self, send, send_counts, recv, recv_counts)
            return
        sstarts = np.concatenate([[0], np.cumsum(send_counts)]).astype(int)
        rstarts = np.concatenate([[0], np.cumsum(recv_counts)]).astype(int)
        per_dest = max(1, self._piece_elems(send.dtype) // self.size)
        for off in range(0, max(max_count, 1), per_dest):
            t = self.begin()
            mine = self._view(self.rank, send.dtype, per_dest * self.size)
            for i in range(self.size):
                n = max(0, min(per_dest, send_counts[i] - off))
                if n:
                    mine[i * per_dest: i * per_dest + n] = send[sstarts[i] + off: sstarts[i] + off + n]
            self.publish(WRITTEN, t)
            for j in range(self.size):
                n = max(0, min(per_dest, recv_counts[j] - off))
                if not n:
                    continue
                if j != self.rank:
                    self.wait_for(j, WRITTEN, t)
                src = self._view(j, send.dtype, per_dest * self.size)
                base = self.rank * per_dest
                recv[rstarts[j] + off: rstarts[j] + off + n] = src[base: base + n]
            self.wait_all(WRITTEN, t)
            self.publish(DONE, t)

    def barrier(self) -> None:
        t = self.begin()
        self.publish(WRITTEN, t)
        self.wait_all(WRITTEN, t)
        self.publish(DONE, t)

    # -- lifetime ------------------------------------------------------------------------
    def _unlink_once_mapped(self) -> None:
        self._unlink_if(not self._unlinked and all(h[ATTACHED] >= 1 for h in self.headers))

    def close(self) -> None:
        self._unlink_if(True)
        self.headers.clear()
        self._data.clear()
        self._my_hdr = None  # type: ignore[assignment]
        close_maps(self._maps)
        self._maps.clear()
