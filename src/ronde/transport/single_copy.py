"""Single-copy broadcast, allgather, alltoall and reducescatter between processes of
one host (cross-memory attach; the allreduce is in ``cma.py``).

Each rank publishes the addresses of what its peers need (its input, or for an
alltoall the slot of each destination) in its segment's table, then every rank copies
what it needs straight out of the peers' memory into its output (``process_vm_readv``),
and waits until every peer is ``DONE`` before it returns: peers read its input until
then. The allgather, where every rank may also write into the others
(``process_vm_writev``, agreed with the reads), writes each rank's input into the
peers' outputs instead (16 MiB: 0.65-0.79 ms against 0.87-0.92 read, interleaved).
One copy of each byte that crosses between processes, against two through the shared
segment (copy in, copy out), and no piece-by-piece synchronisation.

Used when every rank agreed that single-copy reads work (``ShmCommunicator._agreed``)
and the collective is large enough (``CMA_MIN_BYTES``), decided from sizes every rank
knows alike. Everything read from the shared table is checked before use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from .._errors import PeerLostError, ProtocolError
from ..collectives import ops as _ops
from . import shm
from .cma import order_scratch
from .vm import address, read_into, write_into

if TYPE_CHECKING:
    from .._ops import ReduceOp
    from .shm import ShmCommunicator


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
    tab = comm._table[j]
    addr, n = int(tab[2 * entry]), int(tab[2 * entry + 1])
    if n != nbytes:
        raise ProtocolError(f"rank {comm.members[j]} published a {n}-byte buffer where "
                            f"{nbytes} bytes were agreed")
    return addr


def _publish_input(comm: "ShmCommunicator", buf: np.ndarray) -> int:
    at = address(buf)
    comm.hugepages.prepare([(at, buf.nbytes)])
    tab = comm._table[comm.rank]
    tab[0], tab[1] = at, buf.nbytes
    return at


def broadcast(comm: "ShmCommunicator", buf: np.ndarray, root: int) -> None:
    """Every member reads the root's buffer straight into its own: one copy."""
    t = comm._begin()
    if comm.rank == root:
        _publish_input(comm, buf)
    comm._publish(shm.WRITTEN, t)
    if comm.rank != root and buf.nbytes:
        comm._wait_all_one(root, shm.WRITTEN, t)
        addr = _published(comm, root, buf.nbytes)
        _peer_copy(comm, root, [(address(buf), buf.nbytes)], [(addr, buf.nbytes)])
    comm._publish(shm.DONE, t)
    if comm.rank == root:
        comm._wait_all(shm.DONE, t)  # the caller may change its buffer once every peer read it


def allgatherv(comm: "ShmCommunicator", send: np.ndarray, recv: np.ndarray,
               counts: list[int]) -> None:
    """Where every member may write into the others, each writes its input straight into
    every peer's output; else each reads every peer's input into its own output."""
    item = send.dtype.itemsize
    me = comm.rank
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    t = comm._begin()
    sat, rat = _publish_input(comm, send), address(recv)
    push = comm.push_agreed
    if push:
        tab = comm._table[me]
        tab[2], tab[3] = rat, recv.nbytes
    comm._publish(shm.WRITTEN, t)
    recv[starts[me]: starts[me + 1]] = send
    for k in range(1, comm.size):
        j = (me + k) % comm.size
        if push:
            n = counts[me] * item
            if n:
                comm._wait_all_one(j, shm.WRITTEN, t)
                at = _published(comm, j, recv.nbytes, entry=1)
                _peer_copy(comm, j, [(sat, n)], [(at + starts[me] * item, n)], write=True)
        elif counts[j]:
            n = counts[j] * item
            comm._wait_all_one(j, shm.WRITTEN, t)
            _peer_copy(comm, j, [(rat + starts[j] * item, n)], [(_published(comm, j, n), n)])
    comm._publish(shm.DONE, t)
    comm._wait_all(shm.DONE, t)  # peers read my input, or write my output, until DONE


def alltoallv(comm: "ShmCommunicator", send: np.ndarray, send_counts: list[int],
              recv: np.ndarray, recv_counts: list[int]) -> None:
    """Every member publishes where each destination's slot of its input lies, and
    reads its own slot from every peer's input straight into its output. (Writing the
    slots into the destinations instead was slower at 16 MiB here: 1.0-1.6 ms against
    0.7-1.5, where the allgather gains from it.)"""
    item = send.dtype.itemsize
    size, me = comm.size, comm.rank
    if size > shm.TABLE_ENTRIES:
        raise ProtocolError(f"a single-copy alltoall of {size} ranks does not fit the table")
    sbase, rbase = address(send), address(recv)
    sstarts, rstarts = [0], [0]
    for i in range(size):
        sstarts.append(sstarts[-1] + send_counts[i])
        rstarts.append(rstarts[-1] + recv_counts[i])
    t = comm._begin()
    tab = comm._table[me]
    for i in range(size):
        tab[2 * i], tab[2 * i + 1] = sbase + sstarts[i] * item, send_counts[i] * item
    comm.hugepages.prepare([(sbase, send.nbytes)])
    comm._publish(shm.WRITTEN, t)
    recv[rstarts[me]: rstarts[me + 1]] = send[sstarts[me]: sstarts[me + 1]]
    for k in range(1, size):
        j = (me + k) % size  # peers in a different order on each rank: no hot spot
        n = recv_counts[j] * item
        if n:
            comm._wait_all_one(j, shm.WRITTEN, t)
            _peer_copy(comm, j, [(rbase + rstarts[j] * item, n)],
                       [(_published(comm, j, n, entry=me), n)])
    comm._publish(shm.DONE, t)
    comm._wait_all(shm.DONE, t)  # peers read my input until they are DONE


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
    t = comm._begin()
    _publish_input(comm, src)
    comm._publish(shm.WRITTEN, t)
    chunk = max(1, shm.CMA_CHUNK_BYTES // item)
    low, part = order_scratch(comm, chunk, src.dtype)
    bases: dict[int, int] = {}

    def fetch(j: int, buf: np.ndarray) -> np.ndarray:
        """Rank ``j``'s part of the current chunk, read into ``buf``."""
        if j not in bases:
            comm._wait_all_one(j, shm.WRITTEN, t)
            bases[j] = _published(comm, j, src.nbytes)
        _peer_copy(comm, j, [(address(buf), buf.nbytes)], [(bases[j] + a * item, buf.nbytes)])
        return buf

    for a in range(lo, hi, chunk):
        b = min(a + chunk, hi)
        _ops.reduce_in_rank_order(me, comm.size, fetch, [out[a - lo: b - lo]], op,
                                  low[: b - a], part[: b - a], mine=src[a:b])
    comm._publish(shm.DONE, t)
    comm._wait_all(shm.DONE, t)  # peers read my input until they are DONE
    return out
