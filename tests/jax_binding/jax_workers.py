"""Functions run inside real worker processes by the JAX tests (any np >= 1).

Each takes its expectations from rank()/size() and returns something small.
"""

from __future__ import annotations

import time

import numpy as np


def _setup(x64: bool = False):
    import jax

    jax.config.update("jax_enable_x64", x64)
    import ronde.jax as hvd

    hvd.init()
    return jax, hvd


DTYPES = ["float32", "float16", "bfloat16", "int32"]


def collectives() -> str:
    """Every collective on arrays and pytrees, eagerly and inside jax.jit."""
    jax, hvd = _setup()
    jnp = jax.numpy
    r, n = hvd.rank(), hvd.size()
    for dt in DTYPES:
        x = (jnp.arange(7) % 5 + 1 + r).astype(dt)
        ref = sum(np.arange(7) % 5 + 1 + q for q in range(n)).astype(np.float64)
        eager = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dt}")
        jitted = jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum, name=f"jsum.{dt}"))(x)
        for got in (eager, jitted):
            assert isinstance(got, jax.Array) and got.dtype == x.dtype and got.shape == x.shape
            np.testing.assert_allclose(np.asarray(got, np.float64), ref)
        mx = hvd.allreduce(x, op=hvd.Max, name=f"max.{dt}")
        np.testing.assert_allclose(np.asarray(mx, np.float64), np.arange(7) % 5 + n)
        h = hvd.allreduce_async(x, op=hvd.Sum, name=f"async.{dt}")
        np.testing.assert_allclose(np.asarray(hvd.synchronize(h), np.float64), ref)
        assert hvd.poll(h)
    # a pytree: every leaf reduced, structure kept, int leaves too
    tree = {"w": jnp.full((2, 3), float(r)), "b": (jnp.arange(3) + r, jnp.float32(r))}
    for got in (hvd.allreduce(tree, name="tree"),
                jax.jit(lambda t: hvd.allreduce(t, name="jtree"))(tree)):
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(tree)
        np.testing.assert_allclose(got["w"], np.full((2, 3), (n - 1) / 2))
        np.testing.assert_array_equal(got["b"][0], np.arange(3) + (n - 1) // 2)
    # allgather: uneven eagerly, even inside jit
    g = hvd.allgather(jnp.full((r + 1, 2), r, jnp.int32), name="gather.uneven")
    np.testing.assert_array_equal(g[:, 0], np.repeat(np.arange(n), np.arange(1, n + 1)))
    gj = jax.jit(lambda v: hvd.allgather(v, name="gather.jit"))(jnp.full((2, 3), float(r)))
    np.testing.assert_array_equal(gj[:, 0], np.repeat(np.arange(n), 2))
    # broadcast from the last rank, eager and jit
    root = n - 1
    for got in (hvd.broadcast(jnp.arange(4.0) + r, root, name="bcast"),
                jax.jit(lambda v: hvd.broadcast(v, root, name="jbcast"))(jnp.arange(4.0) + r)):
        np.testing.assert_array_equal(got, np.arange(4.0) + root)
    # alltoall: equal blocks (jit) and splits (eager)
    a = jnp.arange(2 * n) + 100 * r
    got = jax.jit(lambda v: hvd.alltoall(v, name="a2a.jit"))(a)
    np.testing.assert_array_equal(got, np.concatenate([[2 * r, 2 * r + 1] + 100 * np.array(q)
                                                       for q in range(n)]))
    splits = [1] * n
    splits[0] += 1
    out, recv = hvd.alltoall(jnp.arange(n + 1) + 100 * r, splits=splits, name="a2a.splits")
    assert list(np.asarray(recv)) == [splits[r]] * n
    # reducescatter: 2n+1 rows, the first rank takes the extra one
    rows = 2 * n + 1
    part = jax.jit(lambda v: hvd.reducescatter(v, op=hvd.Sum, name="rs"))(jnp.ones((rows, 2)))
    assert part.shape == (2 + (r == 0), 2) and float(part[0, 0]) == n
    # inside lax.scan and lax.cond, and a result that one rank does not use
    scan = jax.jit(lambda v: jax.lax.scan(
        lambda c, _: (hvd.allreduce(c, op=hvd.Sum, name="scan"), None), v, None, length=3)[0])
    np.testing.assert_allclose(scan(jnp.ones(2)), np.full(2, float(n) ** 3))
    cond = jax.jit(lambda p, v: jax.lax.cond(p, lambda u: hvd.allreduce(u, name="cond"),
                                             lambda u: u, v))
    np.testing.assert_allclose(cond(True, jnp.full(2, float(r))), np.full(2, (n - 1) / 2))
    unused = jax.jit(lambda v: (hvd.allreduce(v, name="unused"), v + 1)[1 if r else 0])
    np.asarray(unused(jnp.ones(2)))  # the callback runs on every rank: no hang
    # objects, process sets, join
    assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(r) == list(range(n))
    if n >= 2:
        ps = hvd.add_process_set([0, 1])
        if ps.included():
            got = jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum, name="ps", process_set=ps))(
                jnp.full(3, r + 1.0))
            np.testing.assert_allclose(got, np.full(3, 3.0))
            # unnamed, eager and grouped (the automatic names once raised IndexError)
            got = hvd.allreduce(jnp.full(3, r + 1.0), op=hvd.Sum, process_set=ps)
            np.testing.assert_allclose(got, np.full(3, 3.0))
            outs = hvd.grouped_allreduce([jnp.ones(2), jnp.ones(1)], op=hvd.Sum, process_set=ps)
            np.testing.assert_allclose(outs[0], np.full(2, 2.0))
        hvd.remove_process_set(ps)
    if r == 0:
        last = hvd.join()
    else:
        s = hvd.allreduce(jnp.array([3.0]), name="joined")
        np.testing.assert_allclose(s, [3.0 * (n - 1) / n])  # rank 0 adds zeros (Horovod)
        last = hvd.join()
    assert last in (range(1, n) if n > 1 else [0]), last  # a rank that joined after rank 0
    return "ok"


