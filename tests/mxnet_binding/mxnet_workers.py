"""Functions run inside real worker processes by the MXNet tests (any np >= 1).

Each takes its expectations from rank()/size() and returns something small.
"""

from __future__ import annotations

import time
import warnings

import numpy as np


def _setup():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import mxnet as mx

    import ronde.mxnet as hvd

    hvd.init()
    return mx, hvd


def collectives() -> str:
    """Every collective on NDArrays, new and in place."""
    mx, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    for dt in ["float32", "float64", "float16", "int32", "int64", "uint8"]:
        x = mx.nd.array(np.arange(7) % 5 + 1 + r, dtype=dt)
        ref = sum(np.arange(7) % 5 + 1 + q for q in range(n))
        got = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dt}")
        assert isinstance(got, mx.nd.NDArray) and got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_allclose(got.asnumpy().astype(np.float64), ref)
        np.testing.assert_array_equal(x.asnumpy(), np.arange(7) % 5 + 1 + r)  # input kept
        y = x.copy()
        assert hvd.allreduce_(y, op=hvd.Max, name=f"max.{dt}") is y
        np.testing.assert_array_equal(y.asnumpy(), np.arange(7) % 5 + n)
    avg = hvd.allreduce(mx.nd.full((2, 3), float(r)), name="avg")
    np.testing.assert_allclose(avg.asnumpy(), np.full((2, 3), (n - 1) / 2))
    pair = [mx.nd.full(3, float(r)), mx.nd.full((2, 2), 2.0 * r)]
    outs = hvd.grouped_allreduce_(pair, op=hvd.Sum, name="group")
    assert outs[0] is pair[0]
    np.testing.assert_allclose(pair[1].asnumpy(), np.full((2, 2), n * (n - 1.0)))
    fused = [mx.nd.full(3, 1.0), mx.nd.full(2, 1.0, dtype="float64"), mx.nd.full(4, 2.0)]
    hvd.fused_allreduce_(fused, "fused", op=hvd.Sum, compression=hvd.Compression.fp16)
    np.testing.assert_allclose(fused[2].asnumpy(), np.full(4, 2.0 * n))
    assert fused[1].dtype == np.float64
    # Compression.fp16 on an NDArray: floats travel as float16, others unchanged
    for dt, wire in (("float32", np.float16), ("float64", np.float16), ("int32", np.int32)):
        sent, ctx = hvd.Compression.fp16.compress(mx.nd.ones(3, dtype=dt))
        assert sent.dtype == wire, (dt, sent.dtype)
        assert hvd.Compression.fp16.decompress(sent, ctx).dtype == np.dtype(dt)
    g = hvd.allgather(mx.nd.full((r + 1, 2), r, dtype="int32"), name="gather")
    np.testing.assert_array_equal(g.asnumpy()[:, 0], np.repeat(np.arange(n), np.arange(1, n + 1)))
    root = n - 1
    b = mx.nd.arange(4) + r
    assert hvd.broadcast_(b, root, name="bcast") is b
    np.testing.assert_array_equal(b.asnumpy(), np.arange(4) + root)
    splits = [1] * n
    splits[0] += 1
    out, recv = hvd.alltoall(mx.nd.arange(n + 1) + 100 * r, splits=splits, name="a2a")
    assert list(recv.asnumpy()) == [splits[r]] * n
    part = hvd.reducescatter(mx.nd.ones((2 * n + 1, 2)), op=hvd.Sum, name="rs")
    assert part.shape == (2 + (r == 0), 2) and float(part[0, 0].asscalar()) == n
    assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
    if r == 0:
        hvd.join()
    else:
        np.testing.assert_allclose(hvd.allreduce(mx.nd.array([3.0]), name="j").asnumpy(),
                                   [3.0 * (n - 1) / n])  # rank 0 adds zeros (Horovod)
        hvd.join()
    # unnamed collectives on a process set (their automatic names once raised IndexError)
    if n < 2:
        return "ok"
    # bad splits: a ValueError and a RuntimeError, as Horovod's MXNet binding raises
    for bad in (lambda: hvd.alltoall(mx.nd.ones(n + 1)),
                lambda: hvd.alltoall(mx.nd.ones(n), splits=mx.nd.ones(n, dtype="int32") * 2)):
        try:
            bad()
            raise AssertionError("no error")
        except RuntimeError as exc:
            assert isinstance(exc, ValueError), exc
    try:
        hvd.alltoall(mx.nd.ones(n), splits=mx.nd.ones(n, dtype="float32"))
        raise AssertionError("no error")
    except ValueError:
        pass
    ps = hvd.add_process_set([0, 1] if n >= 3 else [1])
    if ps.included():
        got = hvd.allreduce(mx.nd.ones(2) * (r + 1), op=hvd.Sum, process_set=ps)
        assert got.asnumpy().tolist() == [float(sum(q + 1 for q in ps.ranks))] * 2
        outs = hvd.grouped_allreduce([mx.nd.ones(1), mx.nd.ones(2)], op=hvd.Sum, process_set=ps)
        assert [o.asnumpy().tolist() for o in outs] == [[len(ps.ranks)], [len(ps.ranks)] * 2]
        g = hvd.grouped_allgather([mx.nd.ones((1, 2))], process_set=ps)
        assert g[0].shape == (len(ps.ranks), 2)
    # an optimizer on a process set: members average, the others step alone (Horovod)
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), process_set=ps)
    w, grad = mx.nd.zeros(2), mx.nd.ones(2) * (r + 1)
    opt.update(0, w, grad, opt.create_state(0, w))
    mean = np.mean([q + 1 for q in ps.ranks]) if ps.included() else r + 1
    np.testing.assert_allclose(w.asnumpy(), [-mean, -mean], rtol=1e-6)
    hvd.remove_process_set(ps)
    return "ok"


