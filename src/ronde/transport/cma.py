"""Single-copy allreduce between processes of one host (Linux cross-memory attach).

``process_vm_readv`` lets a process copy bytes straight out of another process's
memory, given its pid and an address, when both run as the same user (the check
that ``ptrace`` would make). That removes the copy through a shared segment: a
rank reads exactly the parts of its peers' tensors it needs, where they lie.

The allreduce of N bytes over n ranks, per rank (``ShmCommunicator`` drives it and
provides the synchronisation counters):

1. publish the addresses of its tensors (the logical vector, possibly many tensors:
   fusion needs no fusion buffer here) and wait for every peer's;
2. reduce-scatter: for its block (N/n bytes), read each peer's part in cache-sized
   chunks into a small scratch buffer and reduce into its own tensors, then apply
   the post-scale while the chunk is still in cache;
3. allgather, where every rank may also write into the others (``process_vm_writev``,
   agreed at the first op): right after reducing a chunk, write it into every peer's
   tensors, still in cache. Nobody reads a reduced block, so nobody waits for one,
   and the lines a rank reduces into next time were never loaded by a peer: writing
   into lines another core holds costs an invalidation each, which made the
   reduction pass several times slower at sizes that stay in the last-level cache
   (16 MiB: 2.5-3.0 ms a pulled allreduce, 1.3 ms pushed, in one phase of this
   machine). Where writes are refused, read every other block from its owner's
   tensors instead, front to back, as far as the owner reports it reduced (a
   ``PROGRESS`` counter), so a rank done early does not wait for a slower one's
   whole block.

That is (n-1)/n·N read across processes for the reduction, (n-1)/n·N for the gather,
and one in-cache reduce: about one pass over the data plus half a reduction,
against the two copies plus a reduction of the shared-segment path.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .._errors import PeerLostError, ProtocolError
from ..collectives.ops import reduce_in_rank_order
from ..core import fusion as _fusion
from . import shm
from .vm import Iov, address, read_into, supported, write_into  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from .._ops import ReduceOp
    from .shm import ShmCommunicator

_chain = itertools.chain.from_iterable


class Layout:
    """A logical vector made of several tensors, in bytes: maps ranges to addresses."""

    def __init__(self, addrs: Sequence[int], lengths: Sequence[int]) -> None:
        self.addrs = list(addrs)
        self.lengths = list(lengths)
        self.starts = [0]
        for n in self.lengths:
            self.starts.append(self.starts[-1] + n)

    @property
    def nbytes(self) -> int:
        return self.starts[-1]

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(tensor index, start, stop) pieces covering logical bytes [lo, hi), the bounds
        in bytes within each tensor."""
        out = []
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while lo < hi and i < len(self.lengths):
            start = self.starts[i]
            end = start + self.lengths[i]
            if end > lo and self.lengths[i]:
                a, b = max(lo, start), min(hi, end)
                out.append((i, a - start, b - start))
                lo = b
            i += 1
        return out

    def ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(address, length) pieces covering logical bytes [lo, hi)."""
        addrs = self.addrs
        return [(addrs[i] + a, b - a) for i, a, b in self.pieces(lo, hi)]


def coalesce(bufs: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """Merge flat buffers that follow each other in memory (views of one allocation,
    e.g. gradients laid out in one bucket) into one: fewer reads and reductions.

    Returns the merged buffers and their addresses (asked once, here: ResNet-50 has
    161 tensors)."""
    runs: list[list[np.ndarray]] = []
    starts: list[int] = []
    end = -1
    for b in bufs:
        if not b.size:
            continue
        at = address(b)
        if at == end:
            runs[-1].append(b)
        else:
            runs.append([b])
            starts.append(at)
        end = at + b.nbytes
    if not runs:
        return bufs[:1], [address(b) for b in bufs[:1]]
    return [run[0] if len(run) == 1 else np.lib.stride_tricks.as_strided(
        run[0], shape=(sum(b.size for b in run),), strides=(run[0].itemsize,))
        for run in runs], starts


def _layout(comm: "ShmCommunicator", j: int, nseg_slot: int) -> Layout:
    """Member ``j``'s published segment table (checked: it is read from shared memory)."""
    n = int(comm._hdr[j][nseg_slot])
    if not 0 < n <= shm.TABLE_ENTRIES:
        raise ProtocolError(f"rank {comm.members[j]} published {n} single-copy segments")
    flat = tuple(comm._table[j][: 2 * n].tolist())
    known = comm._layouts.get(flat)
    if known is not None:
        return known  # tensors seen before (training's steady state: every op's are)
    lengths = flat[1::2]
    if min(lengths) < 0:
        raise ProtocolError(f"rank {comm.members[j]} published a negative segment length")
    layout = Layout(flat[0::2], lengths)
    if len(comm._layouts) >= _KEPT_LAYOUTS:
        comm._layouts.clear()
    comm._layouts[flat] = layout
    return layout