def gradients() -> str:
    """jax.grad through allreduce/allgather/broadcast, eager and jitted."""
    jax, hvd = _setup()
    jnp = jax.numpy
    r, n = hvd.rank(), hvd.size()
    tri = n * (n + 1) / 2
    x = jnp.arange(4.0) + r
    w = float(r + 1)

    def sum_loss(v):
        return (w * hvd.allreduce(v, op=hvd.Sum, name="g.sum")).sum()

    def avg_loss(v):
        return (w * hvd.allreduce({"a": v}, name="g.avg")["a"]).sum()

    def gather_loss(v):
        return (w * hvd.allgather(v, name="g.gather")).sum()

    def bcast_loss(v):
        return (w * hvd.broadcast(v, 0, name="g.bcast")).sum()

    def max_loss(v):
        return hvd.allreduce(v, op=hvd.Max, name="g.max").sum()

    for wrap in (lambda f: f, jax.jit):
        np.testing.assert_allclose(wrap(jax.grad(sum_loss))(x), np.full(4, tri))
        np.testing.assert_allclose(wrap(jax.grad(avg_loss))(x), np.full(4, tri / n))
        np.testing.assert_allclose(wrap(jax.grad(gather_loss))(x), np.full(4, tri))
        np.testing.assert_allclose(wrap(jax.grad(bcast_loss))(x),
                                   np.full(4, tri if r == 0 else 0.0))
        np.testing.assert_allclose(wrap(jax.grad(max_loss))(x),
                                   np.full(4, float(n) if r == n - 1 else 0.0))
    # value_and_grad of a jitted step with the collective in the middle of the model
    def model(v):
        h = jnp.tanh(v * 2.0)
        return jnp.sum(hvd.allreduce(h, name="g.mid") ** 2)

    val, g = jax.jit(jax.value_and_grad(model))(x)
    mean_h = np.mean([np.tanh((np.arange(4.0) + q) * 2.0) for q in range(n)], axis=0)
    np.testing.assert_allclose(val, np.sum(mean_h ** 2), rtol=1e-6)
    # d/dx_r sum_q sum(mean_h^2) = n * 2 mean_h / n * dh_r
    expect = 2 * mean_h * 2.0 * (1 - np.tanh((np.arange(4.0) + r) * 2.0) ** 2)
    np.testing.assert_allclose(g, expect, rtol=1e-5, atol=2e-6)  # float32 tanh
    return "ok"


