"""Horovod's documented TensorFlow behaviour, checked inside real worker processes.

Written from Horovod's documentation and its op semantics, the facts that its
``test/parallel/test_tensorflow.py`` relies on (not from its test code). Each function
takes its expectations from rank()/size() and returns "ok".
"""

from __future__ import annotations

import numpy as np


def _setup():
    import tensorflow as tf

    import ronde.tensorflow as hvd

    hvd.init()
    return tf, hvd


def errors_are_tf_errors() -> str:
    """Eagerly, a failed collective is a tf.errors.FailedPreconditionError (and the ronde
    error); a bad argument a tf.errors.InvalidArgumentError (and a ValueError)."""
    tf, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    try:
        hvd.allreduce(tf.ones([17 + r, 3]))
        raise AssertionError("no error")
    except tf.errors.FailedPreconditionError as exc:
        assert isinstance(exc, hvd.TensorMismatchError) and "shape" in str(exc), exc
    try:
        hvd.alltoall(tf.ones([n - 1 if n > 1 else 3]))  # not divisible by the size
        raise AssertionError("no error")
    except tf.errors.InvalidArgumentError as exc:
        assert isinstance(exc, ValueError), exc
    try:
        hvd.broadcast_global_variables(0)
        raise AssertionError("no error")
    except RuntimeError as exc:
        assert "broadcast_variables" in str(exc), exc
    sl = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]))
    for bad in (lambda: hvd.allreduce(sl, op=hvd.Max),
                lambda: hvd.allreduce(sl, op=hvd.Sum, prescale_factor=0.5),
                lambda: hvd.grouped_allreduce([sl], op=hvd.Adasum)):
        try:
            bad()
            raise AssertionError("no error")
        except NotImplementedError:
            pass
    return "ok"


