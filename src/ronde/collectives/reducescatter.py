"""Ring reduce-scatter, and the block/piece arithmetic the ring algorithms share.

Cost model (``n`` ranks, ``L`` bytes in the whole buffer, blocks of the given counts):
``n - 1`` steps; at each step a rank sends one block to ``rank + 1`` and receives
one from ``rank - 1``, so it sends ``L - L_{rank+1}`` bytes in total, about
``(n - 1) / n * L`` for even counts. Large blocks travel as pieces of at most
``piece_bytes`` (one ``sendrecv`` per piece), which bounds the scratch buffer to
one piece and lets the reduction of piece ``i`` touch cache-warm data.

Determinism: block ``k`` is reduced by one chain of ranks, ``k+1, k+2, ..., k``,
each applying ``partial (op) own``; the final value exists on exactly one rank
(then copied bytewise by an allgather), so no two ranks ever disagree.
"""

from __future__ import annotations

import numpy as np

from .ops import ReduceOp, reduce_pair
from .p2p import P2P, exchange, flat_view

__all__ = ["reducescatter", "DEFAULT_PIECE_BYTES"]

#: Ring steps larger than this are split into pieces of this many bytes.
DEFAULT_PIECE_BYTES = 1 << 20

_ELEMENTWISE_OPS = (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


def check_op(op: ReduceOp, what: str) -> ReduceOp:
    """Return ``op`` as a :class:`ReduceOp` if the algorithms can apply it elementwise.

    ``AVERAGE`` reduces like ``SUM`` (the caller scales afterwards).
    """
    op = ReduceOp(op)
    if op not in _ELEMENTWISE_OPS:
        raise ValueError(
            f"{what}: op {op.name} is not elementwise; the engine resolves it "
            "(use SUM, MIN, MAX or PRODUCT here)"
        )
    return op


def offsets_of(counts: list[int]) -> list[int]:
    """Start offsets of consecutive blocks, plus the total at the end."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def check_counts(counts: list[int], size: int, total: int | None, what: str) -> list[int]:
    """Validate per-rank block counts (one per rank, non-negative, summing to ``total``)."""
    counts = [int(c) for c in counts]
    if len(counts) != size:
        raise ValueError(f"{what}: got {len(counts)} counts for a group of {size} ranks; pass one per rank")
    if any(c < 0 for c in counts):
        raise ValueError(f"{what}: counts {counts} contain a negative value")
    if total is not None and sum(counts) != total:
        raise ValueError(f"{what}: counts {counts} sum to {sum(counts)}, but the buffer has {total} elements")
    return counts


def piece_elems(itemsize: int, piece_bytes: int) -> int:
    """Elements per pipelining piece (at least one)."""
    return max(1, piece_bytes // max(1, itemsize))


def ring_reduce_scatter_inplace(
    p2p: P2P,
    work: np.ndarray,
    offsets: list[int],
    op: ReduceOp,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> None:
    """Ring reduce-scatter over ``work`` in place.

    Afterwards ``work[offsets[rank]:offsets[rank + 1]]`` is block ``rank`` reduced
    over all ranks; the other blocks of ``work`` hold partial sums (garbage).
    """
    n, r = p2p.size, p2p.rank
    if n == 1 or work.size == 0:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    step_elems = piece_elems(work.itemsize, piece_bytes)
    largest = max(offsets[i + 1] - offsets[i] for i in range(n))
    scratch = np.empty(min(largest, step_elems), dtype=work.dtype)
    for s in range(n - 1):
        sk = (r - s - 1) % n  # block sent: it already holds this rank's contribution
        rk = (r - s - 2) % n  # block received, then combined with this rank's data
        s_lo, s_hi = offsets[sk], offsets[sk + 1]
        r_lo, r_hi = offsets[rk], offsets[rk + 1]
        pieces = -(-max(s_hi - s_lo, r_hi - r_lo) // step_elems)
        for i in range(pieces):
            a = s_lo + i * step_elems
            send = work[a : min(a + step_elems, s_hi)]
            b = r_lo + i * step_elems
            mine = work[b : min(b + step_elems, r_hi)]
            got = scratch[: mine.size]
            exchange(p2p, nxt, send, prv, got)
            if mine.size:
                # partial (op) own, always in this operand order: with ties of
                # -0.0/+0.0 or NaN payloads np.minimum/maximum return one operand.
                reduce_pair(got, mine, mine, op)


def reducescatter(
    p2p: P2P,
    buf: np.ndarray,
    counts: list[int],
    op: ReduceOp,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> np.ndarray:
    """Reduce ``buf`` over all ranks and return this rank's block of the result.

    Args:
        p2p: The group's point-to-point endpoint.
        buf: The full contiguous input (``sum(counts)`` elements); not modified.
        counts: Elements of each rank's block, in rank order (zeros allowed).
        op: SUM, MIN, MAX or PRODUCT (AVERAGE reduces as SUM).
        piece_bytes: Pipelining piece size of a ring step.

    Returns:
        A new array of ``counts[rank]`` elements, bitwise identical to what any
        rank would compute for that block.

    Cost: ``n - 1`` ring steps, about ``(n - 1) / n`` of ``buf`` sent per rank.
    """
    op = check_op(op, "reducescatter")
    flat = flat_view(buf, "reducescatter")
    counts = check_counts(counts, p2p.size, flat.size, "reducescatter")
    offsets = offsets_of(counts)
    work = flat.copy()
    ring_reduce_scatter_inplace(p2p, work, offsets, op, piece_bytes)
    lo, hi = offsets[p2p.rank], offsets[p2p.rank + 1]
    return work[lo:hi].copy()
