"""ronde for TensorFlow 2: Horovod's ``horovod.tensorflow`` API on TF >= 2.16.

``tf.keras`` is Keras 3, or Keras 2 (``tf_keras``) under ``TF_USE_LEGACY_KERAS=1``: the
Keras parts (optimizer, callbacks, ``SyncBatchNormalization``) follow TensorFlow's rule
(:mod:`ronde.keras._choice`).

A Horovod TF2 script runs with only its import changed::

    import tensorflow as tf, keras
    import ronde.tensorflow as hvd

    hvd.init()
    for gpu in tf.config.list_physical_devices("GPU"):    # no-op without GPUs
        tf.config.experimental.set_memory_growth(gpu, True)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))

    @tf.function
    def train_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

Collectives run eagerly or inside ``tf.function`` (as ``tf.numpy_function`` host
ops; not under XLA ``jit_compile``). See docs/tensorflow.md.
"""

from __future__ import annotations

from typing import Any

try:
    import tensorflow as _tensorflow  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError("ronde.tensorflow needs TensorFlow >= 2.16: pip install tensorflow-cpu "
                      "'keras>=3' (and tf_keras for Keras 2 under TF_USE_LEGACY_KERAS=1)"
                      ) from _exc

from .. import _facade

__all__ = _facade.export_common(globals())

from ..keras.optimizer import DistributedOptimizer  # noqa: E402
from ._collectives import (allgather, allreduce, alltoall, barrier, broadcast,  # noqa: E402
                           broadcast_, grouped_allgather, grouped_allreduce,
                           grouped_reducescatter, join, local_rank_op, local_size_op,
                           process_set_included_op, rank_op, reducescatter, size_op)
from .compression import Compression, Compressor  # noqa: E402
from .functions import (allgather_object, broadcast_global_variables,  # noqa: E402
                        broadcast_object, broadcast_object_fn, broadcast_variables)
from .gradients import DistributedGradientTape, PartialDistributedGradientTape  # noqa: E402
from .sync_batch_norm import SyncBatchNormalization  # noqa: E402
from . import util  # noqa: E402
from .util import _cache, _executing_eagerly, _make_subgraph, refs_to_vars, vars_to_refs  # noqa: E402,F401


_LAZY = ("callbacks", "keras", "elastic")


def __getattr__(name: str) -> Any:
    # callbacks, keras and elastic subclass keras classes: import Keras on first use.
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the submodules imported on first use included."""
    return sorted(set(globals()) | set(_LAZY))
