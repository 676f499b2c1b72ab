"""Dissemination barrier.

Cost model (``n`` ranks): ``ceil(log2 n)`` rounds; in round ``k`` rank ``r`` sends
1 byte to ``r + 2**k`` and receives 1 byte from ``r - 2**k``. After the last
round every rank has (transitively) heard from every other, so nobody leaves
before everybody has arrived. Works for any ``n``, no fold needed.
"""

from __future__ import annotations

from .p2p import P2P

__all__ = ["barrier"]


def barrier(p2p: P2P) -> None:
    """Return once every rank of the group has called ``barrier``."""
    n, r = p2p.size, p2p.rank
    token = memoryview(bytearray(1))
    sink = memoryview(bytearray(1))
    dist = 1
    while dist < n:
        p2p.sendrecv((r + dist) % n, token, (r - dist) % n, sink)
        dist <<= 1