def ops_and_return_forms() -> str:
    tf, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    # alltoall: the output alone without splits, (output, splits) with them
    out = hvd.alltoall(tf.range(n) + 10 * r)
    assert out.numpy().tolist() == [10 * q + r for q in range(n)], out
    out, got = hvd.alltoall(tf.ones([n, 2]), splits=[1] * n)
    assert got.numpy().tolist() == [1] * n and tuple(out.shape) == (n, 2)
    # ronde's earlier order (op second) still means the op
    assert hvd.reducescatter(tf.ones([2 * n]), hvd.Sum).numpy().tolist() == [float(n)] * 2
    empty = hvd.alltoall(tf.zeros([0, 2]))
    assert tuple(empty.shape) == (0, 2)
    # grouped forms
    gs = hvd.grouped_allgather([tf.fill([r + 1, 2], float(r)), tf.ones([1])])
    assert tuple(gs[0].shape) == (n * (n + 1) // 2, 2) and tuple(gs[1].shape) == (n,)
    rs = hvd.grouped_reducescatter([tf.ones([2 * n, 3]), tf.ones([n])], op=hvd.Sum)
    assert rs[0].numpy().tolist() == [[float(n)] * 3] * 2 and rs[1].numpy().tolist() == [n]
    v = tf.Variable([float(r), 1.0])
    vals = hvd.broadcast_([v], root_rank=n - 1)
    assert v.numpy().tolist() == [n - 1.0, 1.0] and vals[0].numpy().tolist() == [n - 1.0, 1.0]
    assert int(hvd.local_size_op()) == hvd.local_size() and int(hvd.size_op()) == n
    assert int(hvd.process_set_included_op()) == 1
    assert hvd.util._executing_eagerly() and hvd._executing_eagerly()
    # an Average of integer slices is TensorFlow's true division, as in Horovod
    sl = tf.IndexedSlices(tf.constant([[2, 4]], tf.int32), tf.constant([r]))
    avg = hvd.allreduce(sl, op=hvd.Average)
    assert avg.values.dtype == tf.float64, avg.values.dtype
    assert avg.values.numpy().tolist() == [[2 / n, 4 / n]] * n
    return "ok"


def graph_ops_run_in_build_order() -> str:
    """A TF1-style graph with many unnamed collectives, run in one session call: the ops
    may run on any executor thread, but every rank pairs them by build order."""
    tf, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        outs = []
        for i in range(12):  # more blocking ops than executor threads
            x = tf.fill([3 + i], float(r + i))
            outs.append(hvd.allreduce(x, op=hvd.Sum))
            outs.append(hvd.allgather(tf.fill([r + 1, 2], float(i))))
        # compression inside a graph (its overflow check needs a value: skipped there)
        c, ctx = hvd.Compression.fp16.compress(tf.ones([3]))
        outs.append(hvd.Compression.fp16.decompress(c, ctx))
        with tf.compat.v1.Session() as sess:
            got = sess.run(outs)
        assert got[-1].tolist() == [1.0] * 3
    for i in range(12):
        assert got[2 * i].tolist() == [sum(q + i for q in range(n))] * (3 + i)
        assert got[2 * i + 1].shape == (n * (n + 1) // 2, 2)
    # and in a tf.function, traced once, run twice
    f = tf.function(lambda x: [hvd.allreduce(x * k, op=hvd.Sum) for k in range(1, 5)])
    for _ in range(2):
        got = f(tf.constant([float(r)]))
        assert [float(g[0]) for g in got] == [k * n * (n - 1) / 2 for k in range(1, 5)]
    return "ok"


def gradient_rules() -> str:
    """Horovod's rules: allgather and broadcast average the incoming gradient; a
    reducescatter's gradient is the allgather times the size for Sum."""
    tf, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    v = tf.Variable(tf.ones([2 * n, 2]))
    w = tf.Variable(tf.ones([r + 1, 2]))
    with tf.GradientTape(persistent=True) as tape:
        g = tf.reduce_sum(hvd.allgather(w) * 2.0)
        b = tf.reduce_sum(hvd.broadcast(v, 0) * float(r + 1))
        s = tf.reduce_sum(hvd.reducescatter(v, op=hvd.Sum))
        a = tf.reduce_sum(hvd.reducescatter(v, op=hvd.Average))
    np.testing.assert_allclose(tape.gradient(g, w), np.full((r + 1, 2), 2.0))
    want = (n + 1) / 2 if r == 0 else 0.0
    np.testing.assert_allclose(tape.gradient(b, v), np.full((2 * n, 2), want))
    np.testing.assert_allclose(tape.gradient(s, v), np.full((2 * n, 2), float(n)))
    np.testing.assert_allclose(tape.gradient(a, v), np.full((2 * n, 2), 1.0))
    return "ok"


def sync_bn_and_local_layers() -> str:
    """SyncBatchNormalization normalizes with the statistics of the whole global batch
    (ranks with batches of different sizes too); the partial tape and optimizer keep
    the gradients of local layers local, divided by the size."""
    import keras

    tf, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    rows = [np.arange(4 * (q + 1) * 3, dtype=np.float32).reshape(-1, 3) * (q + 1)
            for q in range(n)]  # rank q holds 4(q+1) rows
    full = np.concatenate(rows)
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    out = sync(tf.constant(rows[r]), training=True).numpy()
    mean, var = full.mean(0), full.var(0)
    want = (rows[r] - mean) / np.sqrt(var + sync.epsilon)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sync.moving_mean.numpy(), 0.5 * mean, rtol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), 0.5 + 0.5 * var, rtol=1e-4)
    # in a tf.function, with its gradient: d(sum of outputs * w)/dx is synchronized
    x = tf.Variable(rows[r])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            y = sync(x, training=True)
            loss = tf.reduce_sum(y * tf.constant([1.0, 2.0, 3.0]))
        return tape.gradient(loss, x)

    assert np.isfinite(step().numpy()).all()
    try:
        hvd.SyncBatchNormalization(fused=True)
        raise AssertionError("fused=True accepted")
    except ValueError:
        pass

    # partial tape: 3 dense layers, weights = rank; the first is local
    def model_and_loss():
        init = keras.initializers.Constant(float(r + 1))
        model = keras.Sequential([keras.Input((3,)),
                                  keras.layers.Dense(2, kernel_initializer=init),
                                  keras.layers.Dense(2, kernel_initializer=init)])
        return model
    model = model_and_loss()
    xs = tf.constant(np.ones((2, 3), np.float32))
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(xs) ** 2)
    plain = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
    ptape = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[0])
    local, shared = ptape.get_local_and_global_gradients(loss, model.trainable_weights)
    assert [v for v, _ in local] == model.layers[0].trainable_weights
    for (_, g), p in zip(local, plain[:2]):
        np.testing.assert_allclose(g.numpy(), p / n, rtol=1e-6)
    for i, (_, g) in enumerate(shared, start=2):
        want = hvd.allreduce(tf.constant(plain[i])).numpy()
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-5)
    # keras: the same through the optimizer's apply
    import ronde.tensorflow.keras as hk

    before = [v.numpy().copy() for v in model.trainable_weights]
    opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0),
                                         local_layers=[model.layers[0]])
    opt.apply_gradients(zip([tf.constant(p) for p in plain], model.trainable_weights))
    after = [v.numpy() for v in model.trainable_weights]
    np.testing.assert_allclose(before[0] - after[0], plain[0] / n, rtol=1e-5)
    shared_k = hvd.allreduce(tf.constant(plain[2])).numpy()
    np.testing.assert_allclose(before[2] - after[2], shared_k, rtol=1e-5)
    return "ok"


