"""ronde for Keras 3: Horovod's ``horovod.keras`` API on the TensorFlow, JAX and torch backends.

One script trains data-parallel on every Keras backend (``KERAS_BACKEND=jax|torch|
tensorflow``)::

    import keras
    import ronde.keras as hvd

    hvd.init()
    model = build_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()],
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)

See docs/keras.md for what runs where on each backend. With ``TF_USE_LEGACY_KERAS=1`` and
``tf_keras`` installed (TensorFlow's rule for ``tf.keras``, :mod:`._choice`), the same API
works on Keras 2: the callbacks are ``tf_keras`` callbacks and ``DistributedOptimizer``
wraps Keras 2 optimizers (:mod:`.keras2_optimizer`).
"""

from __future__ import annotations

from typing import Any

from ..frameworks.compression import Compresses
from ._choice import keras_module

keras_module()  # the Keras that tf.keras is (TensorFlow's rule), or an ImportError naming the fix

import numpy as np  # noqa: E402

from .. import _api, _facade, _objects  # noqa: E402

__all__ = _facade.export_common(globals())

from .._api import barrier, join  # noqa: E402,F401
from ..frameworks.compression import NUMPY_COMPRESSION as Compression
from ..process_sets import ProcessSet, global_process_set
from . import callbacks
from ._bridge import to_numpy, to_tensor
from .callbacks import broadcast_model
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, is_distributed
from .saving import load_model, save_checkpoint
from .sharded import ShardedOptimizer, is_sharded
from .sharded_io import gather_sharded, load_sharded, save_sharded


def _tensor(value: np.ndarray) -> Any:
    return to_tensor(value)


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: Compresses | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce a value (backend tensor, numpy array, number) over the ranks; eager."""
    return _tensor(_api.allreduce(np.asarray(to_numpy(value)), average, name, op,
                                  prescale_factor, postscale_factor, process_set))


def allgather(value: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's value along dimension 0; eager."""
    return _tensor(_api.allgather(to_numpy(value), name, process_set))


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """The root rank's value on every rank; eager."""
    return _tensor(_api.broadcast(to_numpy(value), root_rank, name, process_set))


def reducescatter(value: Any, name: str | None = None, op: Any = None,
                  process_set: ProcessSet = global_process_set) -> Any:
    """Reduce over ranks; rank r gets its block of dimension 0; eager."""
    return _tensor(_api.reducescatter(to_numpy(value), op, name, process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Broadcast a picklable object from ``root_rank``."""
    return _objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather a picklable object from every rank, in rank order."""
    return _objects.allgather_object(obj, name, process_set)


def broadcast_variables(variables: Any, root_rank: int = 0,
                        process_set: ProcessSet = global_process_set) -> None:
    """Assign the root rank's values to Keras variables on every rank (eager). Variables
    of a ``ShardedOptimizer`` that hold this rank's slice (its shards and slots) keep
    their values: pass ``optimizer.variables`` whole, the replicated ones (step counts,
    learning rate) are broadcast."""
    from .callbacks import _broadcast_arrays
    from .sharded import replicated

    if callable(variables) and not isinstance(variables, (list, tuple)):
        variables = variables()
    variables = replicated(variables)
    values = _broadcast_arrays([to_numpy(v) for v in variables], root_rank,
                               f"broadcast_variables.{len(variables)}", process_set)
    for v, value in zip(variables, values):
        v.assign(value)


def __getattr__(name: str) -> Any:
    # the elastic states import this package: load them on first use
    if name == "elastic":
        import importlib

        module = importlib.import_module(f"{__name__}.elastic")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
