"""Functions run inside real worker processes by the Keras tests (np=2; any backend).

The backend comes from KERAS_BACKEND in the worker environment. Each function
checks several things (importing a framework is the slow part) and returns
something small.
"""

from __future__ import annotations

import numpy as np

B, S, D, C = 8, 6, 5, 3  # batch per rank, steps, features, classes


def _data(size: int, seed: int = 42) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(size * B * S, D)).astype(np.float32)
    y = rng.integers(0, C, size=size * B * S)
    return x, y


def _shard(a: np.ndarray, rank: int, size: int, b: int) -> np.ndarray:
    """Rows of this rank: at step t, global batch t's block ``rank`` of b rows."""
    steps = len(a) // (size * b)
    return np.concatenate([a[(t * size + rank) * b:(t * size + rank + 1) * b]
                           for t in range(steps)])


def _model(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((D,)), keras.layers.Dense(7, activation="tanh"),
                             keras.layers.Dense(C)])


def _weights(model) -> list[np.ndarray]:
    return [np.asarray(w) for w in model.get_weights()]


def _maxdiff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def fit_equivalence() -> dict:
    """fit with DistributedOptimizer == one process on the full batch; callbacks."""
    import keras

    import ronde.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = _data(n)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out: dict = {"backend": keras.backend.backend()}

    class Record(keras.callbacks.Callback):
        def __init__(self, key):
            super().__init__()
            self.key, self.seen, self.lrs = key, [], []

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append(float(logs[self.key]))

        def on_train_batch_begin(self, batch, logs=None):
            self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    for passes in (1, 2):
        # reference: one process, batch n*B*passes, starting from rank 0's weights
        ref = _model(0)
        ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss=loss)
        ref.fit(x, y, batch_size=n * B * passes, epochs=2, shuffle=False, verbose=0)
        # distributed: rank-dependent init; the callback broadcasts rank 0's
        model = _model(r)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                       backward_passes_per_step=passes,
                                       average_aggregated_gradients=True)
        model.compile(optimizer=opt, loss=loss)
        before, after = Record("loss"), Record("loss")
        model.fit(_shard(x, r, n, B), _shard(y, r, n, B), batch_size=B, epochs=2,
                  shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), before,
                             hvd.callbacks.MetricAverageCallback(), after])
        out[f"diff{passes}"] = _maxdiff(_weights(model), _weights(ref))
        locals_ = hvd.allgather_object(before.seen)
        out[f"metric{passes}"] = max(abs(a - float(np.mean([s[i] for s in locals_])))
                                     for i, a in enumerate(after.seen))
        assert type(model.optimizer).__name__ == "SGD", type(model.optimizer)
        assert isinstance(opt.variables, list) and opt.variables() == opt.variables
    # warmup: Horovod's curve, per batch
    model = _model(0)
    # jit_compile=True: JAX runs the host call under XLA; on TF the callback turns XLA off
    jit = keras.backend.backend() != "torch"
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss,
                  jit_compile=jit)
    rec = Record("loss")
    model.fit(_shard(x, r, n, B), _shard(y, r, n, B), batch_size=B, epochs=3, shuffle=False,
              verbose=0, callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.4, 2), rec])
    expect = []
    for epoch in range(3):
        for b in range(S):
            e = epoch + b / S + 1.0 / S
            expect.append(0.4 / n * (e * (n - 1) / 2 + 1) if epoch < 2 else expect[-1])
    out["warmup"] = _maxdiff([np.asarray(rec.lrs)], [np.asarray(expect)])
    return out


def load_model_roundtrip(path: str) -> str:
    """A saved model comes back with a DistributedOptimizer and its state."""
    import keras

    import ronde.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = _data(n)
    model = _model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(_shard(x, r, n, B), _shard(y, r, n, B), batch_size=B, epochs=1, verbose=0,
              shuffle=False)
    if r == 0:
        model.save(path)
    hvd.barrier()
    loaded = hvd.load_model(path)
    assert hvd.is_distributed(loaded.optimizer), type(loaded.optimizer)
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == S
    loaded.fit(_shard(x, r, n, B), _shard(y, r, n, B), batch_size=B, epochs=1, verbose=0,
               shuffle=False)
    w = hvd.allgather_object(_weights(loaded))
    assert _maxdiff(w[0], w[-1]) == 0.0
    return "ok"


def adasum_delta() -> dict:
    """DistributedOptimizer(op=Adasum): one apply() against the numpy reference tree of
    the ranks' deltas; then model.fit leaves equal weights on every rank."""
    import keras

    import ronde.keras as hvd
    from ronde.collectives import adasum

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    lr = 0.1
    grads = [np.arange(1.0, 5.0) * (k + 1) + k * np.array([1.0, -1.0, 1.0, -1.0])
             for k in range(n)]
    start = np.full(4, 0.5)
    v = keras.Variable(start.astype(np.float32), name="w")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), op=hvd.Adasum)
    opt.apply([keras.ops.convert_to_tensor(grads[r].astype(np.float32))], [v])
    want = start + adasum.tree([-lr * g for g in grads])
    out = {"backend": keras.backend.backend(),
           "apply_err": float(np.max(np.abs(keras.ops.convert_to_numpy(v.value) - want)))}
    x, y = _data(n)
    model = _model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), op=hvd.Adasum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(_shard(x, r, n, B), _shard(y, r, n, B), batch_size=B, epochs=1, verbose=0,
              shuffle=False, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    mine = _weights(model)
    theirs = hvd.allgather_object(mine)
    out["fit_spread"] = max(_maxdiff(mine, t) for t in theirs)
    out["moved"] = _maxdiff(mine, _weights(_model(0)))
    hvd.shutdown()
    return out


def fit_scenarios(path: str) -> dict:
    """One launch per backend (importing the framework is most of a launch's cost):
    :func:`fit_equivalence`, :func:`load_model_roundtrip` into ``path``, then
    :func:`adasum_delta` (which shuts ronde down), each result under its name."""
    return {"fit": fit_equivalence(), "load": load_model_roundtrip(path),
            "adasum": adasum_delta()}