def _data(seed: int, count: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 6))
    y = rng.integers(0, 3, size=count)
    return x, y


def _init(jax, seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"l1": {"w": jax.random.normal(k1, (6, 8)) * 0.3, "b": jax.numpy.zeros(8)},
            "l2": {"w": jax.random.normal(k2, (8, 3)) * 0.3, "b": jax.numpy.zeros(3)}}


def _loss(jax, params, x, y):
    jnp = jax.numpy
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    logits = h @ params["l2"]["w"] + params["l2"]["b"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def _train_both(jax, hvd, tx, ref_tx, x, y, steps: int, passes: int, batch: int,
                jit: bool) -> tuple:
    """Train ``tx`` on this rank's shard, ``passes`` update calls a step, and ``ref_tx``
    in one process on each step's whole window; (the largest parameter difference,
    ``tx``'s final state)."""
    import optax

    jnp = jax.numpy
    r, n = hvd.rank(), hvd.size()
    grad = jax.grad(lambda p, a, b: _loss(jax, p, a, b))
    ref = _init(jax)
    ref_state = ref_tx.init(ref)
    params = hvd.broadcast_parameters(_init(jax, seed=r), root_rank=0)
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    for s in range(steps):
        window = slice(s * passes * n * batch, (s + 1) * passes * n * batch)
        u, ref_state = ref_tx.update(grad(ref, jnp.asarray(x[window]), jnp.asarray(y[window])),
                                     ref_state, ref)
        ref = optax.apply_updates(ref, u)
        for k in range(passes):
            lo = s * passes * n * batch + (k * n + r) * batch
            g = grad(params, jnp.asarray(x[lo:lo + batch]), jnp.asarray(y[lo:lo + batch]))
            u, state = update(g, state, params)
            params = optax.apply_updates(params, u)
    diff = max(float(jnp.abs(a - b).max()) for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref)))
    return diff, state


def equivalence(configs: list[tuple[str, int, str, bool]], steps: int = 5,
                batch: int = 4) -> list[float]:
    """Max |param difference| between np=n training on batch b and 1 process on n*b.

    Each config: (optimizer, backward_passes_per_step, compression, jit).
    """
    jax, hvd = _setup(x64=True)
    import optax

    import ronde._api as api

    n = hvd.size()
    sent: list[str] = []
    real = api.allreduce_async

    def counting(tensor, *args, **kwargs):  # records the gradient collectives' names
        h = real(tensor, *args, **kwargs)
        sent.append(h.name)
        return h

    api.allreduce_async = counting
    out = []
    for ci, (opt, passes, comp, jit) in enumerate(configs):
        make = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(0.01)}
        compression = getattr(hvd.Compression, comp)
        x, y = _data(ci, steps * passes * n * batch)
        # distributed: this rank's shard, accumulated over `passes` update calls, against
        # one process on the full batch of n*batch per pass, mean over the window
        tx = hvd.DistributedOptimizer(make[opt](), compression=compression,
                                      backward_passes_per_step=passes,
                                      average_aggregated_gradients=True,
                                      name=f"grads.{ci}")
        sent.clear()
        diff, _ = _train_both(jax, hvd, tx, make[opt](), x, y, steps, passes, batch, jit)
        # fusion: one allreduce per step (all leaves are float64)
        assert sent == [f"grads.{ci}.float64"] * steps, sent
        out.append(diff)
    api.allreduce_async = real
    return out


