"""Collective algorithms over point-to-point channels.

Every algorithm takes a :class:`P2P` endpoint (one member of a group) and
contiguous numpy buffers, and leaves every rank with bitwise-identical results.
The dispatching functions (``allreduce``, ``allgatherv``, ``broadcast``) pick an
algorithm by message size; the named variants are exported for tests and
benchmarks. Each module's docstring gives the cost model.
"""

from .allgather import allgatherv, allgatherv_bruck, allgatherv_direct, allgatherv_ring
from .allreduce import allreduce, allreduce_recursive_doubling, allreduce_ring
from .alltoall import alltoallv
from .barrier import barrier
from .broadcast import broadcast, broadcast_binomial, broadcast_chain
from .ops import ReduceOp, reduce_into, reduce_pair
from .p2p import P2P
from .reducescatter import reducescatter

__all__ = [
    "P2P",
    "ReduceOp",
    "allgatherv",
    "allgatherv_bruck",
    "allgatherv_direct",
    "allgatherv_ring",
    "allreduce",
    "allreduce_recursive_doubling",
    "allreduce_ring",
    "alltoallv",
    "barrier",
    "broadcast",
    "broadcast_binomial",
    "broadcast_chain",
    "reduce_into",
    "reduce_pair",
    "reducescatter",
]
