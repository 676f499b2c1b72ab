"""Single-copy collectives between processes of one host (Linux cross-memory attach).

``process_vm_readv`` lets a process copy bytes straight out of another process's
memory, given its pid and an address, when both run as the same user (the check
that ``ptrace`` would make). That removes the copy through a shared segment: a
rank reads exactly the parts of its peers' tensors it needs, where they lie. The
:class:`~ronde.transport.shm.communicator.ShmCommunicator` decides (once, with every
member) that these work here and drives them; its segment carries only the
counters and the table of published addresses (see :mod:`.protocol`).

**Allreduce** (:func:`allreduce`) of N bytes over n ranks, per rank:
1. publish the addresses of its tensors (the logical vector, possibly many tensors:
   fusion needs no fusion buffer here) and wait for every peer's;
2. reduce-scatter: for its block (N/n bytes), read each peer's part in cache-sized
   chunks into a small scratch buffer and reduce into its own tensors, then apply
   the post-scale while the chunk is still in cache;
3. allgather, where every rank may also write into the others (``process_vm_writev``,
   agreed with the reads): right after reducing a chunk, write it into every peer's
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

**Broadcast, allgather, alltoall, reducescatter**: Each rank publishes the addresses of what its peers need (its input, or for an
alltoall the slot of each destination) in its segment's table, then every rank copies
what it needs straight out of the peers' memory into its output (``process_vm_readv``),
and waits until every peer is ``DONE`` before it returns: peers read its input until
then. The allgather, where every rank may also write into the others
(``process_vm_writev``, agreed with the reads), writes each rank's input into the
peers' outputs instead (16 MiB: 0.65-0.79 ms against 0.87-0.92 read, interleaved).
One copy of each byte that crosses between processes, against two through the shared
segment (copy in, copy out), and no piece-by-piece synchronisation.

Used when every rank agreed that single-copy reads work (``ShmCommunicator._cma``,
probed when the communicator is made) and the collective is large enough (``CMA_MIN_BYTES``), decided from sizes every rank
knows alike. Everything read from the shared table is checked before use.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..._errors import PeerLostError, ProtocolError
from ...collectives import ops as _ops
from ...collectives.ops import reduce_in_rank_order, scale_inplace
from ..vm import Iov, address, read_into, write_into
from .protocol import (BUSY, CMA_CHUNK_BYTES, DONE, NSEG, PROGRESS, REDUCED, TABLE_ENTRIES,
                       WRITTEN, blocks as even_blocks)

if TYPE_CHECKING:
    from ..._ops import ReduceOp
    from .communicator import ShmCommunicator

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
    n = int(comm.headers[j][nseg_slot])
    if not 0 < n <= TABLE_ENTRIES:
        raise ProtocolError(f"rank {comm.members[j]} published {n} single-copy segments")
    flat = tuple(comm.tables[j][: 2 * n].tolist())
    known = comm.layouts.get(flat)
    if known is not None:
        return known  # tensors seen before (training's steady state: every op's are)
    lengths = flat[1::2]
    if min(lengths) < 0:
        raise ProtocolError(f"rank {comm.members[j]} published a negative segment length")
    layout = Layout(flat[0::2], lengths)
    if len(comm.layouts) >= _KEPT_LAYOUTS:
        comm.layouts.clear()
    comm.layouts[flat] = layout
    return layout


def _publish_table(comm: "ShmCommunicator", ranges: list[tuple[int, int]]) -> None:
    tab = comm.tables[comm.rank]
    if len(ranges) == 1:  # the common case: two stores, not an array
        tab[0], tab[1] = ranges[0]
    else:
        tab[: 2 * len(ranges)] = list(_chain(ranges))
    comm.publish(NSEG, len(ranges))


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
    kept = comm.chunk_plans
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


def allreduce(comm: "ShmCommunicator", bufs: list[np.ndarray], op: "ReduceOp",
                       postscale: float) -> None:
    """The single-copy allreduce (see the module docstring), driven by ``comm``'s counters.

    ``bufs`` is the logical vector (same shapes and order on every rank); the result
    replaces it in place, post-scaled.
    """
    dtype = bufs[0].dtype
    item = dtype.itemsize
    key = (len(bufs), dtype.str)  # completed below, from what every rank published
    bufs, addrs = coalesce(bufs)  # each rank alone: peers go by the table it publishes
    t = comm.begin()
    mine_ranges = [(at, b.nbytes) for at, b in zip(addrs, bufs)]
    comm.hugepages.prepare(mine_ranges)
    _publish_table(comm, mine_ranges)
    push = comm.push_agreed
    if not push:
        # peers read it in this op: reset before WRITTEN, which they wait for first (x86
        # stores are seen in order); nobody reads it after the last op's DONE
        comm.publish(PROGRESS, 0)
    comm.publish(WRITTEN, t)
    comm.wait_all(WRITTEN, t)
    layouts = [_layout(comm, j, NSEG) for j in range(comm.size)]
    mine = layouts[comm.rank]
    for j, lay in enumerate(layouts):
        if lay.nbytes != mine.nbytes:
            raise ProtocolError(f"rank {comm.members[j]} published {lay.nbytes} bytes for a "
                                f"single-copy allreduce of {mine.nbytes} bytes")
    total = mine.nbytes // item
    # blocks sized by measured times where each is worth it (two chunks or more)
    balanced = total * item >= 2 * comm.size * CMA_CHUNK_BYTES
    if balanced:
        key += (total, tuple(len(lay.addrs) for lay in layouts))  # the same on every rank
        blocks = comm.split.blocks(key, total, item)
    else:
        blocks = even_blocks(total, comm.size)
    pids = comm.pids
    chunk = max(1, CMA_CHUNK_BYTES // item)
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
                comm.publish(PROGRESS, b - lo)
            a = b
        comm.publish(BUSY, time.perf_counter_ns() - started)
        if not push:
            comm.publish(REDUCED, t)
            for j in others:
                _pull(comm, j, blocks[j], item, pids[j], mine, layouts[j])
    except OSError as exc:
        raise PeerLostError(f"single-copy copy to or from a peer on this host failed "
                            f"({exc}); it probably exited", rank=None) from None
    comm.publish(DONE, t)
    # peers read my tensors until they are DONE: only then may the caller reuse them
    comm.wait_all(DONE, t)
    if balanced:
        # every BUSY was published before its DONE, and none changes before my next op
        # starts: every rank reads the same times here (clamped: shared memory)
        comm.split.update(key, total, blocks,
                          [min(max(int(h[BUSY]), 0), 10**12) * 1e-9 for h in comm.headers])


def _pull(comm: "ShmCommunicator", j: int, block: tuple[int, int], item: int, pid: int,
          mine: Layout, theirs: Layout) -> None:
    """Read member ``j``'s reduced block into my tensors, front to back, as far as ``j``
    reports it reduced (``PROGRESS``), so a rank that finished its own block early does
    not wait for a slower one's whole block."""
    lo, hi = block
    size, done = hi - lo, 0
    hdr = comm.headers[j]
    while done < size:
        if int(hdr[PROGRESS]) <= done:
            comm.wait_for(j, PROGRESS, done + 1)
        upto = min(int(hdr[PROGRESS]), size)  # shared memory: clamp
        a, b = (lo + done) * item, (lo + upto) * item
        read_into(pid, mine.ranges(a, b), theirs.ranges(a, b))
        done = upto