def mismatch() -> tuple[str, float]:
    """Rank 1 builds a model with an extra leaf: init fails on every rank at once."""
    jax, hvd = _setup()
    import optax

    params = _init(jax)
    if hvd.rank() == 1:
        params["extra"] = {"w": jax.numpy.zeros(2)}
    start = time.monotonic()
    try:
        hvd.DistributedOptimizer(optax.sgd(0.1)).init(params)
    except hvd.TensorMismatchError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def sharded(steps: int = 6, batch: int = 4) -> dict:
    """ronde.jax.ShardedOptimizer (sgd with momentum, adam, adamw; eager and under jit;
    two passes accumulated) against one process on the global batch (float64): the
    largest parameter difference, and how many elements of the inner state this rank
    holds (the accumulator left out)."""
    jax, hvd = _setup(x64=True)
    import optax

    n = hvd.size()
    make = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(0.01),
            "adamw": lambda: optax.adamw(0.01, weight_decay=0.1)}
    out = {}
    cases = (("sgd", True, 1, None, 1), ("adam", False, 1, None, 1),
             ("adamw", True, 1, None, 1), ("adam", True, 2, None, 1),
             ("adam", True, 1, hvd.Compression.fp16, 1),
             # stage 2: each pass reduce-scattered, this rank's slice summed
             ("adam", True, 2, None, 2), ("sgd", False, 2, None, 2))
    for ci, (opt, jit, passes, comp, stage) in enumerate(cases):
        x, y = _data(10 + ci, steps * passes * n * batch)
        tx = hvd.ShardedOptimizer(make[opt](), name=f"sharded.{ci}",
                                  backward_passes_per_step=passes,
                                  average_aggregated_gradients=True, compression=comp,
                                  stage=stage)
        diff, state = _train_both(jax, hvd, tx, make[opt](), x, y, steps, passes, batch, jit)
        held = sum(int(np.size(v)) for v in jax.tree_util.tree_leaves(state.inner)
                   if np.ndim(v) > 0)
        acc = sum(int(np.size(v)) for v in jax.tree_util.tree_leaves(state.acc))
        out[f"{opt}{'.jit' if jit else ''}{'.x2' if passes > 1 else ''}"
            f"{'.fp16' if comp is not None else ''}{'.stage2' if stage == 2 else ''}"] = {
            "diff": diff, "held": held, "acc": acc}
    # 100 steps under jit against DistributedOptimizer on the same batches: the losses
    # and the parameters (issue #31: bitwise at np=2, 1e-6 relative otherwise)
    jnp = jax.numpy
    grad_loss = jax.value_and_grad(lambda p, a, b: _loss(jax, p, a, b))
    x, y = _data(77, 100 * batch)
    long = {}
    for opt in ("sgd", "adam", "adamw"):
        ends = {}
        for kind in ("sharded", "distributed"):
            wrap = hvd.ShardedOptimizer if kind == "sharded" else hvd.DistributedOptimizer
            tx = wrap(make[opt](), name=f"long.{kind}.{opt}")
            params = _init(jax, seed=3)
            state, update, losses = tx.init(params), jax.jit(tx.update), []
            for t in range(100):
                lo = t * batch
                value, g = grad_loss(params, jnp.asarray(x[lo:lo + batch] + hvd.rank()),
                                     jnp.asarray(y[lo:lo + batch]))
                u, state = update(g, state, params)
                params = optax.apply_updates(params, u)
                losses.append(float(value))
            ends[kind] = (params, losses)
        (ps, ls), (pd, ld) = ends["sharded"], ends["distributed"]
        long[opt] = {"params": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
                         jax.tree_util.tree_leaves(ps), jax.tree_util.tree_leaves(pd))),
                     "losses": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ls, ld)),
                     "moved": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
                         jax.tree_util.tree_leaves(ps),
                         jax.tree_util.tree_leaves(_init(jax, seed=3))))}
    out["long"] = long
    try:
        hvd.ShardedOptimizer(optax.sgd(0.1), stage=3)
        out["stage3"] = "accepted"
    except ValueError as e:
        out["stage3"] = str(e)
    # fp16 on the wire, gradients whose average fits float16 and whose sum over the ranks
    # does not: the reduce-scatter predivides (it summed in float16 before: inf)
    import jax.numpy as jnp

    tx = hvd.ShardedOptimizer(optax.sgd(1.0), name="sharded.limit",
                              compression=hvd.Compression.fp16)
    params = {"w": jnp.zeros(4 * n, jnp.float32)}
    updates, _ = tx.update({"w": jnp.full(4 * n, 40000.0, jnp.float32)}, tx.init(params),
                           params)
    limit = np.asarray(updates["w"]).tolist()
    hvd.shutdown()
    return {"cases": out, "fp16_limit": limit}


