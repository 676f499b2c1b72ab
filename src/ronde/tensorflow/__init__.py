"""ronde for TensorFlow 2: Horovod's ``horovod.tensorflow`` API on TF >= 2.16 and Keras 3.

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
    raise ImportError("ronde.tensorflow needs TensorFlow >= 2.16 and Keras 3: pip install "
                      "tensorflow-cpu 'keras>=3' (not tf-keras)") from _exc

from .. import _api
from .._api import (add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                    gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank,
                    local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                    remove_process_set, rocm_built, shutdown, size)
from .._errors import (AuthenticationError, ConfigError, DuplicateNameError, JoinedError,
                       NotInitializedError, PeerLostError, ProtocolError, RendezvousError,
                       RondeError, ShutdownError, StallError, TensorMismatchError)
from .._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..keras.optimizer import DistributedOptimizer
from ..process_sets import ProcessSet, global_process_set
from ._collectives import (allgather, allreduce, alltoall, barrier, broadcast,
                           grouped_allreduce, join, local_rank_op, rank_op, reducescatter,
                           size_op)
from .compression import Compression, Compressor
from .functions import (allgather_object, broadcast_object, broadcast_object_fn,
                        broadcast_variables)
from .gradients import DistributedGradientTape

active_transport = _api.active_transport


def __getattr__(name: str) -> Any:
    # callbacks and keras subclass keras.callbacks.Callback: import Keras on first use.
    if name in ("callbacks", "keras"):
        import importlib

        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "active_transport",
    "rank_op", "size_op", "local_rank_op",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
    "join", "barrier", "broadcast_object", "broadcast_object_fn", "allgather_object",
    "broadcast_variables", "DistributedGradientTape", "DistributedOptimizer",
    "Compression", "Compressor", "callbacks",
    "RondeError", "ConfigError", "NotInitializedError", "TensorMismatchError",
    "DuplicateNameError", "PeerLostError", "StallError", "RendezvousError",
    "AuthenticationError", "ProtocolError", "ShutdownError", "JoinedError",
    "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
    "rocm_built", "ddl_built", "ccl_built", "mpi_threads_supported",
]