def _peer_copy(comm: "ShmCommunicator", j: int, local: Sequence[tuple[int, int]],
               remote: Sequence[tuple[int, int]], write: bool = False) -> None:
    """Copy member ``j``'s ``remote`` ranges into my ``local`` ones (or, with ``write``,
    mine into its)."""
    try:
        (write_into if write else read_into)(comm.pids[j], local, remote)
    except OSError as exc:
        raise PeerLostError(f"single-copy copy with rank {comm.members[j]} on this host "
                            f"failed ({exc}); it probably exited",
                            rank=comm.members[j]) from None


def _published(comm: "ShmCommunicator", j: int, nbytes: int, entry: int = 0) -> int:
    """The address member ``j`` published in table ``entry`` for ``nbytes`` (checked)."""
    tab = comm.tables[j]
    addr, n = int(tab[2 * entry]), int(tab[2 * entry + 1])
    if n != nbytes:
        raise ProtocolError(f"rank {comm.members[j]} published a {n}-byte buffer where "
                            f"{nbytes} bytes were agreed")
    return addr


def _publish_input(comm: "ShmCommunicator", buf: np.ndarray) -> int:
    at = address(buf)
    comm.hugepages.prepare([(at, buf.nbytes)])
    tab = comm.tables[comm.rank]
    tab[0], tab[1] = at, buf.nbytes
    return at


def broadcast(comm: "ShmCommunicator", buf: np.ndarray, root: int) -> None:
    """Every member reads the root's buffer straight into its own: one copy."""
    t = comm.begin()
    if comm.rank == root:
        _publish_input(comm, buf)
    comm.publish(WRITTEN, t)
    if comm.rank != root and buf.nbytes:
        comm.wait_for(root, WRITTEN, t)
        addr = _published(comm, root, buf.nbytes)
        _peer_copy(comm, root, [(address(buf), buf.nbytes)], [(addr, buf.nbytes)])
    comm.publish(DONE, t)
    if comm.rank == root:
        comm.wait_all(DONE, t)  # the caller may change its buffer once every peer read it