def sharded_checkpoint(directory: str, global_batch: int = 12, steps: int = 3) -> dict:
    """save_sharded at the job's size N after ``steps`` Adam steps; loaded at N=2 (a
    process set of ranks 0 and 1) and into a plain optax.adam (N=1, the export; the same
    state gathered in the job by gather_sharded on the last rank), each
    continuing ``steps`` steps on the same global batches, against the uninterrupted run;
    a plain state's save loaded into a ShardedOptimizer at N. Float64."""
    jax, hvd = _setup(x64=True)
    import optax

    jnp = jax.numpy
    r, n = hvd.rank(), hvd.size()
    x, y = _data(99, 2 * steps * global_batch)
    grad = jax.grad(lambda p, a, b: _loss(jax, p, a, b))

    def run(tx, params, state, rank, size, t0, t1):
        per = global_batch // size
        for t in range(t0, t1):
            lo = t * global_batch + rank * per
            g = grad(params, jnp.asarray(x[lo:lo + per]), jnp.asarray(y[lo:lo + per]))
            u, state = tx.update(g, state, params)
            params = optax.apply_updates(params, u)
        return params, state

    def diff(a, b):
        return max(float(jnp.max(jnp.abs(p - q))) for p, q in
                   zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))

    tx = hvd.ShardedOptimizer(optax.adam(0.01), name="ck")
    params = _init(jax)
    params, state = run(tx, params, tx.init(params), r, n, 0, steps)
    hvd.save_sharded(directory, params, state)
    whole, _ = run(tx, params, state, r, n, steps, 2 * steps)
    out = {}
    two = hvd.add_process_set([0, 1])
    if r < 2:
        tx2 = hvd.ShardedOptimizer(optax.adam(0.01), name="ck2", process_set=two)
        other = _init(jax, seed=5)
        p2, s2 = hvd.load_sharded(directory, other, tx2.init(other), process_set=two)
        out["at_2"] = diff(run(tx2, p2, s2, r, 2, steps, 2 * steps)[0], whole)
    plain = optax.adam(0.01)
    other = _init(jax, seed=6)
    p1, s1 = hvd.load_sharded(directory, other, plain.init(other))
    out["count"] = int(s1[0].count)
    # the in-job export on the last rank: the state the files held, nothing else anywhere
    g = hvd.gather_sharded(params, state, optax.adam(0.01), root=n - 1)
    if r == n - 1:
        out["gathered"] = max(float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))
                              for a, b in zip(jax.tree_util.tree_leaves(g),
                                              jax.tree_util.tree_leaves(s1)))
        out["gathered_tree"] = (jax.tree_util.tree_structure(g)
                                == jax.tree_util.tree_structure(s1))
        out["gathered_count"] = int(g[0].count)
    else:
        out["gathered"] = g
    p1, s1 = run(plain, p1, s1, 0, 1, steps, 2 * steps)
    out["at_1"] = diff(p1, whole)
    # without the moments the continuation differs
    p0 = hvd.load_sharded(directory, other, plain.init(other))[0]
    out["fresh_moments"] = diff(run(plain, p0, plain.init(p0), 0, 1, steps, 2 * steps)[0],
                                whole)
    # a plain state's save (every rank calls it, rank 0 writes) into a sharded one
    hvd.save_sharded(directory + "/plain", p1, s1)
    tx3 = hvd.ShardedOptimizer(optax.adam(0.01), name="ck3")
    p3, s3 = hvd.load_sharded(directory + "/plain", other, tx3.init(other))
    more = run(plain, p1, s1, 0, 1, 0, steps)[0]
    out["plain_to_sharded"] = diff(run(tx3, p3, s3, r, n, 0, steps)[0], more)
    hvd.shutdown()
    return out


