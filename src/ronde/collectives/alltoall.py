"""All-to-all with per-destination counts, by pairwise exchange.

Cost model (``n`` ranks): ``n - 1`` steps; at step ``s`` rank ``r`` sends its
block for ``r + s`` and receives the block from ``r - s`` in one ``sendrecv``.
A rank sends exactly the bytes it owes others (``sum(send_counts) -
send_counts[rank]`` elements) in at most ``n - 1`` messages (empty blocks are
skipped on both sides); its own block is a local copy. Every step pairs each
rank with a distinct partner, so no rank is a hot spot.
"""

from __future__ import annotations

import numpy as np

from .p2p import P2P, exchange, flat_view
from .reducescatter import check_counts, offsets_of

__all__ = ["alltoallv"]


def alltoallv(
    p2p: P2P,
    send: np.ndarray,
    send_counts: list[int],
    recv: np.ndarray,
    recv_counts: list[int],
) -> None:
    """Send block ``i`` of ``send`` to rank ``i``; receive rank ``i``'s block into ``recv``.

    Args:
        p2p: The group's point-to-point endpoint.
        send: Contiguous input of ``sum(send_counts)`` elements, blocks in
            destination-rank order.
        send_counts: Elements this rank sends to each rank (zeros allowed).
        recv: Contiguous output of ``sum(recv_counts)`` elements, same dtype,
            blocks in source-rank order.
        recv_counts: Elements this rank receives from each rank. Rank ``j``'s
            ``send_counts[i]`` must equal rank ``i``'s ``recv_counts[j]``.
    """
    sflat = flat_view(send, "alltoallv")
    rflat = flat_view(recv, "alltoallv")
    if sflat.dtype != rflat.dtype:
        raise ValueError(f"alltoallv: send is {sflat.dtype} but recv is {rflat.dtype}; use one dtype")
    n, r = p2p.size, p2p.rank
    send_counts = check_counts(send_counts, n, sflat.size, "alltoallv send_counts")
    recv_counts = check_counts(recv_counts, n, rflat.size, "alltoallv recv_counts")
    if send_counts[r] != recv_counts[r]:
        raise ValueError(
            f"alltoallv: rank {r} sends {send_counts[r]} elements to itself but expects "
            f"{recv_counts[r]}"
        )
    soff = offsets_of(send_counts)
    roff = offsets_of(recv_counts)
    rflat[roff[r] : roff[r + 1]] = sflat[soff[r] : soff[r + 1]]
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        exchange(p2p, dst, sflat[soff[dst] : soff[dst + 1]], src, rflat[roff[src] : roff[src + 1]])
