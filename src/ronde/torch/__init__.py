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

from .. import _facade

__all__ = _facade.export_common(globals())

from .._api import barrier, join  # noqa: E402,F401
from ..frameworks.accumulation import TooManyPassesError  # noqa: E402
from ._autograd import (allgather, allgather_object, allreduce, alltoall, broadcast,  # noqa: E402
                        broadcast_object, grouped_allgather, grouped_allreduce,
                        grouped_reducescatter, reducescatter)
from ._collectives import (allgather_async, allreduce_, allreduce_async,  # noqa: E402
                           allreduce_async_, alltoall_async, broadcast_, broadcast_async,
                           broadcast_async_, grouped_allgather_async, grouped_allreduce_,
                           grouped_allreduce_async, grouped_allreduce_async_,
                           grouped_reducescatter_async, poll, reducescatter_async,
                           sparse_allreduce_async, synchronize)
from ._compile import compile_backend  # noqa: E402
from ._tensors import TorchHandle  # noqa: E402
from .compression import Compression, Compressor  # noqa: E402
from .huggingface import ConsolidateOptimizerState  # noqa: E402
from .optimizer import DistributedOptimizer  # noqa: E402
from .sharded import ShardedOptimizer  # noqa: E402
from .sharded_io import gather_sharded, load_sharded, save_sharded  # noqa: E402
from .state import (broadcast_optimizer_state, broadcast_parameters, broadcast_state,  # noqa: E402
                    save_checkpoint)
from .sync_batch_norm import SyncBatchNorm  # noqa: E402
from . import elastic  # noqa: E402,F401


def nccl_built() -> bool:
    """True when CUDA tensors can stay on the GPU: torch has NCCL and sees a GPU."""
    import torch

    dist = torch.distributed
    return bool(dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available())


def cuda_built() -> bool:
    """True when this torch was built with CUDA."""
    import torch

    return torch.version.cuda is not None
