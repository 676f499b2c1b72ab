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


def float64_fit() -> dict:
    """A float64 model (``floatx`` and the dtype policy float64) with DistributedOptimizer against one process
    on the global batch: ``same``, every rank given the whole global batch (the averaged
    gradient is the one process's, bit for bit, if the reduction keeps float64);
    ``split``, each rank its shard (as in training); ``split_one_process``, the same
    split's average computed in one process without ronde (what the backend's own
    arithmetic gives: Keras 3.15's torch backend multiplies float64 matrices in float32,
    ``keras.src.backend.common.dtypes.result_type``, so a split batch differs there by
    1e-8 whatever averages it)."""
    import keras

    import ronde.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    before = keras.config.floatx(), keras.config.dtype_policy()
    if keras.backend.backend() == "jax":  # JAX holds float64 only with x64 on
        import jax

        jax.config.update("jax_enable_x64", True)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        x, y = _data(n)
        x = x.astype(np.float64)
        y1 = np.eye(C)[y]  # mse on one-hot rows: a float64 loss on every backend
        out: dict = {"backend": keras.backend.backend()}

        def train(distributed: bool, rows: "list[np.ndarray]") -> list[np.ndarray]:
            model = _model(3)
            opt = keras.optimizers.SGD(0.1, momentum=0.5)
            model.compile(hvd.DistributedOptimizer(opt) if distributed else opt, "mse")
            for xb, yb in rows:
                model.train_on_batch(xb, yb)
            return _weights(model)

        glob = [(x[t * n * B:(t + 1) * n * B], y1[t * n * B:(t + 1) * n * B]) for t in range(S)]
        mine = [(xb[r * B:(r + 1) * B], yb[r * B:(r + 1) * B]) for xb, yb in glob]
        one = train(False, glob)
        out["dtype"] = str(one[0].dtype)
        out["same"] = _maxdiff(train(True, glob), one)
        split = train(True, mine)
        out["split"] = _maxdiff(split, one)
        out["ranks_equal"] = _maxdiff(split, hvd.broadcast_object(split, 0))
    finally:
        keras.config.set_floatx(before[0])
        keras.config.set_dtype_policy(before[1])
        if keras.backend.backend() == "jax":
            jax.config.update("jax_enable_x64", False)
    hvd.shutdown()
    return out


def fit_scenarios(path: str) -> dict:
    """One launch per backend (importing the framework is most of a launch's cost):
    :func:`fit_equivalence`, :func:`float64_fit`, :func:`load_model_roundtrip` into
    ``path``, then :func:`sharded_scenarios`, then :func:`adasum_delta` (which shuts
    ronde down), each result under its name."""
    import os

    return {"fit": fit_equivalence(), "float64": float64_fit(),
            "load": load_model_roundtrip(path), "sharded": sharded_scenarios(),
            "sharded_broadcasts": sharded_broadcasts(os.path.join(os.path.dirname(path),
                                                                  "bcast")),
            "adasum": adasum_delta()}


