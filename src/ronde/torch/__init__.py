"""ronde for PyTorch: Horovod's ``horovod.torch`` API on ronde's engine.

A Horovod PyTorch script runs with only its import changed::

    import ronde.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

CPU tensors are exchanged without copies; CUDA allreduces and broadcasts stay on the
GPU (NCCL, see ``_device.py``), other CUDA collectives go through host memory (a
warning says so once). See docs/pytorch.md for what differs from Horovod.
"""

from __future__ import annotations

from .. import _api
from .._api import (add_process_set, barrier, ccl_built, cross_rank, cross_size,
                    ddl_built, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                    join, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                    rank, remove_process_set, rocm_built, shutdown, size, start_timeline,
                    stop_timeline)
from .._errors import (AuthenticationError, ConfigError, DuplicateNameError, JoinedError,
                       NotInitializedError, PeerLostError, ProtocolError, RendezvousError,
                       RondeError, ShutdownError, StallError, TensorMismatchError,
                       CollectiveError, DeadlockError, HorovodInternalError, UnsupportedError)
from .._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..frameworks.accumulation import TooManyPassesError
from ..process_sets import ProcessSet, global_process_set
from ._autograd import (allgather, allgather_object, allreduce, alltoall, broadcast,
                        broadcast_object, grouped_allgather, grouped_allreduce,
                        grouped_reducescatter, reducescatter)
from ._collectives import (allgather_async, allreduce_, allreduce_async, allreduce_async_,
                           alltoall_async, broadcast_, broadcast_async, broadcast_async_,
                           grouped_allgather_async, grouped_allreduce_, grouped_allreduce_async,
                           grouped_allreduce_async_, grouped_reducescatter_async, poll,
                           reducescatter_async, sparse_allreduce_async, synchronize)
from ._tensors import TorchHandle
from .compression import Compression, Compressor
from .optimizer import DistributedOptimizer
from .state import broadcast_optimizer_state, broadcast_parameters, broadcast_state
from .sync_batch_norm import SyncBatchNorm

active_transport = _api.active_transport

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "active_transport",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "start_timeline", "stop_timeline",
    "broadcast", "broadcast_async", "broadcast_",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "poll", "synchronize", "join", "barrier", "broadcast_object", "allgather_object",
    "TorchHandle", "Compression", "Compressor", "DistributedOptimizer",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_state", "SyncBatchNorm",
    "RondeError", "ConfigError", "NotInitializedError", "TensorMismatchError",
    "DuplicateNameError", "PeerLostError", "StallError", "RendezvousError",
    "AuthenticationError", "ProtocolError", "ShutdownError", "JoinedError",
    "HorovodInternalError", "CollectiveError", "DeadlockError", "UnsupportedError",
    "TooManyPassesError",
    "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
    "rocm_built", "ddl_built", "ccl_built", "mpi_threads_supported",
]


def nccl_built() -> bool:
    """True when CUDA tensors can stay on the GPU: torch has NCCL and sees a GPU."""
    import torch

    dist = torch.distributed
    return bool(dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available())


def cuda_built() -> bool:
    """True when this torch was built with CUDA."""
    import torch

    return torch.version.cuda is not None
