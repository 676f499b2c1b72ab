"""One ronde.keras script, data-parallel on every Keras 3 backend.

Run it unchanged on TensorFlow, JAX or torch::

    KERAS_BACKEND=jax    ronderun -np 2 python examples/keras3_multibackend.py
    KERAS_BACKEND=torch  ronderun -np 2 python examples/keras3_multibackend.py
    KERAS_BACKEND=tensorflow ronderun -np 2 python examples/keras3_multibackend.py

The same ``DistributedOptimizer`` averages the gradients on each backend (inside
``tf.function``, inside ``jax.jit`` through ``jax.pure_callback``, eagerly on
torch). At the end every rank checks that it holds exactly rank 0's weights.
Expect a test accuracy of about 0.96 (>= 0.90) on scikit-learn's digits.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import ronde.keras as hvd  # noqa: E402


def main() -> None:
    from sklearn.datasets import load_digits

    hvd.init()
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32), y[order]
    split = int(0.8 * len(x))
    x_train, y_train = x[:split][hvd.rank()::hvd.size()], y[:split][hvd.rank()::hvd.size()]

    keras.utils.set_random_seed(hvd.rank())  # different on purpose: the callback fixes it
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.002 * hvd.size())),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=32, epochs=6, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()])
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
    root = keras.ops.convert_to_numpy(hvd.broadcast(weights, root_rank=0))
    same = bool(np.array_equal(np.asarray(root), weights))
    agree = hvd.allgather_object(same)
    if hvd.rank() == 0:
        logits = keras.ops.convert_to_numpy(model(x[split:], training=False))
        acc = float(np.mean(np.argmax(logits, axis=1) == y[split:]))
        print(f"backend {keras.backend.backend()} ranks {hvd.size()} "
              f"weights identical {all(agree)} test accuracy {acc:.4f}")


if __name__ == "__main__":
    main()
