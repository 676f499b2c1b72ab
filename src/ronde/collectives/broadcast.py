"""Broadcast: binomial tree for small buffers, pipelined chain for large ones.

Cost model (``n`` ranks, ``L`` bytes):

* **binomial tree**: ``ceil(log2 n)`` rounds; the root sends ``ceil(log2 n)``
  messages of ``L`` bytes, an inner rank up to ``log2 n`` fewer, every non-root
  receives one. Latency-optimal, but the root's link carries ``L * log2 n``.
* **pipelined chain**: ranks form the chain ``root, root+1, ..., root-1`` and the
  buffer moves in pieces of ``piece_bytes``; each inner rank receives piece
  ``i + 1`` while it forwards piece ``i`` (one ``sendrecv``). Every rank sends
  and receives ``L`` bytes at most, in ``ceil(L / piece_bytes)`` messages, and the
  time is ``(n - 2 + L / piece_bytes)`` piece-steps: it approaches ``L`` bytes
  per link for ``L`` large, below the ``2 * (n - 1) / n * L`` of
  scatter + ring allgather and with simpler code (no block arithmetic, no
  reassembly). Its latency grows with ``n``, hence the tree for small buffers.
"""

from __future__ import annotations

import numpy as np

from .p2p import P2P, byte_view, flat_view
from .reducescatter import DEFAULT_PIECE_BYTES

__all__ = ["broadcast", "broadcast_binomial", "broadcast_chain", "DEFAULT_LARGE_BYTES"]

#: Buffers larger than this (with more than 2 ranks) use the pipelined chain.
DEFAULT_LARGE_BYTES = 1 << 20


def _check_root(p2p: P2P, root: int) -> None:
    if not 0 <= root < p2p.size:
        raise ValueError(f"broadcast: root {root} is outside 0..{p2p.size - 1}")


def broadcast_binomial(p2p: P2P, buf: np.ndarray, root: int) -> None:
    """Binomial-tree broadcast in place. See :func:`broadcast`."""
    _check_root(p2p, root)
    data = byte_view(flat_view(buf, "broadcast"))
    n = p2p.size
    if n == 1 or len(data) == 0:
        return
    vrank = (p2p.rank - root) % n
    mask = 1
    while mask < n:
        if vrank & mask:
            p2p.recv((vrank - mask + root) % n, data)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vrank + mask < n:
            p2p.send((vrank + mask + root) % n, data)
        mask >>= 1


def broadcast_chain(
    p2p: P2P, buf: np.ndarray, root: int, piece_bytes: int = DEFAULT_PIECE_BYTES
) -> None:
    """Pipelined-chain broadcast in place. See :func:`broadcast`."""
    _check_root(p2p, root)
    data = byte_view(flat_view(buf, "broadcast"))
    n, r = p2p.size, p2p.rank
    if n == 1 or len(data) == 0:
        return
    step = max(1, piece_bytes)
    pieces = [data[i : i + step] for i in range(0, len(data), step)]
    vrank = (r - root) % n
    nxt, prv = (r + 1) % n, (r - 1) % n
    if vrank == 0:
        for piece in pieces:
            p2p.send(nxt, piece)
    elif vrank == n - 1:
        for piece in pieces:
            p2p.recv(prv, piece)
    else:
        p2p.recv(prv, pieces[0])
        for i in range(1, len(pieces)):
            p2p.sendrecv(nxt, pieces[i - 1], prv, pieces[i])
        p2p.send(nxt, pieces[-1])


def broadcast(
    p2p: P2P,
    buf: np.ndarray,
    root: int,
    large_bytes: int = DEFAULT_LARGE_BYTES,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> None:
    """Copy ``buf`` from ``root`` to every rank, in place.

    Args:
        p2p: The group's point-to-point endpoint.
        buf: Contiguous array, same length and dtype on all ranks; read on the
            root, overwritten elsewhere.
        root: Rank (in this group) that holds the data.
        large_bytes: Buffers larger than this, with more than 2 ranks, use the
            pipelined chain; others the binomial tree.
        piece_bytes: Piece size of the chain.
    """
    if buf.nbytes > large_bytes and p2p.size > 2:
        broadcast_chain(p2p, buf, root, piece_bytes)
    else:
        broadcast_binomial(p2p, buf, root)
