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

from .. import _facade

__all__ = _facade.export_common(globals())

from .._api import barrier, join  # noqa: E402,F401
from .._objects import allgather_object, broadcast_object  # noqa: E402,F401
from ..frameworks.compression import Compressor
from ..frameworks.handles import ConvertingHandle as JaxHandle
from ..process_sets import ProcessSet, global_process_set
from ._autodiff import (Compression, allgather, allreduce, alltoall, broadcast,
                        grouped_allreduce, reducescatter)
from ._collectives import (allgather_async, allreduce_async, alltoall_async, broadcast_async,
                           grouped_allreduce_async, poll, reducescatter_async, synchronize)
from .optimizer import (DistributedOptimizer, DistributedState, allreduce_gradients,
                        reduce_gradients)
from .sharded import ShardedOptimizer, ShardedState
from .slicewise import clip_by_global_norm
from .sharded_io import gather_sharded, load_sharded, save_sharded
from .state import (broadcast_optimizer_state, broadcast_parameters, broadcast_variables,
                    save_checkpoint)


from . import elastic  # noqa: E402,F401
