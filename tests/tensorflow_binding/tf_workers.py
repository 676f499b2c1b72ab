"""Functions run inside real worker processes by the TensorFlow tests (any np >= 1).

Each takes its expectations from rank()/size() and checks many things per call
(importing TensorFlow is the slow part).
"""

from __future__ import annotations

import numpy as np


def _setup():
    import tensorflow as tf

    import ronde.tensorflow as hvd

    hvd.init()
    return tf, hvd


def collectives() -> str:
    """Every collective eagerly and inside tf.function, and their gradients."""
    tf, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    tri = n * (n + 1) / 2

    def body(x):
        return {
            "sum": hvd.allreduce(x, op=hvd.Sum, name="sum"),
            "avg": hvd.allreduce(x),
            "max": hvd.allreduce(x, op=hvd.Max),
            "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
            "fp16": hvd.allreduce(x, compression=hvd.Compression.fp16),
            "group": hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum),
            "gather": hvd.allgather(tf.fill([r + 1, 2], x[0])),
            "bcast": hvd.broadcast(x, root_rank=n - 1),
            "a2a": hvd.alltoall(tf.repeat(x[:1], n)),  # no splits: the output alone
            "a2a.s": hvd.alltoall(tf.repeat(x[:1], n), splits=[1] * n),
            "rs": hvd.reducescatter(tf.ones([2 * n, 3]) * x[0], op=hvd.Sum),
        }

    for mode, fn in (("eager", body), ("graph", tf.function(body))):
        for _ in range(2):  # graph: the second call runs the traced ops again
            x = tf.constant([r + 1.0, 2.0, 3.0])
            out = fn(x)
            np.testing.assert_allclose(out["sum"], [tri, 2 * n, 3 * n], err_msg=mode)
            np.testing.assert_allclose(out["avg"], [tri / n, 2, 3], err_msg=mode)
            np.testing.assert_allclose(out["max"], [n, 2, 3])
            np.testing.assert_allclose(out["scaled"], [tri, 2 * n, 3 * n])
            np.testing.assert_allclose(out["fp16"], [tri / n, 2, 3])
            assert out["fp16"].dtype == tf.float32
            np.testing.assert_allclose(out["group"][1], 2 * out["sum"])
            assert tuple(out["gather"].shape) == (int(tri), 2), out["gather"].shape
            np.testing.assert_allclose(out["bcast"], [n, 2, 3])
            np.testing.assert_allclose(out["a2a"], np.arange(1, n + 1))
            got, splits = out["a2a.s"]
            np.testing.assert_allclose(got, np.arange(1, n + 1))
            assert splits.numpy().tolist() == [1] * n
            np.testing.assert_allclose(out["rs"], np.full((2, 3), tri))
    # gradients (Horovod's rules): allreduce(Sum) -> sum of dy; allgather -> this rank's
    # rows of the average; broadcast -> the average on the root, zeros elsewhere
    v = tf.Variable([1.0, 2.0])

    @tf.function
    def grads():
        with tf.GradientTape(persistent=True) as tape:
            a = tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum) * (r + 1.0))
            g = tf.reduce_sum(hvd.allgather(v) * tf.cast(tf.range(2 * n), tf.float32))
            b = tf.reduce_sum(hvd.broadcast(v, 0) * 3.0)
        return tape.gradient(a, v), tape.gradient(g, v), tape.gradient(b, v)

    ga, gg, gb = grads()
    np.testing.assert_allclose(ga, [tri, tri])
    rows = np.arange(2 * n, dtype=np.float32)
    np.testing.assert_allclose(gg, rows[2 * r: 2 * r + 2])
    np.testing.assert_allclose(gb, [3.0] * 2 if r == 0 else [0, 0])
    # join/barrier in a graph, objects eagerly
    tf.function(lambda: hvd.barrier())()
    assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(r) == list(range(n))
    # IndexedSlices through the tape: allgathered; sparse_as_dense: allreduced
    emb = tf.Variable(tf.ones([6, 2]))
    for dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [r % 6, 5]))
        g = hvd.DistributedGradientTape(tape, sparse_as_dense=dense).gradient(loss, [emb])[0]
        assert isinstance(g, tf.IndexedSlices) != dense
        expect = np.zeros((6, 2), np.float32)
        for q in range(n):
            expect[q % 6] += 1.0 / n
            expect[5] += 1.0 / n
        np.testing.assert_allclose(tf.convert_to_tensor(g), expect, rtol=1e-6)
    # unnamed collectives on a process set, eagerly and in a graph
    if n >= 2:
        ps = hvd.add_process_set([0, 1] if n >= 3 else [1])
        k = len(ps.ranks)
        if ps.included():
            for fn in (lambda v: hvd.allreduce(v, op=hvd.Sum, process_set=ps),
                       tf.function(lambda v: hvd.allreduce(v, op=hvd.Sum, process_set=ps))):
                np.testing.assert_allclose(fn(tf.ones(2)), [k, k])
            g = hvd.grouped_allgather([tf.ones([1, 2])], process_set=ps)
            assert tuple(g[0].shape) == (k, 2)
        hvd.remove_process_set(ps)
    return "ok"


def horovod_tf2_pattern(steps: int = 6, b: int = 8) -> dict:
    """Horovod's TF2 script, unchanged but for the import: == one process on 2b rows."""
    import keras
    tf, hvd = _setup()
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(steps * n * b, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=steps * n * b)

    def build(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                                 keras.layers.Dense(3)])

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # reference: one process, batch n*b, rank 0's initial weights
    ref = build(0)
    ref_opt = keras.optimizers.Adam(0.01)
    for t in range(steps):
        with tf.GradientTape() as tape:
            xb, yb = x[t * n * b:(t + 1) * n * b], y[t * n * b:(t + 1) * n * b]
            loss = loss_fn(yb, ref(xb, training=True))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                    ref.trainable_variables))
    # distributed, as Horovod's tensorflow2 example writes it
    model = build(r)
    opt = keras.optimizers.Adam(0.01)
    opt = hvd.DistributedOptimizer(opt)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(b).shard(n, r)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = model(images, training=True)
            loss_value = loss_fn(labels, probs)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)
        return loss_value

    # rank 0's initial weights everywhere first (a Horovod script broadcasts after the
    # first step, whose update then differs per rank: start equal to compare exactly)
    hvd.broadcast_variables(model.variables, root_rank=0)
    for batch, (images, labels) in enumerate(dataset.take(steps)):
        training_step(images, labels, batch == 0)
    hvd.broadcast_variables(opt.variables, root_rank=0)  # the property works too
    diff = max(float(np.max(np.abs(a - c))) for a, c in zip(model.get_weights(),
                                                             ref.get_weights()))
    return {"diff": diff, "iterations": int(opt.iterations.numpy())}