def elastic_sharded_state() -> dict:
    """JaxState holding a ShardedOptimizer's state: sync gives every rank rank 0's
    parameters and keeps each rank's own slice of the moments; after a new generation
    (an elastic reset) sync refuses, naming the fix."""
    jax, hvd = _setup(x64=True)
    import optax

    r = hvd.rank()
    tx = hvd.ShardedOptimizer(optax.adam(0.01), name="el")
    params = _init(jax, seed=r)
    opt_state = tx.init(params)
    x, y = _data(3, 8)
    g = jax.grad(lambda p: _loss(jax, p, jax.numpy.asarray(x), jax.numpy.asarray(y)))(params)
    _, opt_state = tx.update(g, opt_state, params)
    mine = np.asarray(opt_state.inner[0][0].mu).copy()
    state = hvd.elastic.JaxState(params=params, opt_state=opt_state, epoch=0)
    state.sync()
    out = {"kept": bool(np.array_equal(np.asarray(state.opt_state.inner[0][0].mu), mine)),
           "differ": len(set(hvd.allgather_object(mine.tobytes()))) > 1,
           "params_from_0": hvd.allgather_object(
               np.asarray(state.params["l1"]["w"]).tobytes()).count(
               np.asarray(state.params["l1"]["w"]).tobytes()) == hvd.size()}
    # a plain object holding it would be broadcast from rank 0 (pickled): refused
    try:
        hvd.elastic.JaxState(pair=(opt_state, "tag"))
        out["plain_holder"] = "accepted"
    except hvd.UnsupportedError as exc:
        out["plain_holder"] = str(exc)
    # a new generation of the same ranks at the same size (a reset with nobody lost):
    # each rank keeps its slices (the resharding case is tests/elastic)
    hvd.shutdown()
    hvd.init()
    state.sync()
    out["kept_after_reset"] = bool(np.array_equal(
        np.asarray(state.opt_state.inner[0][0].mu), mine))
    hvd.shutdown()
    return out


