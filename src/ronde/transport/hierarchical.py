"""Hierarchical allreduce: shared memory within each host, tcp across hosts.

Used for a process set that spans several hosts with several members on each
(the same number on every host). An allreduce of N bytes runs in three phases:

1. within each host, a shared-memory reduce-scatter: local rank i ends with block i
   (N/L bytes, L members per host) reduced over its host;
2. across hosts, the members holding the same block (one per host) allreduce it over
   tcp with the bandwidth-optimal ring: each sends 2(H-1)/H * N/L bytes;
3. within each host, a shared-memory allgather puts the blocks back together.

So each host's link carries 2(H-1)/H * N bytes in all, split over its L members,
instead of the flat ring's traffic of every member. Every element is reduced in a
fixed order (host-local rank order, then the ring), so every rank gets the same
bits. Collectives other than allreduce go through the flat tcp communicator.
"""

from __future__ import annotations

import numpy as np

from ..collectives.allreduce import even_counts
from ..collectives.ops import ReduceOp
from .base import Communicator


class HierarchicalCommunicator(Communicator):
    """Allreduce = local reduce-scatter + cross-host allreduce + local allgather."""

    name = "hierarchical"

    def __init__(self, local: Communicator, cross: Communicator, flat: Communicator) -> None:
        self.local, self.cross, self.flat = local, cross, flat
        self.rank, self.size = flat.rank, flat.size

    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        counts = even_counts(buf.size, self.local.size)
        block = self.local.reducescatter(buf, counts, op)
        self.cross.allreduce(block, op)
        self.local.allgatherv(block, buf, counts)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        self.flat.allgatherv(send, recv, counts)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.flat.broadcast(buf, root)

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int]) -> None:
        self.flat.alltoallv(send, send_counts, recv, recv_counts)

    def reducescatter(self, buf: np.ndarray, counts: list[int], op: ReduceOp,
                      out: np.ndarray | None = None) -> np.ndarray:
        return self.flat.reducescatter(buf, counts, op, out)

    def barrier(self) -> None:
        self.flat.barrier()

    def close(self) -> None:
        self.local.close()