def _publish_table(comm: "ShmCommunicator", ranges: list[tuple[int, int]]) -> None:
    tab = comm._table[comm.rank]
    if len(ranges) == 1:  # the common case: two stores, not an array
        tab[0], tab[1] = ranges[0]
    else:
        tab[: 2 * len(ranges)] = list(_chain(ranges))
    comm._publish(shm.NSEG, len(ranges))


#: layouts (and sets of them with their chunk plans) kept; past this, start afresh
_KEPT_LAYOUTS = 64


class _Chunk:
    """What one chunk ``[start, stop)`` (elements) of a single-copy allreduce needs:
    the pieces of my tensors it covers, ``(index, start, stop)`` in the coalesced
    buffers, and each member's ranges of it as a ready iovec (mine are the source of
    the writes). Worked out once per set of published layouts (:func:`_plans`): in
    training's steady state every op reuses them, instead of bisecting four layouts
    and building iovecs for every chunk (ResNet-50's 161 separate tensors: ~0.3 ms an
    op)."""

    __slots__ = ("stop", "pieces", "peers", "mine")

    def __init__(self, a: int, b: int, item: int, layouts: list[Layout], me: int,
                 push: bool) -> None:
        self.stop = b
        mine = layouts[me]
        self.pieces = [(i, s // item, e // item) for i, s, e in mine.pieces(a * item, b * item)]
        self.peers = [None if j == me else Iov(lay.ranges(a * item, b * item))
                      for j, lay in enumerate(layouts)]
        self.mine = Iov(mine.ranges(a * item, b * item)) if push else None


def _plans(comm: "ShmCommunicator", layouts: list[Layout], item: int) -> dict[int, _Chunk]:
    """The chunk plans kept for this set of layouts (``_layout`` returns the same object
    for a table it saw before, so a step's ops find theirs again), by first element."""
    kept = comm._chunk_plans
    key = (item, *map(id, layouts))  # the entry holds the layouts: their ids stay theirs
    found = kept.get(key)
    if found is None:
        if len(kept) >= _KEPT_LAYOUTS:
            kept.clear()
        found = kept[key] = (layouts, {})
    return found[1]


def order_scratch(comm: "ShmCommunicator", count: int, dtype: np.dtype
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Scratch for ``reduce_in_rank_order`` when reading chunks of up to ``count``
    elements from peers: ``(low, part)``, the same memory unless this rank sums two or
    more ranks below it."""
    scratch = comm.cma_scratch((2 if comm.rank >= 2 else 1) * count, dtype)
    return scratch[:count], scratch[-count:]


def allreduce_in_place(comm: "ShmCommunicator", bufs: list[np.ndarray], op: "ReduceOp",
                       postscale: float) -> None:
    """The single-copy allreduce (see the module docstring), driven by ``comm``'s counters.

    ``bufs`` is the logical vector (same shapes and order on every rank); the result
    replaces it in place, post-scaled.
    """
    scale_inplace = _fusion.scale_inplace
    dtype = bufs[0].dtype
    item = dtype.itemsize
    key = (len(bufs), dtype.str)  # completed below, from what every rank published
    bufs, addrs = coalesce(bufs)  # each rank alone: peers go by the table it publishes
    t = comm._begin()
    mine_ranges = [(at, b.nbytes) for at, b in zip(addrs, bufs)]
    comm.hugepages.prepare(mine_ranges)
    _publish_table(comm, mine_ranges)
    push = comm.push_agreed
    if not push:
        # peers read it in this op: reset before WRITTEN, which they wait for first (x86
        # stores are seen in order); nobody reads it after the last op's DONE
        comm._publish(shm.PROGRESS, 0)
    comm._publish(shm.WRITTEN, t)
    comm._wait_all(shm.WRITTEN, t)
    layouts = [_layout(comm, j, shm.NSEG) for j in range(comm.size)]
    mine = layouts[comm.rank]
    for j, lay in enumerate(layouts):
        if lay.nbytes != mine.nbytes:
            raise ProtocolError(f"rank {comm.members[j]} published {lay.nbytes} bytes for a "
                                f"single-copy allreduce of {mine.nbytes} bytes")
    total = mine.nbytes // item
    # blocks sized by measured times where each is worth it (two chunks or more)
    balanced = total * item >= 2 * comm.size * shm.CMA_CHUNK_BYTES
    if balanced:
        key += (total, tuple(len(lay.addrs) for lay in layouts))  # the same on every rank
        blocks = comm.split.blocks(key, total, item)
    else:
        blocks = shm.blocks(total, comm.size)
    pids = comm.pids
    chunk = max(1, shm.CMA_CHUNK_BYTES // item)
    me = comm.rank
    low, part = order_scratch(comm, chunk, dtype)
    lo, hi = blocks[me]
    others = [(me + k) % comm.size for k in range(1, comm.size)]
    plans = _plans(comm, layouts, item)
    scratch: dict[tuple[int, int], Iov] = {}
    started = time.perf_counter_ns()

    def fetch(j: int, buf: np.ndarray) -> np.ndarray:
        """Rank ``j``'s part of the current chunk, read into ``buf``."""
        at = (address(buf), buf.nbytes)
        local = scratch.get(at)
        if local is None:
            local = scratch[at] = Iov([at])
        read_into(pids[j], local, peers[j])
        return buf

    try:
        a = lo
        while a < hi:
            # chunks on a grid fixed in the vector, so that all but a block's first and
            # last are the same from op to op while the blocks move (see balance.py)
            b = min((a // chunk + 1) * chunk, hi)
            plan = plans.get(a)
            if plan is None or plan.stop != b:
                plan = _Chunk(a, b, item, layouts, me, push)
                if a % chunk == 0 and (b % chunk == 0 or b == total) and len(plans) < 4096:
                    plans[a] = plan
            peers = plan.peers
            views = [bufs[i][s:e] for i, s, e in plan.pieces]
            # rank order, whoever owns the chunk: the result does not depend on where
            # the blocks fall (they move, see balance.py) nor on how tensors were fused
            reduce_in_rank_order(me, comm.size, fetch, views, op, low[: b - a], part[: b - a])
            if postscale != 1.0:
                for v in views:
                    scale_inplace(v, postscale)
            if push:
                # the reduced chunk is still in cache: write it into every peer now
                for j in others:
                    write_into(pids[j], plan.mine, peers[j])
            else:
                comm._publish(shm.PROGRESS, b - lo)
            a = b
        comm._publish(shm.BUSY, time.perf_counter_ns() - started)
        if not push:
            comm._publish(shm.REDUCED, t)
            for j in others:
                _pull(comm, j, blocks[j], item, pids[j], mine, layouts[j])
    except OSError as exc:
        raise PeerLostError(f"single-copy copy to or from a peer on this host failed "
                            f"({exc}); it probably exited", rank=None) from None
    comm._publish(shm.DONE, t)
    # peers read my tensors until they are DONE: only then may the caller reuse them
    comm._wait_all(shm.DONE, t)
    if balanced:
        # every BUSY was published before its DONE, and none changes before my next op
        # starts: every rank reads the same times here (clamped: shared memory)
        busy = shm.BUSY
        comm.split.update(key, total, blocks,
                          [min(max(int(h[busy]), 0), 10**12) * 1e-9 for h in comm._hdr])


def _pull(comm: "ShmCommunicator", j: int, block: tuple[int, int], item: int, pid: int,
          mine: Layout, theirs: Layout) -> None:
    """Read member ``j``'s reduced block into my tensors, front to back, as far as ``j``
    reports it reduced (``PROGRESS``), so a rank that finished its own block early does
    not wait for a slower one's whole block."""
    PROGRESS = shm.PROGRESS
    lo, hi = block
    size, done = hi - lo, 0
    hdr = comm._hdr[j]
    while done < size:
        if int(hdr[PROGRESS]) <= done:
            comm._wait_all_one(j, PROGRESS, done + 1)
        upto = min(int(hdr[PROGRESS]), size)  # shared memory: clamp
        a, b = (lo + done) * item, (lo + upto) * item
        read_into(pid, mine.ranges(a, b), theirs.ranges(a, b))
        done = upto