def _sharded_model(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    # 42 + 40 + 18 = 100 elements: padded at N=3 (S=34), even at N=2
    return keras.Sequential([keras.Input((D,)), keras.layers.Dense(7, activation="tanh"),
                             keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(C)])


def sharded_scenarios() -> dict:
    """ronde.keras.ShardedOptimizer on this backend: fit and a custom loop equal to
    DistributedOptimizer (and fit to one process on the global batch) for SGD with
    momentum, Adam and AdamW; accumulation; the state each rank holds; refusals."""
    import keras

    import ronde.keras as hvd
    from ronde import UnsupportedError

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    steps = 6
    x, y = _data(n)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    make = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(0.01),
            "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1)}
    out: dict = {"backend": keras.backend.backend(), "fit": {}, "loop": {}}
    xs, ys = _shard(x, r, n, B), _shard(y, r, n, B)
    for key, opt in make.items():
        runs = {}
        for kind in ("sharded", "distributed"):
            model = _sharded_model(0)
            wrap = hvd.ShardedOptimizer if kind == "sharded" else hvd.DistributedOptimizer
            o = wrap(opt(), name=f"{kind}.{key}")
            model.compile(optimizer=o, loss=loss)
            hist = model.fit(xs, ys, batch_size=B, epochs=1, shuffle=False, verbose=0)
            runs[kind] = (_weights(model), hist.history["loss"], o)
        ref = _sharded_model(0)
        ref.compile(optimizer=opt(), loss=loss)
        ref.fit(x, y, batch_size=n * B, epochs=1, shuffle=False, verbose=0)
        o = runs["sharded"][2]
        state = sum(int(np.prod(v.shape)) for v in o.inner_optimizer.variables
                    if len(v.shape) == 1 and v.shape[0] > 1)
        full = sum(int(np.prod(w.shape)) for w in ref.optimizer.variables if len(w.shape))
        gathered = hvd.allgather_object(runs["sharded"][0])
        out["fit"][key] = {
            "vs_distributed": _maxdiff(runs["sharded"][0], runs["distributed"][0]),
            "vs_one_process": _maxdiff(runs["sharded"][0], _weights(ref)),
            "ranks_equal": max(_maxdiff(g, gathered[0]) for g in gathered),
            "moved": _maxdiff(runs["sharded"][0], _weights(_sharded_model(0))),
            "inner_state": state, "full_state": full, "type": type(o).__name__}
    # 100 steps of fit, each optimizer: the losses and weights of DistributedOptimizer's
    class Losses(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(float(logs["loss"]))

    reps = -(-100 // S)
    x100, y100 = np.tile(xs, (reps, 1))[:100 * B], np.tile(ys, reps)[:100 * B]
    out["long"] = {}
    for key, opt in make.items():
        runs = {}
        for kind in ("sharded", "distributed"):
            model = _sharded_model(1)
            wrap = hvd.ShardedOptimizer if kind == "sharded" else hvd.DistributedOptimizer
            model.compile(optimizer=wrap(opt(), name=f"long.{kind}.{key}"), loss=loss)
            seen = Losses()
            model.fit(x100, y100, batch_size=B, epochs=1, shuffle=False, verbose=0,
                      callbacks=[seen])
            runs[kind] = (_weights(model), seen.seen)
        out["long"][key] = {
            "steps": len(runs["sharded"][1]),
            "weights": _maxdiff(runs["sharded"][0], runs["distributed"][0]),
            "losses": max(abs(a - b) / max(abs(b), 1e-12) for a, b in
                          zip(runs["sharded"][1], runs["distributed"][1])),
            "moved": _maxdiff(runs["sharded"][0], _weights(_sharded_model(1)))}
    # a custom loop with apply_gradients: Adam, the same as DistributedOptimizer
    for kind in ("sharded", "distributed"):
        model = _sharded_model(0)
        wrap = hvd.ShardedOptimizer if kind == "sharded" else hvd.DistributedOptimizer
        o = wrap(keras.optimizers.Adam(0.01), name=f"loop.{kind}")
        out["loop"][kind] = _custom_loop(model, o, xs, ys, steps)
    out["loop"]["diff"] = _maxdiff(out["loop"].pop("sharded"), out["loop"].pop("distributed"))
    # accumulation: 2 passes of B per rank == one batch of 2*n*B in one process; at
    # stage=2 (accepted: the same optimizer in Keras, whose accumulator is sharded at both)
    model = _sharded_model(0)
    acc_opt = hvd.ShardedOptimizer(keras.optimizers.Adam(0.01), name="acc", stage=2,
                                   backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    out["stage"] = acc_opt.stage
    model.compile(optimizer=acc_opt, loss=loss)
    model.fit(xs, ys, batch_size=B, epochs=1, shuffle=False, verbose=0)
    ref = _sharded_model(0)
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    ref.fit(x, y, batch_size=2 * n * B, epochs=1, shuffle=False, verbose=0)
    out["accumulation"] = _maxdiff(_weights(model), _weights(ref))
    # the same model's shards laid out again (what an elastic resize's sync does): fit's
    # train function traced before holds the old shards. TensorFlow's refuses, naming
    # the fix; JAX's traces anew (its caches are cleared: it would reuse a trace of the
    # same shapes); torch's runs eagerly. Traced anew, every backend steps (two passes
    # of B: one update)
    acc_opt.relayout()
    try:
        model.fit(xs[:2 * B], ys[:2 * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
        out["stale_trace"] = "stepped"
    except Exception as exc:  # noqa: BLE001 - the host call may wrap it
        out["stale_trace"] = f"{type(exc).__name__}: {exc}"
    model.train_function = None
    before = _weights(model)
    model.fit(xs[:2 * B], ys[:2 * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    out["retraced_moved"] = _maxdiff(_weights(model), before)
    refused = []
    for bad in (lambda: keras.optimizers.Lamb(0.01),
                lambda: keras.optimizers.Adam(0.01, clipnorm=1.0),
                lambda: keras.optimizers.Adam(0.01, global_clipnorm=1.0)):
        try:
            hvd.ShardedOptimizer(bad())
            refused.append("accepted")
        except UnsupportedError as exc:
            refused.append(str(exc))
    try:
        hvd.ShardedOptimizer(keras.optimizers.Adam(0.01), stage=3)
        refused.append("accepted")
    except ValueError as exc:
        refused.append(str(exc))
    out["refused"] = refused
    # fp16 on the wire, gradients whose average fits float16 and whose sum over the ranks
    # does not (40,000 each): the host reduce-scatter predivides, as every binding's
    # gradients (it summed in float16 before, and gave inf)
    from ronde import _state
    from ronde.frameworks.shard_layout import Span
    from ronde.keras import sharded as host

    out["fp16_limit"] = host._reduce_scatter(
        [np.full(6 * n, 40000.0, np.float32)], Span([0], [6 * n], n), "float32", n,
        "fp16_limit.grads",
        hvd.global_process_set, "float16", 1.0, _state.require().generation).tolist()
    return out


def sharded_broadcasts(directory: str) -> dict:
    """Issue #52 item 1, float64: ``ShardedOptimizer(Adam)`` with
    ``BroadcastGlobalVariablesCallback(0)`` (docs' recipe) in three fits of 2 steps, each
    with its callback (the second and third broadcast a built optimizer: a resumed run),
    ``hvd.broadcast_variables(opt.variables)`` between them, and a ``save_sharded`` /
    ``load_sharded`` into a new model and optimizer before the third: every broadcast
    must leave each rank's slice of the moments alone. Compared with one process on the
    global batches (``vs_one_process``); ``ranks_equal``: the ranks' weights."""
    import keras

    import ronde.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    before = keras.config.floatx(), keras.config.dtype_policy()
    backend = keras.backend.backend()
    if backend == "jax":  # JAX holds float64 only with x64 on
        import jax

        jax.config.update("jax_enable_x64", True)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        x, y = _data(n, seed=11)
        x, y1 = x.astype(np.float64), np.eye(C)[y]  # mse on one-hot rows: float64 everywhere
        xs, ys = _shard(x, r, n, B), _shard(y1, r, n, B)

        def fit(model, t0: int, t1: int, callback: bool = True) -> None:
            model.fit(xs[t0 * B:t1 * B], ys[t0 * B:t1 * B], batch_size=B, epochs=1,
                      shuffle=False, verbose=0,
                      callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
                      if callback else [])

        model = _sharded_model(0)
        opt = hvd.ShardedOptimizer(keras.optimizers.Adam(0.01), name="bcast")
        model.compile(optimizer=opt, loss="mse")
        fit(model, 0, 2)
        hvd.broadcast_variables(opt.variables, root_rank=0)
        fit(model, 2, 4)
        hvd.save_sharded(directory, model, opt)
        model = _sharded_model(5)  # other weights: the load and the callback replace them
        opt = hvd.ShardedOptimizer(keras.optimizers.Adam(0.01), name="bcast2")
        model.compile(optimizer=opt, loss="mse")
        hvd.load_sharded(directory, model, opt)
        hvd.broadcast_variables(opt.variables, root_rank=0)
        fit(model, 4, 6)
        mine = _weights(model)
        ref = _sharded_model(0)
        ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        ref.fit(x, y1, batch_size=n * B, epochs=1, shuffle=False, verbose=0)
        out = {"dtype": str(mine[0].dtype), "vs_one_process": _maxdiff(mine, _weights(ref)),
               "ranks_equal": _maxdiff(mine, hvd.broadcast_object(mine, 0)),
               "iterations": int(np.asarray(opt.iterations)),
               "slots_differ": len(set(hvd.allgather_object(
                   np.asarray(opt.inner_optimizer.variables[-1]).tobytes()))) > 1}
    finally:
        keras.config.set_floatx(before[0])
        keras.config.set_dtype_policy(before[1])
        if backend == "jax":
            jax.config.update("jax_enable_x64", False)
    return out


def _custom_loop(model, opt, xs, ys, steps: int) -> list:
    import keras

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    backend = keras.backend.backend()
    for t in range(steps):
        xb, yb = xs[t * B:(t + 1) * B], ys[t * B:(t + 1) * B]
        if backend == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                value = loss(yb, model(xb))
            grads = tape.gradient(value, model.trainable_variables)
        elif backend == "torch":
            import torch

            model.zero_grad()
            value = loss(torch.as_tensor(yb), model(torch.as_tensor(xb)))
            value.backward()
            grads = [v.value.grad for v in model.trainable_variables]
        else:
            import jax

            tv = [v.value for v in model.trainable_variables]
            ntv = [v.value for v in model.non_trainable_variables]

            def f(tv, ntv):
                pred, _ = model.stateless_call(tv, ntv, xb)
                return loss(yb, pred)

            grads = jax.grad(f)(tv, ntv)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return _weights(model)


def sharded_checkpoint(directory: str, global_batch: int = 12) -> dict:
    """save_sharded at N (the job's size), then load_sharded into a ShardedOptimizer over
    a process set of 2 ranks (another N) and into a plain optimizer in each process (the
    export, N=1); each continues on the same global batches and must end where the
    uninterrupted run does."""
    import keras

    import ronde.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = _data(2, seed=7)  # 2*B*S = 96 rows: 8 steps of 12
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def rows(rank: int, size: int, t0: int, t1: int):
        per = global_batch // size
        idx = np.concatenate([np.arange(t * global_batch + rank * per,
                                        t * global_batch + (rank + 1) * per)
                              for t in range(t0, t1)])
        return x[idx], y[idx], per

    def fit(model, rank, size, t0, t1):
        xs, ys, per = rows(rank, size, t0, t1)
        model.fit(xs, ys, batch_size=per, epochs=1, shuffle=False, verbose=0)

    model = _sharded_model(0)
    opt = hvd.ShardedOptimizer(keras.optimizers.Adam(0.01), name="ck")
    model.compile(optimizer=opt, loss=loss)
    fit(model, r, n, 0, 4)
    hvd.save_sharded(directory, model, opt)
    fit(model, r, n, 4, 8)
    whole = _weights(model)
    out: dict = {"files": sorted(f for f in __import__("os").listdir(directory))}
    # the uninterrupted run at N equals one process on the global batches, and each
    # rank holds ceil(100 / N) elements of each moment
    ref = _sharded_model(0)
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    fit(ref, 0, 1, 0, 8)
    out["vs_one_process"] = _maxdiff(whole, _weights(ref))
    out["moment_elements"] = sorted({int(np.prod(v.shape)) for v in
                                     opt.inner_optimizer.variables if len(v.shape)})
    # the in-job export on the last rank: a plain Adam holding what one process's holds
    plain = hvd.gather_sharded(opt, root=n - 1)
    if r == n - 1:
        out["gathered"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                              for a, b in zip(plain.variables, ref.optimizer.variables))
        out["gathered_kind"] = (type(plain).__name__, int(np.asarray(plain.iterations)),
                                len(plain.variables) == len(ref.optimizer.variables))
    else:
        out["gathered"] = plain
    two = hvd.add_process_set([0, 1])
    if r < 2:
        model = _sharded_model(5)  # other weights: the load must replace them
        opt = hvd.ShardedOptimizer(keras.optimizers.Adam(0.01), name="ck2", process_set=two)
        model.compile(optimizer=opt, loss=loss)
        hvd.load_sharded(directory, model, opt)
        fit(model, r, 2, 4, 8)
        out["at_2"] = _maxdiff(_weights(model), whole)
    model = _sharded_model(9)
    plain = keras.optimizers.Adam(0.01)
    model.compile(optimizer=plain, loss=loss)
    hvd.load_sharded(directory, model, plain)
    out["iterations"] = int(np.asarray(plain.iterations))
    fit(model, 0, 1, 4, 8)
    out["at_1"] = _maxdiff(_weights(model), whole)
    # and a plain optimizer's save (every rank calls it, rank 0 writes) loads into a
    # ShardedOptimizer at N
    hvd.save_sharded(directory + "/plain", model, plain)
    model2 = _sharded_model(3)
    opt = hvd.ShardedOptimizer(keras.optimizers.Adam(0.01), name="ck3")
    model2.compile(optimizer=opt, loss=loss)
    hvd.load_sharded(directory + "/plain", model2, opt)
    fit(model2, r, n, 4, 8)
    fit(model, 0, 1, 4, 8)
    out["plain_to_sharded"] = _maxdiff(_weights(model2), _weights(model))
    # KerasState.sync: the model from rank 0, each rank's slots its own (rank 0's would
    # replace them: every rank then trains on rank 0's slice of the moments)
    state = hvd.elastic.KerasState(model2, epoch=0)
    slots = [np.asarray(v) for v in opt.inner_optimizer.variables if len(v.shape)]
    state.sync()
    out["slots_kept"] = all(np.array_equal(a, np.asarray(v)) for a, v in zip(
        slots, [v for v in opt.inner_optimizer.variables if len(v.shape)]))
    out["slots_differ"] = len(set(hvd.allgather_object(slots[0].tobytes()))) > 1
    # a new generation of the job (what an elastic reset makes): the shards refuse
    hvd.shutdown()
    hvd.init()
    try:
        fit(model2, r, n, 4, 5)
        out["after_reset"] = "stepped"
    except Exception as exc:  # noqa: BLE001 - the host call may wrap it
        out["after_reset"] = f"{type(exc).__name__}: {exc}"
    try:  # the same ranks at the same size: each keeps its slices, and goes on (after
        # restore(), as the elastic loop does: JAX's fit left the variables emptied)
        state.restore()
        state.sync()
        out["sync_after_reset"] = "synced"
        fit(model2, r, n, 0, 1)
        fit(model, 0, 1, 0, 1)
        out["after_sync"] = _maxdiff(_weights(model2), _weights(model))
    except Exception as exc:  # noqa: BLE001
        out["sync_after_reset"] = f"{type(exc).__name__}: {exc}"
    # the shards laid out again (what a resize's sync does): the optimizer's own step
    # count and learning rate stay among its variables, and a learning rate set after
    # reaches the steps (sharded_scenarios: a stale trace)
    opt.relayout()
    state._save_model()  # (as sync does after it)
    out["own_kept"] = [any(v is w for w in opt.variables)
                       for v in (opt.iterations, opt._learning_rate)]
    fit(model2, r, n, 0, 1)  # (JAX: its caches were cleared, the old function retraces)
    before = _weights(model2)
    opt.learning_rate = 0.0
    fit(model2, r, n, 1, 2)
    out["moved_at_lr_0"] = _maxdiff(_weights(model2), before)
    return out
