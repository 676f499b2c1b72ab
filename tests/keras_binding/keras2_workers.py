"""Keras 2 (``tf_keras``) inside real worker processes, ``TF_USE_LEGACY_KERAS=1`` (np=2).

The tests start the workers with ``TF_USE_LEGACY_KERAS=1``, so ``tf.keras`` is
``tf_keras`` and ``ronde.tensorflow.keras`` must pick it by TensorFlow's rule. Each
function checks several things (importing TensorFlow is the slow part) and returns
something small.
"""

from __future__ import annotations

import numpy as np

from keras_workers import B, C, D, S, _shard  # noqa: F401 - the same data layout
from keras_workers import _data as _data_seeded


def _data(size: int) -> tuple[np.ndarray, np.ndarray]:
    return _data_seeded(size, seed=7)


def _model(seed: int):
    import tensorflow as tf

    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.layers.Dense(7, activation="tanh", input_shape=(D,)),
                                tf.keras.layers.Dense(C)])


def _maxdiff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


#: (label, optimizer, arguments, backward passes): both Keras 2 families (current
#: ``tf.keras.optimizers`` and ``tf.keras.optimizers.legacy``), and Horovod's local
#: aggregation (with SGD: Adam's bias correction counts the skipped steps, as in Horovod)
OPTIMIZERS = [("current Adam", "Adam", {"learning_rate": 0.01}, 1),
              ("legacy SGD momentum", "legacy.SGD", {"learning_rate": 0.1, "momentum": 0.5}, 1),
              ("current SGD, 2 passes", "SGD", {"learning_rate": 0.1, "momentum": 0.5}, 2),
              ("legacy SGD, 2 passes", "legacy.SGD", {"learning_rate": 0.1}, 2)]


def _optimizer(name: str, kwargs: dict):
    import tensorflow as tf

    cls = tf.keras.optimizers
    for part in name.split("."):
        cls = getattr(cls, part)
    return cls(**kwargs)


def fit_equivalence() -> dict:
    """model.fit with DistributedOptimizer, BroadcastGlobalVariablesCallback and
    MetricAverageCallback == one process on the global batch, on both ranks alike."""
    import tensorflow as tf
    import tf_keras

    import ronde.tensorflow.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert tf.keras.Model is tf_keras.Model, "tf.keras is not tf_keras (TF_USE_LEGACY_KERAS=1?)"
    assert issubclass(hvd.callbacks.BroadcastGlobalVariablesCallback, tf_keras.callbacks.Callback)
    x, y = _data(n)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out: dict = {}
    for label, name, kwargs, passes in OPTIMIZERS:
        # reference: one process, batch n*B*passes, from rank 0's initial weights
        ref = _model(0)
        ref.compile(optimizer=_optimizer(name, kwargs), loss=loss)
        hist = ref.fit(x, y, batch_size=n * B * passes, epochs=2, shuffle=False, verbose=0)
        # distributed: rank-dependent initial weights; the callback broadcasts rank 0's
        model = _model(r)
        opt = hvd.DistributedOptimizer(_optimizer(name, kwargs),
                                       backward_passes_per_step=passes,
                                       average_aggregated_gradients=True)
        assert hvd.is_distributed(opt) and type(opt).__name__ == name.split(".")[-1]
        model.compile(optimizer=opt, loss=loss)
        got = model.fit(_shard(x, r, n, B), _shard(y, r, n, B), batch_size=B, epochs=2,
                        shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback()])
        weights = model.get_weights()
        every = hvd.allgather_object(weights)
        out[label] = {
            "vs_one_process": _maxdiff(weights, ref.get_weights()),
            "across_ranks": max(_maxdiff(weights, w) for w in every),
            # the averaged loss of one pass per update is the global batch's loss
            "loss": (_maxdiff([got.history["loss"]], [hist.history["loss"]])
                     if passes == 1 else 0.0),
            "loss_across_ranks": _maxdiff(
                [got.history["loss"]], [hvd.broadcast_object(got.history["loss"])]),
        }
    return out


def load_model_roundtrip(folder: str) -> dict:
    """hvd.load_model on tf_keras files (.keras and .h5): the optimizer comes back
    distributed, with its state, and trains on equally on every rank; BestModelCheckpoint
    writes on rank 0, atomically."""
    import os

    import tensorflow as tf

    import ronde.tensorflow.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = _data(n)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out: dict = {}
    for name, make in (("m.keras", lambda: tf.keras.optimizers.Adam(0.01)),
                       ("m.h5", lambda: tf.keras.optimizers.legacy.Adam(0.01))):
        path = os.path.join(folder, name)
        model = _model(0)
        model.compile(optimizer=hvd.DistributedOptimizer(make()), loss=loss)
        model.fit(_shard(x, r, n, B), _shard(y, r, n, B), batch_size=B, epochs=1,
                  verbose=0, shuffle=False)
        state = [np.asarray(v) for v in model.optimizer.variables()]
        wrote = hvd.save_checkpoint(model, path)  # rank 0 only, atomically
        hvd.barrier()
        loaded = hvd.load_model(path)
        loaded_state = [np.asarray(v) for v in loaded.optimizer.variables()]
        iterations = int(loaded.optimizer.iterations.numpy())
        best = os.path.join(folder, f"best-{name}")
        loaded.fit(_shard(x, r, n, B), _shard(y, r, n, B), batch_size=B, epochs=2,
                   verbose=0, shuffle=False,
                   callbacks=[hvd.callbacks.MetricAverageCallback(),
                              hvd.callbacks.BestModelCheckpoint(best, monitor="loss")])
        every = hvd.allgather_object(loaded.get_weights())
        out[name] = {"wrote": wrote, "distributed": hvd.is_distributed(loaded.optimizer),
                     "class": type(loaded.optimizer).__name__, "iterations": iterations,
                     "state": (len(state) == len(loaded_state)
                               and _maxdiff(state, loaded_state) == 0.0),
                     "across_ranks": max(_maxdiff(every[0], w) for w in every)}
        hvd.barrier()
    out["files"] = sorted(os.listdir(folder))  # BestModelCheckpoint: whole files, no temporary
    return out
