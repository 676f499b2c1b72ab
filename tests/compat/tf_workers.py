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
