"""Allgather with per-rank counts: ring for large totals, direct exchange for small.

Cost model (``n`` ranks, ``L`` bytes gathered in total, ``L_r`` from rank ``r``):

* **ring**: ``n - 1`` steps; at step ``s`` rank ``r`` forwards block ``r - s`` to
  ``r + 1``. A rank sends ``L - L_{r+1}`` bytes (about ``(n - 1) / n * L``) in
  ``n - 1`` messages, always to the same neighbour, so on a ring or tree of
  links every link carries each block once. Step ``s`` depends on step ``s - 1``.
* **direct** (pairwise): ``n - 1`` steps; at step ``s`` rank ``r`` sends its own
  block to ``r + s`` and receives from ``r - s``. A rank sends ``(n - 1) * L_r``
  bytes in ``n - 1`` messages; the steps are independent (no store and forward),
  which is what matters for small messages where latency dominates, up to a few ranks.
* **Bruck** (small totals beyond ``BRUCK_MIN_RANKS`` ranks): ``ceil(log2 n)`` steps;
  at step ``k`` rank ``r`` sends the blocks it holds (``r`` to ``r + 2^k - 1``) to
  ``r - 2^k`` and receives the next ones from ``r + 2^k``, then rotates them into
  place: latency ``log2 n`` messages instead of ``n - 1``, and ``2 log2 n`` peers
  (sockets opened, see transport/mesh.py) instead of every one.

Results are byte copies, so every rank holds identical bytes.
"""

from __future__ import annotations

import numpy as np

from .p2p import P2P, exchange, flat_view
from .reducescatter import check_counts, offsets_of

__all__ = ["allgatherv", "allgatherv_bruck", "allgatherv_direct", "allgatherv_ring",
           "DEFAULT_SMALL_BYTES"]

#: Totals up to this many bytes use the direct algorithm (Bruck's beyond a few ranks).
DEFAULT_SMALL_BYTES = 64 * 1024
#: From this many ranks on, small totals use Bruck's algorithm (fewer steps than direct:
#: 3 against 4 at 5 ranks)
BRUCK_MIN_RANKS = 5


def ring_allgather_inplace(p2p: P2P, work: np.ndarray, offsets: list[int]) -> None:
    """Ring allgather in place: block ``rank`` of ``work`` is filled, the rest get filled."""
    n, r = p2p.size, p2p.rank
    if n == 1 or work.size == 0:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        sk = (r - s) % n
        rk = (r - s - 1) % n
        exchange(
            p2p,
            nxt,
            work[offsets[sk] : offsets[sk + 1]],
            prv,
            work[offsets[rk] : offsets[rk + 1]],
        )


def _prepare(
    p2p: P2P, send: np.ndarray, recv: np.ndarray, counts: list[int], what: str
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    sflat = flat_view(send, what)
    rflat = flat_view(recv, what)
    counts = check_counts(counts, p2p.size, rflat.size, what)
    if sflat.size != counts[p2p.rank]:
        raise ValueError(
            f"{what}: rank {p2p.rank} sends {sflat.size} elements but counts[{p2p.rank}] "
            f"is {counts[p2p.rank]}"
        )
    if sflat.dtype != rflat.dtype:
        raise ValueError(f"{what}: send is {sflat.dtype} but recv is {rflat.dtype}; use one dtype")
    offsets = offsets_of(counts)
    lo, hi = offsets[p2p.rank], offsets[p2p.rank + 1]
    rflat[lo:hi] = sflat
    return sflat, rflat, offsets


def allgatherv_ring(p2p: P2P, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
    """Ring allgather (bandwidth-optimal on neighbour links). See :func:`allgatherv`."""
    _, rflat, offsets = _prepare(p2p, send, recv, counts, "allgatherv")
    ring_allgather_inplace(p2p, rflat, offsets)


def allgatherv_direct(p2p: P2P, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
    """Pairwise direct allgather (no forwarding). See :func:`allgatherv`."""
    sflat, rflat, offsets = _prepare(p2p, send, recv, counts, "allgatherv")
    n, r = p2p.size, p2p.rank
    for s in range(1, n):
        src = (r - s) % n
        exchange(p2p, (r + s) % n, sflat, src, rflat[offsets[src] : offsets[src + 1]])


def allgatherv_bruck(p2p: P2P, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
    """Bruck's allgather in ``ceil(log2 n)`` steps (module docstring)."""
    sflat, rflat, offsets = _prepare(p2p, send, recv, counts, "allgatherv")
    n, r = p2p.size, p2p.rank
    if n == 1 or rflat.size == 0:
        return
    # the blocks in the order this rank gathers them: r, r + 1, ..., r - 1
    pos = offsets_of([counts[(r + i) % n] for i in range(n)])
    work = np.empty_like(rflat)
    work[: pos[1]] = sflat
    have = 1
    while have < n:
        m = min(have, n - have)
        exchange(p2p, (r - have) % n, work[: pos[m]], (r + have) % n,
                 work[pos[have]: pos[have + m]])
        have += m
    tail = rflat.size - offsets[r]  # blocks r .. n - 1 come first in ``work``
    rflat[offsets[r]:] = work[:tail]
    rflat[: offsets[r]] = work[tail:]


def allgatherv(
    p2p: P2P,
    send: np.ndarray,
    recv: np.ndarray,
    counts: list[int],
    small_bytes: int = DEFAULT_SMALL_BYTES,
) -> None:
    """Gather every rank's ``send`` into ``recv`` on every rank, blocks in rank order.

    Args:
        p2p: The group's point-to-point endpoint.
        send: This rank's contiguous block, ``counts[rank]`` elements.
        recv: Contiguous output of ``sum(counts)`` elements, same dtype; block
            ``r`` (``counts[r]`` elements) comes from rank ``r``.
        counts: Elements per rank (zeros allowed); identical on all ranks.
        small_bytes: Totals up to this many bytes use the direct algorithm (Bruck's
            from ``BRUCK_MIN_RANKS`` ranks), larger ones the ring (at 2 ranks the
            three are the same exchange).
    """
    if p2p.size <= 2 or (recv.nbytes <= small_bytes and p2p.size < BRUCK_MIN_RANKS):
        allgatherv_direct(p2p, send, recv, counts)
    elif recv.nbytes <= small_bytes:
        allgatherv_bruck(p2p, send, recv, counts)
    else:
        allgatherv_ring(p2p, send, recv, counts)