def keras2_semantics() -> str:
    """Under TF_USE_LEGACY_KERAS=1 (tf.keras = tf_keras), what Horovod's Keras 2 tests rely
    on: SyncBatchNormalization is a tf_keras layer with the global batch's statistics; the
    partial tape takes tf_keras layers; a Keras 2 optimizer with backward_passes_per_step=k
    applies once per k passes (``_compute_gradients`` then ``apply_gradients`` in a
    tf.function), ``_agg_helper.counter`` counts the window and ``iterations`` every pass."""
    import tf_keras

    tf, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    assert tf.keras.layers.Dense is tf_keras.layers.Dense, "tf.keras is not tf_keras"
    # SyncBatchNormalization: ranks hold 2(q+1) rows; the reference sees them all
    rows = [np.arange(2 * (q + 1) * 3, dtype=np.float32).reshape(-1, 3) * (q + 1)
            for q in range(n)]
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    assert isinstance(sync, tf_keras.layers.BatchNormalization), type(sync).__mro__
    out = sync(tf.constant(rows[r]), training=True).numpy()
    ref = tf.keras.layers.BatchNormalization(momentum=0.5, fused=False)
    want = ref(tf.constant(np.concatenate(rows)), training=True).numpy()
    start = sum(len(q) for q in rows[:r])
    np.testing.assert_allclose(out, want[start:start + len(rows[r])], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sync.moving_mean.numpy(), ref.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), ref.moving_variance.numpy(),
                               rtol=1e-4)
    # the partial tape on tf_keras layers: local gradients divided by the size
    init = tf.keras.initializers.Constant(float(r + 1))
    model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,),
                                                       kernel_initializer=init),
                                 tf.keras.layers.Dense(2, kernel_initializer=init)])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(tf.ones([2, 3])) ** 2)
    plain = tape.gradient(loss, model.trainable_weights)
    ptape = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[0])
    local, _ = ptape.get_local_and_global_gradients(loss, model.trainable_weights)
    for (_, g), p in zip(local, plain[:2]):
        np.testing.assert_allclose(g.numpy(), p.numpy() / n, rtol=1e-6)
    # a Keras 2 optimizer aggregating 3 passes: the gradient of x is rank+1 every pass
    import ronde.tensorflow.keras as hk

    for make in (lambda: tf.keras.optimizers.SGD(1.0), lambda: tf.keras.optimizers.legacy.SGD(1.0)):
        for average in (False, True):
            x = tf.Variable([0.0])
            opt = hk.DistributedOptimizer(make(), backward_passes_per_step=3,
                                          average_aggregated_gradients=average)

            @tf.function
            def step():
                pairs = opt._compute_gradients(lambda: x * float(r + 1), var_list=[x])
                opt.apply_gradients(pairs)

            mean = (n + 1) / 2  # the gradient averaged over the ranks
            for k in range(1, 8):
                step()
                applied = (k // 3) * mean * (1 if average else 3)
                np.testing.assert_allclose(x.numpy(), [-applied], rtol=1e-6)
                assert int(opt._agg_helper.counter.numpy()) == k % 3
                assert int(opt.iterations.numpy()) == k
    # IndexedSlices cannot be accumulated unless densified
    emb = tf.Variable(tf.ones([4, 2]))
    opt = hk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    try:
        opt._compute_gradients(lambda: tf.reduce_sum(tf.gather(emb, [r])), var_list=[emb])
        raise AssertionError("IndexedSlices accumulated")
    except ValueError as exc:
        assert "sparse_as_dense=True" in str(exc), exc
    try:
        hk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), op=hk.Adasum)
        raise AssertionError("Adasum accepted")
    except ValueError as exc:
        assert "Average or Sum" in str(exc), exc
    return "ok"