def allgatherv(comm: "ShmCommunicator", send: np.ndarray, recv: np.ndarray,
               counts: list[int]) -> None:
    """Where every member may write into the others, each writes its input straight into
    every peer's output; else each reads every peer's input into its own output."""
    item = send.dtype.itemsize
    me = comm.rank
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    t = comm.begin()
    sat, rat = _publish_input(comm, send), address(recv)
    push = comm.push_agreed
    if push:
        tab = comm.tables[me]
        tab[2], tab[3] = rat, recv.nbytes
    comm.publish(WRITTEN, t)
    recv[starts[me]: starts[me + 1]] = send
    for k in range(1, comm.size):
        j = (me + k) % comm.size
        if push:
            n = counts[me] * item
            if n:
                comm.wait_for(j, WRITTEN, t)
                at = _published(comm, j, recv.nbytes, entry=1)
                _peer_copy(comm, j, [(sat, n)], [(at + starts[me] * item, n)], write=True)
        elif counts[j]:
            n = counts[j] * item
            comm.wait_for(j, WRITTEN, t)
            _peer_copy(comm, j, [(rat + starts[j] * item, n)], [(_published(comm, j, n), n)])
    comm.publish(DONE, t)
    comm.wait_all(DONE, t)  # peers read my input, or write my output, until DONE


def alltoallv(comm: "ShmCommunicator", send: np.ndarray, send_counts: list[int],
              recv: np.ndarray, recv_counts: list[int]) -> None:
    """Every member publishes where each destination's slot of its input lies, and
    reads its own slot from every peer's input straight into its output. (Writing the
    slots into the destinations instead was slower at 16 MiB here: 1.0-1.6 ms against
    0.7-1.5, where the allgather gains from it.)"""
    item = send.dtype.itemsize
    size, me = comm.size, comm.rank
    if size > TABLE_ENTRIES:
        raise ProtocolError(f"a single-copy alltoall of {size} ranks does not fit the table")
    sbase, rbase = address(send), address(recv)
    sstarts, rstarts = [0], [0]
    for i in range(size):
        sstarts.append(sstarts[-1] + send_counts[i])
        rstarts.append(rstarts[-1] + recv_counts[i])
    t = comm.begin()
    tab = comm.tables[me]
    for i in range(size):
        tab[2 * i], tab[2 * i + 1] = sbase + sstarts[i] * item, send_counts[i] * item
    comm.hugepages.prepare([(sbase, send.nbytes)])
    comm.publish(WRITTEN, t)
    recv[rstarts[me]: rstarts[me + 1]] = send[sstarts[me]: sstarts[me + 1]]
    for k in range(1, size):
        j = (me + k) % size  # peers in a different order on each rank: no hot spot
        n = recv_counts[j] * item
        if n:
            comm.wait_for(j, WRITTEN, t)
            _peer_copy(comm, j, [(rbase + rstarts[j] * item, n)],
                       [(_published(comm, j, n, entry=me), n)])
    comm.publish(DONE, t)
    comm.wait_all(DONE, t)  # peers read my input until they are DONE


def reducescatter(comm: "ShmCommunicator", src: np.ndarray, counts: list[int],
                  op: "ReduceOp", out: np.ndarray | None = None) -> np.ndarray:
    """Every member reduces its block from its own part and each peer's, read straight
    from the peer's input in cache-sized chunks, in rank order (((x0 + x1) + x2) + ...,
    as the allreduce does: the bits do not depend on who reduces). Returns the block
    (``out`` if given)."""
    item = src.dtype.itemsize
    me = comm.rank
    lo = sum(counts[:me])
    hi = lo + counts[me]
    if out is None:
        out = np.empty(hi - lo, dtype=src.dtype)
    t = comm.begin()
    _publish_input(comm, src)
    comm.publish(WRITTEN, t)
    chunk = max(1, CMA_CHUNK_BYTES // item)
    low, part = order_scratch(comm, chunk, src.dtype)
    bases: dict[int, int] = {}

    def fetch(j: int, buf: np.ndarray) -> np.ndarray:
        """Rank ``j``'s part of the current chunk, read into ``buf``."""
        if j not in bases:
            comm.wait_for(j, WRITTEN, t)
            bases[j] = _published(comm, j, src.nbytes)
        _peer_copy(comm, j, [(address(buf), buf.nbytes)], [(bases[j] + a * item, buf.nbytes)])
        return buf

    for a in range(lo, hi, chunk):
        b = min(a + chunk, hi)
        _ops.reduce_in_rank_order(me, comm.size, fetch, [out[a - lo: b - lo]], op,
                                  low[: b - a], part[: b - a], mine=src[a:b])
    comm.publish(DONE, t)
    comm.wait_all(DONE, t)  # peers read my input until they are DONE
    return out
