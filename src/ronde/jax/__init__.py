"""ronde for JAX: Horovod-style data parallelism for ``jax.Array`` pytrees and optax.

Horovod never had a JAX binding; this one follows ``horovod.tensorflow``'s names::

    import jax, optax
    import ronde.jax as hvd

    hvd.init()
    params = hvd.broadcast_parameters(init_params(jax.random.key(0)), root_rank=0)
    tx = hvd.DistributedOptimizer(optax.sgd(0.05 * hvd.size(), momentum=0.9))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)           # local gradients
        updates, opt_state = tx.update(grads, opt_state, params)  # averaged over ranks
        return optax.apply_updates(params, updates), opt_state

Every collective takes an array or a pytree of arrays and works eagerly and inside
``jax.jit`` (as an ordered host callback); ``allreduce``, ``allgather`` and
``broadcast`` are differentiable. See docs/jax.md for what runs where.
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
from ..frameworks.handles import ConvertingHandle as JaxHandle
from ..process_sets import ProcessSet, global_process_set
from ._autodiff import (Compression, allgather, allreduce, alltoall, broadcast,
                        grouped_allreduce, reducescatter)
from ._collectives import (allgather_async, allreduce_async, alltoall_async, broadcast_async,
                           grouped_allreduce_async, poll, reducescatter_async, synchronize)
from .optimizer import (DistributedOptimizer, DistributedState, allreduce_gradients,
                        reduce_gradients)
from .state import broadcast_optimizer_state, broadcast_parameters, broadcast_variables

active_transport = _api.active_transport

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "active_transport",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "broadcast", "broadcast_async", "alltoall",
    "alltoall_async", "reducescatter", "reducescatter_async", "poll", "synchronize",
    "join", "barrier", "broadcast_object", "allgather_object", "JaxHandle",
    "Compression", "Compressor", "DistributedOptimizer", "DistributedState",
    "allreduce_gradients", "reduce_gradients",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_variables",
    "RondeError", "ConfigError", "NotInitializedError", "TensorMismatchError",
    "DuplicateNameError", "PeerLostError", "StallError", "RendezvousError",
    "AuthenticationError", "ProtocolError", "ShutdownError", "JoinedError",
    "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
    "rocm_built", "ddl_built", "ccl_built", "mpi_threads_supported",
]
