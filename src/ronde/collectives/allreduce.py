"""Allreduce: recursive doubling for small buffers, ring for large ones.

Cost model (``n`` ranks, ``L`` bytes, ``p`` the largest power of two ``<= n``):

* **recursive doubling** (latency-optimal): ``log2(p)`` exchange steps, each of
  the whole buffer, so ``log2(p) * L`` bytes sent per rank. When ``n`` is not a
  power of two, the first ``2 * (n - p)`` ranks fold in pairs first: the even one
  sends its buffer to the odd one (1 message, ``L`` bytes), sits out, and gets
  the result back at the end (1 more message) -- two extra steps of latency.
* **ring** (bandwidth-optimal): reduce-scatter then allgather over ``n`` blocks
  of near-equal size; ``2 * (n - 1)`` steps, ``2 * (n - 1) / n * L`` bytes sent
  per rank. Large steps are pipelined in pieces of ``piece_bytes``.

Determinism: in recursive doubling both partners compute
``lower_half (op) upper_half`` with the same operand order, so they hold the same
bits after every step; in the ring each block is reduced on one rank only and
then copied. Either way every rank ends with bitwise-identical bytes (the two
algorithms may differ from each other in the last bits of floating sums).
"""

from __future__ import annotations

import numpy as np

from .allgather import ring_allgather_inplace
from .ops import ReduceOp, reduce_pair
from .p2p import P2P, byte_view, flat_view
from .reducescatter import DEFAULT_PIECE_BYTES, check_op, offsets_of, ring_reduce_scatter_inplace

__all__ = ["allreduce", "allreduce_recursive_doubling", "allreduce_ring", "DEFAULT_SMALL_BYTES"]

#: Buffers up to this many bytes use recursive doubling.
DEFAULT_SMALL_BYTES = 64 * 1024


def even_counts(length: int, size: int) -> list[int]:
    """Split ``length`` elements into ``size`` blocks differing by at most one."""
    base, extra = divmod(length, size)
    return [base + 1 if i < extra else base for i in range(size)]


def allreduce_ring(
    p2p: P2P, buf: np.ndarray, op: ReduceOp, piece_bytes: int = DEFAULT_PIECE_BYTES
) -> None:
    """Ring allreduce in place (reduce-scatter + allgather). See :func:`allreduce`."""
    op = check_op(op, "allreduce")
    flat = flat_view(buf, "allreduce")
    if p2p.size == 1 or flat.size == 0:
        return
    offsets = offsets_of(even_counts(flat.size, p2p.size))
    ring_reduce_scatter_inplace(p2p, flat, offsets, op, piece_bytes)
    ring_allgather_inplace(p2p, flat, offsets)


def allreduce_recursive_doubling(p2p: P2P, buf: np.ndarray, op: ReduceOp) -> None:
    """Recursive-doubling allreduce in place, with a fold for non-powers of two.

    See :func:`allreduce`.
    """
    op = check_op(op, "allreduce")
    flat = flat_view(buf, "allreduce")
    n, r = p2p.size, p2p.rank
    if n == 1 or flat.size == 0:
        return
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    mine = byte_view(flat)
    tmp = np.empty_like(flat)
    if r < 2 * rem:
        if r % 2 == 0:
            # Folded out: hand the data to the odd neighbour, get the result back.
            p2p.send(r + 1, mine)
            p2p.recv(r + 1, mine)
            return
        p2p.recv(r - 1, byte_view(tmp))
        reduce_pair(tmp, flat, flat, op)
        vrank = r // 2
    else:
        vrank = r - rem
    mask = 1
    while mask < p:
        vpeer = vrank ^ mask
        peer = 2 * vpeer + 1 if vpeer < rem else vpeer + rem
        p2p.sendrecv(peer, mine, peer, byte_view(tmp))
        # Lower half first on both sides, so both partners compute the same bits.
        if vpeer < vrank:
            reduce_pair(tmp, flat, flat, op)
        else:
            reduce_pair(flat, tmp, flat, op)
        mask <<= 1
    if r < 2 * rem:
        p2p.send(r - 1, mine)


def allreduce(
    p2p: P2P,
    buf: np.ndarray,
    op: ReduceOp,
    small_bytes: int = DEFAULT_SMALL_BYTES,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> None:
    """Reduce ``buf`` over all ranks of the group, in place, on every rank.

    Args:
        p2p: The group's point-to-point endpoint.
        buf: Contiguous array of any numeric dtype; same length and dtype on
            all ranks.
        op: SUM, MIN, MAX or PRODUCT (AVERAGE reduces as SUM; the caller scales).
        small_bytes: Buffers up to this many bytes use recursive doubling
            (latency-bound), larger ones the ring (bandwidth-bound).
        piece_bytes: Pipelining piece size of a ring step.

    Every rank ends with bitwise-identical bytes.
    """
    if buf.nbytes <= small_bytes:
        allreduce_recursive_doubling(p2p, buf, op)
    else:
        allreduce_ring(p2p, buf, op, piece_bytes)