def sharded_recipes(directory: str, steps: int = 30, batch: int = 4) -> dict:
    """Issue #52 items 5 and 6 (JAX), float64, each against one process on the global
    batches, every rank's parameters compared: ``optax.chain(clip_by_global_norm,
    adamw)`` with ronde's clip (``clip``; ``clip_mattered``: the clip changed the run),
    optax's own clip and ``adamw(mask=...)`` by shape refused at ``init``, the mask as
    ``multi_transform`` over two ShardedOptimizers (``labels``); and
    ``broadcast_optimizer_state`` at the start, after steps and after a
    ``load_sharded`` (``broadcast``), each rank's slices left alone."""
    jax, hvd = _setup(x64=True)
    import optax

    jnp = jax.numpy
    r, n = hvd.rank(), hvd.size()
    grad = jax.grad(lambda p, a, b: _loss(jax, p, a, b))
    x, y = _data(31, steps * n * batch)

    def run(tx, params, state, t0, t1, rank=r, size=n):
        update = jax.jit(tx.update)
        per = n * batch // size
        for t in range(t0, t1):
            lo = t * n * batch + rank * per
            g = grad(params, jnp.asarray(x[lo:lo + per]), jnp.asarray(y[lo:lo + per]))
            u, state = update(g, state, params)
            params = optax.apply_updates(params, u)
        return params, state

    def one_process(tx, t1):
        return run(tx, _init(jax), tx.init(_init(jax)), 0, t1, 0, 1)[0]

    def diff(a, b):
        return max(float(jnp.max(jnp.abs(p - q))) for p, q in
                   zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))

    def spread(params):
        mine = [np.asarray(p) for p in jax.tree_util.tree_leaves(params)]
        return max(float(np.max(np.abs(a - b))) for theirs in hvd.allgather_object(mine)
                   for a, b in zip(mine, theirs))

    def refusal(tx):
        try:
            tx.init(_init(jax))
            return "accepted"
        except hvd.UnsupportedError as exc:
            return str(exc)

    out: dict = {}
    clip, adamw = 0.05, lambda: optax.adamw(0.01, weight_decay=0.1)
    tx = hvd.ShardedOptimizer(optax.chain(hvd.clip_by_global_norm(clip), adamw()), name="clip")
    params = run(tx, _init(jax), tx.init(_init(jax)), 0, steps)[0]
    ref = one_process(optax.chain(optax.clip_by_global_norm(clip), adamw()), steps)
    out["clip"], out["clip_spread"] = diff(params, ref), spread(params)
    out["clip_mattered"] = diff(ref, one_process(adamw(), steps))
    by_ndim = lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)  # noqa: E731
    out["optax_clip"] = refusal(hvd.ShardedOptimizer(
        optax.chain(optax.clip_by_global_norm(clip), adamw()), name="optax_clip"))
    out["mask"] = refusal(hvd.ShardedOptimizer(
        optax.adamw(0.01, weight_decay=0.1, mask=by_ndim), name="mask"))
    # the fix the refusal names: the choice outside, one ShardedOptimizer per label
    labels = jax.tree_util.tree_map(lambda x: "decay" if x.ndim > 1 else "plain", _init(jax))
    tx = optax.multi_transform({"decay": hvd.ShardedOptimizer(adamw(), name="decay"),
                                "plain": hvd.ShardedOptimizer(optax.adam(0.01), name="plain")},
                               labels)
    params = run(tx, _init(jax), tx.init(_init(jax)), 0, 10)[0]
    out["labels"] = diff(params, one_process(optax.adamw(0.01, weight_decay=0.1,
                                                         mask=by_ndim), 10))
    out["labels_spread"] = spread(params)
    # broadcast_optimizer_state at the start, after 3 steps, and after a load
    tx = hvd.ShardedOptimizer(optax.adam(0.01), name="bcast")
    params = hvd.broadcast_parameters(_init(jax, seed=r), root_rank=0)
    state = hvd.broadcast_optimizer_state(tx.init(params), root_rank=0)
    params, state = run(tx, params, state, 0, 3)
    state = hvd.broadcast_optimizer_state(state, root_rank=0)
    params, state = run(tx, params, state, 3, 6)
    hvd.save_sharded(directory, params, state)
    other = _init(jax, seed=5)
    tx = hvd.ShardedOptimizer(optax.adam(0.01), name="bcast2")
    params, state = hvd.load_sharded(directory, other, tx.init(other))
    params = hvd.broadcast_parameters(params, root_rank=0)
    state = hvd.broadcast_optimizer_state(state, root_rank=0)
    mine = np.asarray(state.inner[0][0].mu)
    out["slices_differ"] = len(set(hvd.allgather_object(mine.tobytes()))) > 1
    params, state = run(tx, params, state, 6, 9)
    out["broadcast"] = diff(params, one_process(optax.adam(0.01), 9))
    out["broadcast_spread"] = spread(params)
    out["count"] = int(state.inner[0][0].count)
    hvd.shutdown()
    return out
