"""ronde for MXNet: Horovod's ``horovod.mxnet`` API on ronde's engine.

A Horovod Gluon script runs with only its import changed::

    import mxnet as mx
    import ronde.mxnet as hvd

    hvd.init()
    net = build_net()
    net.initialize(mx.init.Xavier())
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.1 * hvd.size()})
    for x, y in batches:
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])          # the per-rank batch size

Arrays cross through host memory (``asnumpy()``). MXNet 1.9.1 needs numpy<1.24, so
it lives in its own virtual environment (``scripts/mxnet_tests.sh`` builds one).
See docs/mxnet.md.
"""

from __future__ import annotations

from .. import _api
from .._api import (add_process_set, allgather_object, barrier, broadcast_object, ccl_built,
                    cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                    init, is_homogeneous, is_initialized, join, local_rank, local_size,
                    mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                    remove_process_set, rocm_built, shutdown, size)
from .._errors import (AuthenticationError, ConfigError, DuplicateNameError, JoinedError,
                       NotInitializedError, PeerLostError, ProtocolError, RendezvousError,
                       RondeError, ShutdownError, StallError, TensorMismatchError)
from .._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..frameworks.compression import Compressor
from ..frameworks.host_reduce import NUMPY_COMPRESSION as Compression
from ..process_sets import ProcessSet, global_process_set
from ._collectives import (allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_,
                           fused_allreduce_, grouped_allreduce, grouped_allreduce_,
                           reducescatter)
from .optimizer import DistributedOptimizer, DistributedTrainer
from .state import broadcast_parameters

active_transport = _api.active_transport

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "active_transport",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "fused_allreduce_",
    "allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "join", "barrier", "broadcast_object", "allgather_object",
    "Compression", "Compressor", "DistributedOptimizer", "DistributedTrainer",
    "broadcast_parameters",
    "RondeError", "ConfigError", "NotInitializedError", "TensorMismatchError",
    "DuplicateNameError", "PeerLostError", "StallError", "RendezvousError",
    "AuthenticationError", "ProtocolError", "ShutdownError", "JoinedError",
    "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
    "rocm_built", "ddl_built", "ccl_built", "mpi_threads_supported",
]