def _net(mx, seed: int, extra: bool = False):
    mx.random.seed(seed)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(8, in_units=6, activation="tanh"), mx.gluon.nn.Dense(3, in_units=8))
    if extra:
        net.add(mx.gluon.nn.Dense(3, in_units=3))
    net.initialize(mx.init.Xavier())
    net.cast("float64")
    return net


def equivalence(configs: list[tuple[str, str, str]], steps: int = 5,
                batch: int = 4) -> list[float]:
    """Max |param difference| between np=n on batch b and one process on batch n*b.

    Each config: (optimizer, "trainer" | "optimizer", compression).
    """
    mx, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    out = []
    for ci, (opt, how, comp) in enumerate(configs):
        rng = np.random.default_rng(ci)
        x = rng.normal(size=(steps * n * batch, 6))
        y = rng.integers(0, 3, size=steps * n * batch).astype(np.float64)
        kwargs = {"sgd": {"learning_rate": 0.1, "momentum": 0.9},
                  "adam": {"learning_rate": 0.01}}[opt]
        net = _net(mx, seed=r)
        params = net.collect_params()
        hvd.broadcast_parameters(params, root_rank=0, prefix=f"init.{ci}")
        ref = _net(mx, seed=1000)
        for (_, p), (_, q) in zip(sorted(params.items()), sorted(ref.collect_params().items())):
            q.set_data(p.data().copy())
        ref_trainer = mx.gluon.Trainer(ref.collect_params(), opt, dict(kwargs), kvstore=None)
        compression = getattr(hvd.Compression, comp)
        if how == "trainer":
            trainer = hvd.DistributedTrainer(params, opt, dict(kwargs), compression=compression,
                                             prefix=f"cfg{ci}.")
        else:
            inner = mx.optimizer.create(opt, **kwargs)
            trainer = mx.gluon.Trainer(params, hvd.DistributedOptimizer(
                inner, compression=compression), kvstore=None)
        for s in range(steps):
            lo = s * n * batch
            for model, tr, rows in ((ref, ref_trainer, slice(lo, lo + n * batch)),
                                    (net, trainer, slice(lo + r * batch, lo + (r + 1) * batch))):
                xb, yb = mx.nd.array(x[rows], dtype="float64"), mx.nd.array(y[rows], dtype="float64")
                with mx.autograd.record():
                    loss = loss_fn(model(xb), yb)
                loss.backward()
                tr.step(xb.shape[0])
        out.append(max(float(np.abs(p.data().asnumpy() - q.data().asnumpy()).max())
                       for (_, p), (_, q) in zip(sorted(params.items()),
                                                 sorted(ref.collect_params().items()))))
    return out


def deferred_broadcast() -> float:
    """A parameter whose shape is known only after the first forward is broadcast then."""
    mx, hvd = _setup()
    mx.random.seed(hvd.rank())
    net = mx.gluon.nn.Dense(4)
    net.initialize(mx.init.Normal())
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    net(mx.nd.ones((1, 5)))
    w = net.weight.data()
    spread = hvd.allreduce(w, op=hvd.Max, name="w.max") - hvd.allreduce(w, op=hvd.Min, name="w.min")
    return float(mx.nd.abs(spread).max().asscalar())


def mismatch() -> tuple[str, float]:
    """Rank 1 builds an extra layer: the first step fails on every rank at once."""
    mx, hvd = _setup()
    net = _net(mx, 0, extra=hvd.rank() == 1)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with mx.autograd.record():
        loss = net(mx.nd.ones((2, 6), dtype="float64")).sum()
    loss.backward()
    start = time.monotonic()
    try:
        trainer.step(2)
    except hvd.TensorMismatchError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start
