"""Functions run inside real worker processes by the torch tests (any np >= 1).

Each takes its expectations from rank()/size() and returns something small.
"""

from __future__ import annotations

import time

import numpy as np


def _setup():
    import torch

    import ronde.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    return torch, hvd


DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]


def collectives() -> str:
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    tri = n * (n + 1) / 2
    for name in DTYPES:
        dt = getattr(torch, name)
        x = (torch.arange(7) % 5 + 1 + r).to(dt)
        ref = sum((torch.arange(7) % 5 + 1 + q).double() for q in range(n))
        got = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{name}")
        assert got.dtype == dt and got.shape == x.shape, (got.dtype, got.shape)
        torch.testing.assert_close(got.double(), ref)
        assert torch.equal(x, (torch.arange(7) % 5 + 1 + r).to(dt))  # input untouched
        mx = hvd.allreduce(x, op=hvd.Max, name=f"max.{name}")
        torch.testing.assert_close(mx.double(), (torch.arange(7) % 5 + n).double())
        # in place: the same tensor object and storage, filled by the engine
        y = x.clone()
        ptr = y.data_ptr()
        out = hvd.allreduce_(y, op=hvd.Sum, name=f"sum_.{name}")
        assert out is y and y.data_ptr() == ptr
        torch.testing.assert_close(y.double(), ref)
        h = hvd.allreduce_async(x, op=hvd.Sum, name=f"async.{name}")
        torch.testing.assert_close(hvd.synchronize(h).double(), ref)
        assert hvd.poll(h)
        g = hvd.allgather(torch.full((r + 1, 2), r).to(dt), name=f"gather.{name}")
        assert g.dtype == dt and g.shape == (n * (n + 1) // 2, 2)
        b = hvd.broadcast(torch.full((3,), r + 1).to(dt), root_rank=n - 1, name=f"bc.{name}")
        assert b.dtype == dt and bool((b.double() == n).all())
    # zero copy: the engine reads the tensor's own memory (numpy view shares storage)
    from ronde.torch._tensors import numpy_view

    t = torch.ones(5)
    assert numpy_view(t).__array_interface__["data"][0] == t.data_ptr()
    bf = torch.ones(5, dtype=torch.bfloat16)
    assert numpy_view(bf).__array_interface__["data"][0] == bf.data_ptr()
    # default op is Average; average= spelling; scale factors
    torch.testing.assert_close(hvd.allreduce(torch.full((2,), float(r))),
                               torch.full((2,), (n - 1) / 2))
    torch.testing.assert_close(hvd.allreduce(torch.ones(2), average=False), torch.full((2,), 1.0 * n))
    torch.testing.assert_close(hvd.allreduce(torch.ones(2), op=hvd.Sum, prescale_factor=2.0,
                                             postscale_factor=0.5), torch.full((2,), 1.0 * n))
    # 0-d, non-contiguous in place, requires_grad leaf in place
    assert float(hvd.allreduce(torch.tensor(r + 1.0), op=hvd.Sum)) == tri
    base = torch.arange(12.0).view(3, 4)
    view = base[:, ::2]
    hvd.allreduce_(view, op=hvd.Sum, name="noncontig")
    torch.testing.assert_close(base[:, ::2], torch.arange(12.0).view(3, 4)[:, ::2] * n)
    torch.testing.assert_close(base[:, 1::2], torch.arange(12.0).view(3, 4)[:, 1::2])
    leaf = torch.ones(3, requires_grad=True)
    hvd.broadcast_(leaf, 0, name="leaf")
    # grouped (in place and not), async in place
    outs = hvd.grouped_allreduce([torch.ones(2) * r, torch.ones(3, 3) * r], op=hvd.Sum)
    torch.testing.assert_close(outs[1], torch.full((3, 3), n * (n - 1) / 2))
    ts = [torch.ones(2) * r, torch.ones(4) * r]
    assert hvd.grouped_allreduce_(ts, op=hvd.Sum, name="grp_") [0] is ts[0]
    torch.testing.assert_close(ts[1], torch.full((4,), n * (n - 1) / 2))
    z = torch.full((4,), float(r))
    hz = hvd.allreduce_async_(z, op=hvd.Sum, name="az")
    assert hvd.synchronize(hz) is z and float(z[0]) == n * (n - 1) / 2
    # broadcast_ in place, async forms
    bt = torch.full((4,), float(r))
    assert hvd.broadcast_(bt, 0) is bt and bool((bt == 0).all())
    hb = hvd.broadcast_async(torch.full((2,), float(r)), n - 1)
    assert bool((hvd.synchronize(hb) == n - 1).all())
    hg = hvd.allgather_async(torch.full((1, 2), float(r)))
    assert hvd.synchronize(hg).shape == (n, 2)
    # alltoall equal and explicit splits
    a = hvd.alltoall(torch.arange(2 * n) + 100 * r)
    torch.testing.assert_close(a, torch.cat([torch.arange(2 * r, 2 * r + 2) + 100 * j
                                             for j in range(n)]))
    splits = [(r + j) % 3 for j in range(n)]
    data = torch.cat([torch.full((s,), 10 * r + j, dtype=torch.int32)
                      for j, s in enumerate(splits)])
    out, rs = hvd.alltoall(data, splits=torch.tensor(splits))
    assert rs.tolist() == [(j + r) % 3 for j in range(n)]
    # reducescatter (Horovod's torch argument order: tensor, name, compression, op)
    rows = 2 * n + 1
    part = hvd.reducescatter(torch.ones(rows, 2) * (r + 1), op=hvd.Sum)
    assert part.shape[0] == rows // n + (1 if r < rows % n else 0)
    torch.testing.assert_close(part, torch.full_like(part, tri))
    part = hvd.synchronize(hvd.reducescatter_async(torch.ones(n, 2) * r))
    torch.testing.assert_close(part, torch.full((1, 2), (n - 1) / 2))
    # compression
    for comp in (hvd.Compression.fp16, hvd.Compression.bf16):
        c = hvd.allreduce(torch.full((5,), 1.5 + r, dtype=torch.float64), compression=comp)
        assert c.dtype == torch.float64
        torch.testing.assert_close(c, torch.full((5,), 1.5 + (n - 1) / 2, dtype=torch.float64))
    big = hvd.allreduce(torch.full((3,), 60000.0), compression=hvd.Compression.fp16,
                        name="fp16.big")  # the average fits: pre-divided, no overflow
    torch.testing.assert_close(big, torch.full((3,), 60000.0), rtol=1e-3, atol=0)
    # sparse allreduce: coalesced sum, Average divides by size
    i = torch.tensor([[r, 0]])
    sp = torch.sparse_coo_tensor(i, torch.ones(2, 3), (n + 1, 3), check_invariants=True)
    expect = torch.zeros(n + 1, 3)
    for q in range(n):
        expect[q] += 1
        expect[0] += 1
    got = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="sparse", op=hvd.Sum))
    assert got.is_sparse and torch.equal(got.to_dense(), expect)
    got = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="sparse.avg"))
    torch.testing.assert_close(got.to_dense(), expect / n)
    # objects carry tensors
    assert torch.equal(hvd.broadcast_object({"t": torch.ones(2) * r}, 0)["t"], torch.zeros(2))
    assert [int(t) for t in hvd.allgather_object(torch.tensor(r))] == list(range(n))
    # unsupported dtype: clear TypeError before anything is sent
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.bool))
    except TypeError as exc:
        assert "bool" in str(exc)
    else:
        raise AssertionError("bool allreduce accepted")
    hvd.shutdown()
    return "ok"


def gradients() -> str:
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    d = torch.float64
    tri = n * (n + 1) / 2
    w = torch.full((4,), r + 1.0, dtype=d)
    for op, pre, post, factor in [(hvd.Sum, 1.0, 1.0, tri), (hvd.Average, 1.0, 1.0, tri / n),
                                  (hvd.Sum, 2.0, 3.0, 6 * tri)]:
        x = (torch.arange(4, dtype=d) + r).requires_grad_()
        y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post, name="ar")
        (y * w).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((4,), factor, dtype=d))
    # Max: the gradient goes to the rank(s) holding the maximum
    x = torch.tensor([float(r), -float(r), 5.0], dtype=d, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Max) * (r + 1)).sum().backward()
    expect = [tri if r == n - 1 else 0.0, tri if r == 0 else 0.0, tri]
    torch.testing.assert_close(x.grad, torch.tensor(expect, dtype=d))
    # fp16 compression is differentiable (casts are)
    x = torch.ones(3, dtype=d, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16) * (r + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), tri, dtype=d))
    # allgather: the gradient averaged over ranks (Horovod's rule), this rank's rows
    total = n * (n + 1) // 2
    x = torch.ones(r + 1, 2, dtype=d, requires_grad=True)
    y = hvd.allgather(x, name="ag")
    W = torch.arange(total * 2, dtype=d).view(total, 2)
    (y * W * (r + 1)).sum().backward()
    start = r * (r + 1) // 2
    torch.testing.assert_close(x.grad, W[start:start + r + 1] * tri / n)
    # broadcast: the averaged gradient on the root, zeros elsewhere (Horovod's rule)
    root = n - 1
    x = torch.full((3,), float(r), dtype=d, requires_grad=True)
    (hvd.broadcast(x, root, name="bc") * (r + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), tri / n if r == root else 0.0,
                                                  dtype=d))
    # alltoall: block j went to rank j, whose loss weight is j+1
    x = torch.ones(2 * n, dtype=d, requires_grad=True)
    (hvd.alltoall(x) * (r + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(1, n + 1, dtype=d).repeat_interleave(2))
    # reducescatter (Horovod's rule): rows of rank q's block get weight q+1, times the set
    # size for Sum; for Average not divided by n
    rows = 2 * n + 1
    base, extra = divmod(rows, n)
    owner = torch.cat([torch.full((base + (1 if q < extra else 0),), q + 1.0, dtype=d)
                       for q in range(n)])
    for op, scale in [(hvd.Sum, float(n)), (hvd.Average, 1.0)]:
        x = torch.ones(rows, 2, dtype=d, requires_grad=True)
        (hvd.reducescatter(x, op=op) * (r + 1)).sum().backward()
        torch.testing.assert_close(x.grad, owner[:, None].expand(rows, 2) * scale)
    # grouped allreduce
    a = torch.ones(2, dtype=d, requires_grad=True)
    b = torch.ones(3, dtype=d, requires_grad=True)
    ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="grp")
    ((ya + 0).sum() * (r + 1) + yb.sum() * 2).backward()
    torch.testing.assert_close(a.grad, torch.full((2,), tri, dtype=d))
    torch.testing.assert_close(b.grad, torch.full((3,), 2.0 * n, dtype=d))
    # numerically: d/dx of sum(w * allreduce_avg(x)) by central differences, every
    # rank perturbing its own element j in lockstep (the change then comes from all ranks)
    x0 = torch.arange(3, dtype=d) + r
    x = x0.clone().requires_grad_()
    (hvd.allreduce(x, name="num") * w[:3]).sum().backward()
    eps = 1e-6
    for j in range(3):
        e = torch.zeros(3, dtype=d)
        e[j] = eps
        fp = float((hvd.allreduce(x0 + e, name="num+") * w[:3]).sum())
        fm = float((hvd.allreduce(x0 - e, name="num-") * w[:3]).sum())
        lockstep = hvd.allreduce(torch.tensor((fp - fm) / (2 * eps), dtype=d), op=hvd.Sum)
        # the lockstep derivative sums all ranks' own derivatives (n of them)
        torch.testing.assert_close(hvd.allreduce(x.grad[j], op=hvd.Sum), lockstep)
    hvd.shutdown()
    return "ok"


# -- DistributedOptimizer equivalence -----------------------------------------------------
def _model(torch, seed: int, norm: str | None = None, extra: bool = False):
    nn = torch.nn
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 8)]
    if norm is not None:
        import ronde.torch as hvd

        layers.append(hvd.SyncBatchNorm(8) if norm == "sync" else nn.BatchNorm1d(8))
    layers += [nn.Tanh(), nn.Linear(8, 3)]
    model = nn.Sequential(*layers)
    if extra:
        model.add_module("extra", nn.Linear(3, 3))
    # the weights from a generator of their own: with threads as ranks (run_threads) the
    # global one is shared, and two ranks building models at once would interleave its
    # draws (each rank's two "equal" models came out different, 1 run in ~10)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.4, 0.4, generator=gen)
    return model.double()


def _optimizer(torch, name: str, params, lr: float = 0.05):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr * 0.2)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr * 0.2, weight_decay=0.1)
    raise ValueError(name)


def equivalence(configs: list, steps: int = 4, batch: int = 8, device: str = "cpu") -> list:
    """Train distributed and a one-process reference on the full batch; return max diffs."""
    torch, hvd = _setup()
    dev = _pin(torch, hvd, device)
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    results = []
    for cfg_i, (opt_name, bpps, comp, norm) in enumerate(configs):
        model = _model(torch, 7, "sync" if norm else None).to(dev)
        ref = _model(torch, 7, "plain" if norm else None).to(dev)
        ref.load_state_dict(model.state_dict())
        compression = getattr(hvd.Compression, comp)
        opt = hvd.DistributedOptimizer(
            _optimizer(torch, opt_name, model.parameters()), backward_passes_per_step=bpps,
            named_parameters=[(f"c{cfg_i}.{k}", v) for k, v in model.named_parameters()],
            compression=compression)
        ref_opt = _optimizer(torch, opt_name, ref.parameters())
        gen = torch.Generator().manual_seed(11)
        for _ in range(steps):
            x = torch.randn(n * batch, 6, generator=gen, dtype=torch.float64).to(dev)
            y = torch.randn(n * batch, 3, generator=gen, dtype=torch.float64).to(dev)
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            mine_x, mine_y = x[r * batch:(r + 1) * batch], y[r * batch:(r + 1) * batch]
            opt.zero_grad()
            for xs, ys in zip(mine_x.chunk(bpps), mine_y.chunk(bpps)):
                (F.mse_loss(model(xs), ys) / bpps).backward()
            opt.step()
        diff = max(float((a - b).abs().max()) for a, b in
                   zip(model.state_dict().values(), ref.state_dict().values())
                   if a.dtype.is_floating_point)
        results.append(diff)
    hvd.shutdown()
    return results


def syncbn_uneven() -> float:
    """SyncBatchNorm with a different batch size per rank vs BatchNorm on the union."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    sizes = [3 + q for q in range(n)]
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(sum(sizes), 4, 5, generator=gen, dtype=torch.float64) * 3 + 1
    coef = torch.randn(sum(sizes), 4, 5, generator=gen, dtype=torch.float64)
    start = sum(sizes[:r])
    mine = full[start:start + sizes[r]].clone().requires_grad_()
    sync = hvd.SyncBatchNorm(4, momentum=0.3).double()
    plain = torch.nn.BatchNorm1d(4, momentum=0.3).double()
    with torch.no_grad():
        sync.weight.copy_(torch.linspace(0.5, 2, 4))
        sync.bias.copy_(torch.linspace(-1, 1, 4))
    plain.load_state_dict(sync.state_dict())
    ref_in = full.clone().requires_grad_()
    out_ref = plain(ref_in)
    (out_ref * coef).sum().backward()
    out = sync(mine)
    (out * coef[start:start + sizes[r]]).sum().backward()
    diffs = [
        float((out - out_ref[start:start + sizes[r]]).detach().abs().max()),
        float((mine.grad - ref_in.grad[start:start + sizes[r]]).abs().max()),
        float((sync.running_mean - plain.running_mean).abs().max()),
        float((sync.running_var - plain.running_var).abs().max()),
        float((hvd.allreduce(sync.weight.grad, op=hvd.Sum) - plain.weight.grad).abs().max()),
        float((hvd.allreduce(sync.bias.grad, op=hvd.Sum) - plain.bias.grad).abs().max()),
    ]
    # eval mode is local BatchNorm with the (synchronized) running statistics
    sync.eval()
    plain.eval()
    diffs.append(float((sync(mine.detach()) - plain(mine.detach())).abs().max()))
    # empty batch on one rank still works
    x = torch.randn(0 if r == 0 else 4, 4, dtype=torch.float64)
    sync.train()
    sync(x)
    hvd.shutdown()
    return max(diffs)


# -- state broadcast ----------------------------------------------------------------------
def _state_signature(torch, opt) -> list:
    sd = opt.state_dict()
    out = [sorted((k, v) for k, v in g.items() if k != "params") for g in sd["param_groups"]]
    for idx in sorted(sd["state"]):
        for k, v in sorted(sd["state"][idx].items()):
            out.append((idx, k, v.tolist() if isinstance(v, torch.Tensor) else v))
    return out


def broadcast_state() -> str:
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    for opt_name in ("sgd", "adam", "adamw"):
        for when in ("before", "after"):
            for wrap in (False, True):
                model = _model(torch, 100 + r)  # different weights per rank
                opt = _optimizer(torch, opt_name, model.parameters(), lr=0.05 * (r + 1))
                if when == "after":  # a local step on rank-specific data: states differ
                    x = torch.randn(4, 6, dtype=torch.float64) + r
                    F.mse_loss(model(x), torch.zeros(4, 3, dtype=torch.float64)).backward()
                    opt.step()
                    opt.zero_grad()
                if wrap:
                    opt = hvd.DistributedOptimizer(
                        opt, named_parameters=[(f"{opt_name}.{when}.{k}", v)
                                               for k, v in model.named_parameters()])
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                hvd.broadcast_optimizer_state(opt, root_rank=0)
                sig = _state_signature(torch, opt)
                assert hvd.allgather_object(sig) == [sig] * n, (opt_name, when, wrap)
                if when == "before":
                    # Horovod's zero-gradient step created the state (momentum, moments)
                    assert opt.state_dict()["state"]
                # the same data on every rank from here: ranks stay identical
                x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator()
                                .manual_seed(3))
                for _ in range(2):
                    opt.zero_grad()
                    F.mse_loss(model(x), torch.zeros(4, 3, dtype=torch.float64)).backward()
                    opt.step()
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                root = hvd.broadcast(flat, 0, name=f"chk.{opt_name}.{when}.{wrap}")
                assert torch.equal(flat, root), (opt_name, when, wrap)
    # named_parameters() generator and a plain list are accepted too
    model = _model(torch, 200 + r)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=n - 1)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=n - 1)
    ref = _model(torch, 200 + n - 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    hvd.shutdown()
    return "ok"


# -- misuse -------------------------------------------------------------------------------
def extra_parameter(reorder: bool = False) -> tuple:
    """Rank 1 has a parameter rank 0 lacks (or, ``reorder``, the same parameters in
    another order): a clear error on every rank, quickly."""
    torch, hvd = _setup()
    r = hvd.rank()
    model = _model(torch, 1, extra=(r == 1 and not reorder))
    named = list(model.named_parameters())
    if reorder and r == 1:
        named.reverse()
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                                   named_parameters=named)
    t0 = time.monotonic()
    model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
    try:
        opt.step()
    except hvd.TensorMismatchError as exc:
        msg = str(exc)
    else:
        raise AssertionError("no error for differing parameters")
    elapsed = time.monotonic() - t0
    hvd.shutdown()
    return msg, elapsed


def local_misuse() -> str:
    torch, hvd = _setup()
    r = hvd.rank()
    F = torch.nn.functional
    model = _model(torch, 1)
    named = list(model.named_parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    _raises(ValueError, "unique; duplicates: '0.weight'",
            lambda: hvd.DistributedOptimizer(sgd, named_parameters=named + [named[0]]))
    _raises(ValueError, "not in it",
            lambda: hvd.DistributedOptimizer(sgd, named_parameters=named[:1]))
    _raises(ValueError, "not in it", lambda: hvd.DistributedOptimizer(  # Adasum's names too
        sgd, named_parameters=named[:1], op=hvd.Adasum))
    _raises(ValueError, "Adasum", lambda: hvd.DistributedOptimizer(  # the delta optimizer
        sgd, op=hvd.Adasum, backward_passes_per_step=2))                 # takes no passes
    _raises(ValueError, "only supported with op=Average",
            lambda: hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0))
    assert not [k for k in vars(sgd) if k.startswith("_ronde")]  # failed wraps left nothing
    opt = hvd.DistributedOptimizer(sgd, named_parameters=named)
    assert isinstance(opt, torch.optim.SGD)
    for again in (sgd, opt):  # a second wrapper would share the first one's bookkeeping
        _raises(ValueError, "is wrapped already; wrap an optimizer once",
                lambda: hvd.DistributedOptimizer(again, named_parameters=named))
    _raises(hvd.RondeError, "found no gradients", opt.step)  # every rank: no backward
    x = torch.ones(4, 6, dtype=torch.float64)
    model(x).sum().backward()
    _raises(hvd.RondeError, "zero_grad", opt.zero_grad)
    _raises(hvd.TooManyPassesError, "backward_passes_per_step=1",
            lambda: model(x).sum().backward())
    opt.step()
    opt.zero_grad()
    # predivide factor: same result as plain averaging
    model2 = _model(torch, 1)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                    named_parameters=[(f"pd.{k}", v) for k, v in
                                                      model2.named_parameters()],
                                    gradient_predivide_factor=4.0, groups=2)
    model3 = _model(torch, 1)
    opt3 = hvd.DistributedOptimizer(torch.optim.SGD(model3.parameters(), lr=0.1),
                                    named_parameters=[(f"plain.{k}", v) for k, v in
                                                      model3.named_parameters()])
    for m, o in ((model2, opt2), (model3, opt3)):
        F.mse_loss(m(x * (r + 1)), torch.zeros(4, 3, dtype=torch.float64)).backward()
        o.step()
    for a, b in zip(model2.parameters(), model3.parameters()):
        torch.testing.assert_close(a, b)
    # synchronize + skip_synchronize for gradient clipping
    F.mse_loss(model3(x * (r + 1)), torch.zeros(4, 3, dtype=torch.float64)).backward()
    opt3.synchronize()
    torch.nn.utils.clip_grad_norm_(model3.parameters(), 0.01)
    with opt3.skip_synchronize():
        opt3.step()
    opt3.zero_grad()
    # partial last window: step after 1 of 2 backward passes reduces what accumulated
    opt3.set_backward_passes_per_step(2)
    F.mse_loss(model3(x), torch.zeros(4, 3, dtype=torch.float64)).backward()
    opt3.step()
    opt3.zero_grad()
    opt3.set_backward_passes_per_step(1)
    flat = torch.cat([p.detach().reshape(-1) for p in model3.parameters()])
    assert torch.equal(flat, hvd.broadcast(flat, 0, name="chk.misuse"))
    hvd.shutdown()
    return "ok"


def _raises(cls, match, fn) -> None:
    try:
        fn()
    except cls as exc:
        assert match in str(exc), f"{match!r} not in {exc}"
    else:
        raise AssertionError(f"{fn} did not raise {cls.__name__}")


def _flat(torch, module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _diff(torch, a, b) -> float:
    """The largest difference between two modules' parameters."""
    return float((_flat(torch, a) - _flat(torch, b)).abs().max())


def _same_on_every_rank(torch, hvd, module, name: str) -> bool:
    flat = _flat(torch, module)
    return bool(torch.equal(flat, hvd.broadcast(flat, 0, name=f"chk.{name}")))


def unused_parameter() -> dict:
    """A branch used on rank 0 only is averaged with the others' zeros; one used on no rank
    keeps ``grad=None`` and stays where it is under AdamW (DDP's rule), or, with
    ``zero_unused_grads=True``, gets Horovod's zero gradient (and weight decay moves it).
    Both against one process on the ranks' losses averaged. Returns per case the largest
    difference from that process."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    nn = torch.nn
    x = torch.randn(n, 2, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def loss_of(model, q):  # rank q's loss: "b" only on rank 0, "c" nowhere
        out = model["a"](x[q]).pow(2).sum()
        return out + model["b"](x[q]).pow(2).sum() if q == 0 else out

    out = {}
    for zero_unused in (False, True):
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2),
                               "c": nn.Linear(3, 2)}).double()
        ref = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2),
                             "c": nn.Linear(3, 2)}).double()
        ref.load_state_dict(model.state_dict())
        c0 = model["c"].weight.detach().clone()
        opt = hvd.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
            named_parameters=[(f"z{int(zero_unused)}.{k}", v)
                              for k, v in model.named_parameters()],
            zero_unused_grads=zero_unused)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
        for step in range(3):
            opt.zero_grad()
            loss_of(model, r).backward()
            if step == 2:  # the reduced gradient of "b": rank 0's, averaged with zeros
                opt.synchronize()
                b_grad = model["b"].bias.grad.clone()
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            ref_opt.zero_grad()
            (sum(loss_of(ref, q) for q in range(n)) / n).backward()
            if step == 2:
                torch.testing.assert_close(b_grad, ref["b"].bias.grad)
            if zero_unused:  # what Horovod does with a parameter no rank used
                for p in ref["c"].parameters():
                    p.grad = torch.zeros_like(p)
            ref_opt.step()
        if zero_unused:
            assert torch.equal(model["c"].weight.grad, torch.zeros(2, 3, dtype=torch.float64))
            assert not torch.equal(model["c"].weight.detach(), c0)  # decayed
        else:
            assert model["c"].weight.grad is None and model["c"].bias.grad is None
            assert torch.equal(model["c"].weight.detach(), c0)  # AdamW left it alone
        assert _same_on_every_rank(torch, hvd, model, f"unused.{zero_unused}")
        out[f"zero_unused_grads={zero_unused}"] = _diff(torch, model, ref)
    hvd.shutdown()
    return out


class _CustomCast:
    """A Horovod-style custom compressor (a class with static methods): it casts like
    ``Compression.fp16`` but is not ronde's, so the buckets keep a separate presence count."""

    @staticmethod
    def compress(tensor):
        import torch

        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def presence_in_buckets(steps: int = 8) -> dict:
    """Which parameters have a gradient changes after the buckets are laid out (step 2
    on): "b" on rank 0 only (steps 3-4), on no rank (5), on the last rank only (6); "c"
    on no rank from step 3 on but at step 6 on every rank. Every parameter is in a
    bucket, so the buckets carry the presence flags (no collective of its own); a
    custom compressor keeps the separate count. AdamW (weight decay shows a gradient
    of zeros that should have been None), against one process on the ranks' losses
    averaged. Returns per case the largest difference from it and whether the flags
    rode in the buckets."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    nn = torch.nn
    x = torch.randn(steps, n, 2, 3, generator=torch.Generator().manual_seed(9),
                    dtype=torch.float64)

    def uses(part, q, step):
        if step < 3:
            return True
        if part == "b":
            return (step in (3, 4) and q == 0) or (step == 6 and q == n - 1)
        return step == 6

    def loss_of(model, q, step):
        out = model["a"](x[step, q]).pow(2).sum()
        for part in ("b", "c"):
            if uses(part, q, step):
                out = out + model[part](x[step, q]).pow(3).sum()
        return out

    out = {}
    for case, comp in (("flags", hvd.Compression.none), ("fp16", hvd.Compression.fp16),
                       ("custom", _CustomCast)):
        torch.manual_seed(1)
        model = nn.ModuleDict({k: nn.Linear(3, 2) for k in "abc"}).double()
        ref = nn.ModuleDict({k: nn.Linear(3, 2) for k in "abc"}).double()
        ref.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
            named_parameters=[(f"pb.{case}.{k}", v) for k, v in model.named_parameters()],
            compression=comp)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
        carried = []
        for step in range(steps):
            opt.zero_grad()
            loss_of(model, r, step).backward()
            opt.step()
            ref_opt.zero_grad()
            (sum(loss_of(ref, q, step) for q in range(n)) / n).backward()
            ref_opt.step()
            buckets = opt._ronde_buckets
            carried.append(buckets is not None and buckets.presence)
            if step == 5:  # used on no rank: None, as in one process and under DDP
                assert all(p.grad is None for k in "bc" for p in model[k].parameters()), case
                assert all(p.grad is None for k in "bc" for p in ref[k].parameters())
        assert _same_on_every_rank(torch, hvd, model, f"presence.{case}")
        out[case] = {"diff": _diff(torch, model, ref), "carried": carried}
    hvd.shutdown()
    return out


def requires_grad_changes() -> dict:
    """``requires_grad`` changed after wrapping, under AdamW (weight decay, moments): a
    layer frozen when the optimizer was wrapped and unfrozen later is averaged like the
    others; one frozen after wrapping keeps ``grad=None`` and does not move. Against one
    process on the global batch; returns per case the largest difference from it."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(21)
    batches = [(torch.randn(4 * n, 6, generator=gen, dtype=torch.float64),
                torch.randn(4 * n, 3, generator=gen, dtype=torch.float64)) for _ in range(6)]
    out = {}
    for case in ("unfrozen later", "frozen later"):
        model, ref = _model(torch, 5), _model(torch, 5)
        frozen_at_wrap = case == "unfrozen later"
        for m in (model, ref):
            m[0].requires_grad_(not frozen_at_wrap)
        opt = hvd.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
            named_parameters=[(f"{case}.{k}", v) for k, v in model.named_parameters()])
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
        for step, (x, y) in enumerate(batches):
            if step == 2:  # flip the first layer, on every rank and in the reference
                for m in (model, ref):
                    m[0].requires_grad_(frozen_at_wrap)
                layer0 = model[0].weight.detach().clone()
            opt.zero_grad()
            F.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
            opt.step()
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
        if not frozen_at_wrap:  # frozen for the last steps: no gradient, not moved
            assert model[0].weight.grad is None and model[0].bias.grad is None
            assert torch.equal(model[0].weight.detach(), layer0)
        else:  # trained for the last steps
            assert not torch.equal(model[0].weight.detach(), layer0)
        # the hooks followed requires_grad (Horovod's attribute lists the hooked ones)
        assert (model[0].weight in opt._requires_update) == frozen_at_wrap
        assert _same_on_every_rank(torch, hvd, model, case.replace(" ", "."))
        out[case] = _diff(torch, model, ref)
    hvd.shutdown()
    return out


def schedulers_made_before_wrapping() -> dict:
    """An LR scheduler made before ``DistributedOptimizer`` (it patches ``opt.step``): the
    reduction still runs, the schedule advances as in one process, the scheduler warns
    about nothing, and after ``broadcast_optimizer_state`` (``load_state_dict`` on the
    other ranks) the scheduler still drives the optimizer that steps, whose step hooks
    run once per step. Returns per case the largest difference from one process on the
    global batch."""
    import warnings

    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    lr_scheduler = torch.optim.lr_scheduler
    gen = torch.Generator().manual_seed(9)
    batches = [(torch.randn(4 * n, 6, generator=gen, dtype=torch.float64),
                torch.randn(4 * n, 3, generator=gen, dtype=torch.float64)) for _ in range(5)]
    cases = {
        "StepLR": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                   lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
        "OneCycleLR": (lambda ps: torch.optim.Adam(ps, lr=0.01),
                       lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6)),
    }
    out = {}
    for case, (make_opt, make_sched) in cases.items():
        model, ref = _model(torch, 2), _model(torch, 2)
        opt = make_opt(model.parameters())
        sched = make_sched(opt)
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=[(f"{case}.{k}", v) for k, v in model.named_parameters()])
        if case == "StepLR":  # the usual recipe; SGD's zero-gradient step changes nothing
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        hooked = []
        opt.register_step_post_hook(lambda *_: hooked.append(1))
        ref_opt = make_opt(ref.parameters())
        ref_sched = make_sched(ref_opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches:
                opt.zero_grad()
                F.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
                opt.step()
                sched.step()
                ref_opt.zero_grad()
                F.mse_loss(ref(x), y).backward()
                ref_opt.step()
                ref_sched.step()
                assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"], case
        told = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)
                or "optimizer.step()" in str(w.message)]
        assert not told, (case, told)
        assert sched.get_last_lr() == ref_sched.get_last_lr(), case
        assert hooked == [1] * len(batches), (case, hooked)
        assert _same_on_every_rank(torch, hvd, model, f"sched.{case}")
        out[case] = _diff(torch, model, ref)
    hvd.shutdown()
    return out


def step_with_closure() -> dict:
    """``opt.step(closure)`` where the closure runs forward and backward (PyTorch
    Lightning's way): the closure's gradients are the ones reduced, and its loss is
    returned. Returns the largest difference from one process on the global batch."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    model, ref = _model(torch, 8), _model(torch, 8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(13)
    losses = []
    for _ in range(3):
        x = torch.randn(4 * n, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(4 * n, 3, generator=gen, dtype=torch.float64)

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4])
            loss.backward()
            losses.append(loss)
            return loss

        def ref_closure():
            ref_opt.zero_grad()
            loss = F.mse_loss(ref(x), y)
            loss.backward()
            return loss

        with torch.no_grad():  # the closure runs under enable_grad all the same
            loss = opt.step(closure)
        ref_opt.step(ref_closure)
        assert loss is losses[-1] and loss.requires_grad
    assert _same_on_every_rank(torch, hvd, model, "closure")
    diff = _diff(torch, model, ref)
    hvd.shutdown()
    return {"step(closure)": diff}


def compiled(backend: str = "aot_eager") -> dict:
    """torch.compile(model): the wrapper's hooks see the compiled module's gradients; a
    whole compiled step (zero_grad, forward, backward, optimizer.step() in one
    torch.compile: the wrapper's methods run eagerly, graph breaks around them); and
    ``hvd.compile_backend``, whose graph is split into pieces (one compiled backward
    each, so the reductions overlap it). The largest difference from one process, and
    how many graphs each compile made."""
    from torch._dynamo.backends.registry import lookup_backend

    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    model, whole, ref = _model(torch, 3), _model(torch, 3), _model(torch, 3)
    split = _model(torch, 3)
    graphs = {"whole": 0, "split": 0}

    def counting(key):
        inner_fn = lookup_backend(backend)

        def fn(gm, example_inputs, **kw):
            graphs[key] += 1
            return inner_fn(gm, example_inputs, **kw)
        return fn

    cmodel = torch.compile(model, backend=counting("whole"))
    # 200 bytes a piece: the second Linear's 27 float64 gradients (216 bytes) and the
    # first's 56 (448 bytes) cannot share one
    csplit = torch.compile(split, backend=hvd.compile_backend(counting("split"),
                                                              bucket_bytes=200))
    split_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(csplit.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(f"split.{k}", v) for k, v in csplit.named_parameters()])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(cmodel.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=cmodel.named_parameters())
    whole_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(f"whole.{k}", v) for k, v in whole.named_parameters()])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    @torch.compile(backend=backend)
    def whole_step(x, y):
        whole_opt.zero_grad()
        loss = F.mse_loss(whole(x), y)
        loss.backward()
        whole_opt.step()
        return loss.detach()

    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4 * n, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(4 * n, 3, generator=gen, dtype=torch.float64)
        # first: the wrapper's methods are first called inside a trace (run first in
        # its launch, Dynamo loaded but no disabled form made yet: torch/_compile.eager)
        whole_step(x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])
        opt.zero_grad()
        F.mse_loss(cmodel(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
        opt.step()
        split_opt.zero_grad()
        F.mse_loss(csplit(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
        split_opt.step()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    hvd.shutdown()
    return {"diff": max(float((a - b).detach().abs().max()) for m in (model, whole, split)
                        for a, b in zip(m.parameters(), ref.parameters())), **graphs}


def _pin(torch, hvd, device: str):
    """The device this rank's tensors live on: ``cuda`` pins one GPU by local rank."""
    if device != "cuda":
        return torch.device(device)
    index = hvd.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def device_path(device: str = "cpu") -> str:
    """Collectives that stay on the device: CPU tensors through Gloo
    (``RONDE_TORCH_DEVICE_PATH=always``) or CUDA tensors through NCCL. Returns ``ok``, and
    for CUDA which path ran: ``ok nccl`` or, where ranks share a GPU, ``ok host``."""
    import torch

    import ronde.torch as hvd
    from ronde.torch._device import BACKEND

    torch.set_num_threads(1)
    hvd.init()
    dev = _pin(torch, hvd, device)
    r, n = hvd.rank(), hvd.size()

    def on(t):
        return t.to(dev)

    base = on(torch.arange(10, dtype=torch.float32))
    got = hvd.allreduce(base + r, op=hvd.Sum, name="a")
    assert got.device == dev, got.device
    assert torch.allclose(got, sum(base + q for q in range(n)))
    assert torch.allclose(hvd.allreduce(base + r, name="avg", prescale_factor=2.0,
                                        postscale_factor=0.5), base + (n - 1) / 2)
    w = on(torch.ones(4, dtype=torch.int64) * (r + 1))
    assert hvd.allreduce_(w, op=hvd.Sum, name="i") is w
    assert w.tolist() == [n * (n + 1) // 2] * 4
    strided = on(torch.zeros(4, 6))[:, ::2]  # non-contiguous, in place
    strided.fill_(r + 1.0)
    hvd.allreduce_(strided, op=hvd.Max, name="strided")
    assert (strided == n).all()
    b = hvd.broadcast(on(torch.full((3,), float(r))), root_rank=n - 1, name="b")
    assert b.device == dev and b.tolist() == [n - 1.0] * 3
    t = on(torch.full((2, 2), float(r)))
    hvd.broadcast_(t, root_rank=0, name="b_")
    assert (t == 0).all()
    hs = [hvd.allreduce_async(on(torch.full((s,), float(r))), op=hvd.Sum, name=f"f{s}")
          for s in (1, 5, 1000, 70_000)]
    for h in hs:
        assert torch.allclose(hvd.synchronize(h), on(torch.tensor(float(sum(range(n))))))
    x = on(torch.ones(3)).requires_grad_()
    hvd.allreduce(x * (r + 1), op=hvd.Sum, name="grad").sum().backward()
    # d/dx of sum(allreduce_sum(x * (r+1))) = allreduce_sum(ones) * (r+1) = n * (r+1)
    assert torch.allclose(x.grad, on(torch.full((3,), float(n * (r + 1))))), x.grad
    model = torch.nn.Linear(4, 2).to(dev)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for _ in range(3):
        opt.zero_grad()
        model(on(torch.ones(8, 4)) * (r + 1)).sum().backward()
        opt.step()
    ws = hvd.allgather_object(model.weight.detach().cpu().numpy().tolist())
    assert all(np.allclose(ws[0], other) for other in ws)
    if device == "cuda":
        # the other collectives make a host round trip and come back on the device
        g = hvd.allgather(on(torch.full((r + 1, 2), float(r))), name="ag")
        assert g.device == dev and g.shape == (n * (n + 1) // 2, 2)
        rs = hvd.reducescatter(on(torch.ones(2 * n, 3)), op=hvd.Sum, name="rs")
        assert rs.device == dev and (rs == n).all()
    nccl = BACKEND._placement.get(0, (True, 0))[0] if device == "cuda" else True
    # the device path really ran (or, where ranks share a GPU, really did not)
    assert torch.distributed.is_initialized() == nccl
    if nccl and device == "cuda":
        assert torch.distributed.get_backend() == "nccl"
    hvd.shutdown()
    # torn down after a barrier, not left to exit, where Gloo could abort the process
    # ("terminate called without an active exception" failed a CI run once)
    assert not torch.distributed.is_initialized()
    hvd.init()  # and built again by the next generation
    again = hvd.allreduce(on(torch.ones(2)), op=hvd.Sum, name="again")
    assert again.device == dev and again.tolist() == [float(n)] * 2
    hvd.shutdown()
    if device != "cuda":
        return "ok"
    return "ok nccl" if nccl else "ok host"


def device_path_process_set(device: str = "cpu") -> str:
    """Device collectives on a process set: a members-only process group (Gloo for CPU
    tensors, NCCL for CUDA ones). Returns ``ok``; for CUDA, members say which path their
    set took (``ok nccl`` / ``ok host``) and the others ``ok -``."""
    import torch

    import ronde.torch as hvd
    from ronde.torch._device import BACKEND

    torch.set_num_threads(1)
    hvd.init()
    dev = _pin(torch, hvd, device)
    r, n = hvd.rank(), hvd.size()
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    members = [q for q in range(n) if q % 2 == 0]

    def full(shape, value):
        return torch.full(shape, value, device=dev)

    for step in range(3):
        if r in members:
            got = hvd.allreduce(full((5,), r + 1.0), op=hvd.Sum, name="ps.a",
                                process_set=evens)
            assert got.device == dev
            assert torch.equal(got, full((5,), float(sum(q + 1 for q in members)))), got
            avg = hvd.allreduce(full((4,), float(r)), name="ps.avg", process_set=evens,
                                postscale_factor=2.0)
            assert torch.allclose(avg, full((4,), 2.0 * sum(members) / len(members)))
            b = full((3,), float(r))
            hvd.broadcast_(b, root_rank=members[-1], name="ps.b", process_set=evens)
            assert (b == members[-1]).all(), b
            hs = [hvd.allreduce_async(full((s,), float(r)), op=hvd.Max, name=f"ps.f{s}",
                                      process_set=evens) for s in (1, 7, 50_000)]
            for h in hs:
                assert (hvd.synchronize(h) == members[-1]).all()
        # the global set keeps working beside it
        g = hvd.allreduce(full((2,), 1.0), op=hvd.Sum, name="g")
        assert g.device == dev and g.tolist() == [float(n)] * 2
    ps = evens.process_set_id
    own = BACKEND._placement.get(ps, (False, 0))[0] if device == "cuda" else True
    assert (ps in BACKEND._sets) == (r in members and own)
    hvd.shutdown()
    assert not BACKEND._sets  # the members-only groups were dropped at shutdown
    if device != "cuda":
        return "ok"
    return ("ok nccl" if own else "ok host") if r in members else "ok -"


def side_stream() -> str:
    """CUDA tensors written on a stream of the caller's own, late (after a queue of matrix
    products), then reduced: the reduction must see the late values, and the caller's
    stream must see the result."""
    import torch

    import ronde.torch as hvd

    hvd.init()
    dev = _pin(torch, hvd, "cuda")
    n = hvd.size()
    m = torch.randn(2048, 2048, device=dev)
    side = torch.cuda.Stream(dev)
    for step in range(4):
        a = torch.zeros(1 << 20, device=dev)
        b = torch.zeros(10, device=dev)
        c = torch.zeros(1 << 16, device=dev)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for _ in range(100):  # keeps the side stream busy for tens of milliseconds
                m = torch.tanh(m @ m)
            a.fill_(1.0)
            b.fill_(2.0)
            c.fill_(3.0)
            # a and b fuse; c alone takes the in-place single-tensor path
            hs = [hvd.allreduce_async_(t, op=hvd.Sum, prescale_factor=2.0, name=f"{k}.{step}")
                  for k, t in (("a", a), ("b", b), ("c", c))]
            if step % 2:  # let the engine's own thread run them (else this one may)
                time.sleep(0.02)
            for h in hs:
                hvd.synchronize(h)
            ok = torch.stack([(a == 2.0 * n).all(), (b == 4.0 * n).all(),
                              (c == 6.0 * n).all()])  # computed on the side stream
        torch.cuda.synchronize()
        assert ok.all(), (step, a[:2].tolist(), b[:2].tolist(), c[:2].tolist())
    hvd.shutdown()
    return "ok"


def device_path_prepared_at_construction() -> str:
    """DistributedOptimizer sets the device path up when it is built (the placement check
    and the process group are collectives): its gradient hooks never start one."""
    import torch

    import ronde.torch as hvd
    from ronde.torch import _device

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)  # the same weights everywhere, with no collective before the optimizer
    model = torch.nn.Linear(8, 4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert _device.BACKEND._group is not None  # created by the constructor

    def refused(*a, **k):
        raise AssertionError("a device-path set-up collective ran after construction")

    _device.store_for = _device._gpu_identity = refused
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(3, 8) * (hvd.rank() + 1)).sum().backward()
        opt.step()
    w = hvd.allgather(model.weight.detach().reshape(1, -1))
    assert torch.equal(w[0], w[-1])
    return "ok"


def bucketed(steps: int = 7) -> dict:
    """Gradients in buckets (from the third step on; RONDE_BUCKET_BYTES set small by the
    test, so that every bucket size occurs): SGD, Adam with two backward passes per step,
    fp16 compression, and a layer frozen in the middle, each against one process on the
    global batch; returns per case the bucket count and the largest difference."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    out = {}
    for case, opt_name, bpps, comp in (("sgd", "sgd", 1, "none"), ("adam x2", "adam", 2, "none"),
                                       ("fp16", "sgd", 1, "fp16"),
                                       ("freeze", "adamw", 1, "none"),
                                       ("kept grads", "adam", 1, "none")):
        model, ref = _model(torch, 3, extra=True), _model(torch, 3, extra=True)
        opt = hvd.DistributedOptimizer(
            _optimizer(torch, opt_name, model.parameters()), backward_passes_per_step=bpps,
            named_parameters=[(f"b.{case}.{k}", v) for k, v in model.named_parameters()],
            compression=getattr(hvd.Compression, comp))
        ref_opt = _optimizer(torch, opt_name, ref.parameters())
        gen = torch.Generator().manual_seed(5)
        seen = []
        for step in range(steps):
            if case == "freeze" and step == 4:
                for m in (model, ref):
                    m[2].requires_grad_(False)
            x = torch.randn(4 * n, 6, generator=gen, dtype=torch.float64)
            y = torch.randn(4 * n, 3, generator=gen, dtype=torch.float64)
            keep = case == "kept grads"  # zero_grad keeps the gradients (as zeros)
            ref_opt.zero_grad(set_to_none=not keep)
            F.mse_loss(ref.extra(ref[:3](x)), y).backward()
            ref_opt.step()
            opt.zero_grad(set_to_none=not keep)
            for xs, ys in zip(x[4 * r:4 * r + 4].chunk(bpps), y[4 * r:4 * r + 4].chunk(bpps)):
                (F.mse_loss(model.extra(model[:3](xs)), ys) / bpps).backward()
            opt.step()
            seen.append(0 if opt._ronde_buckets is None else len(opt._ronde_buckets.buckets))
            if seen[-1] and len(seen) > 1 and not seen[-2]:  # the step that laid them out
                flats = {b.flat.untyped_storage().data_ptr()
                         for b in opt._ronde_buckets.buckets}
                # its gradients adopted by their buckets at once (not held twice over)
                adopted = sum(p.grad is not None and p.grad.untyped_storage().data_ptr()
                              in flats for p in model.parameters())
        assert _same_on_every_rank(torch, hvd, model, f"bucketed.{case}")
        # gradients living in their buckets (RONDE_GRADIENT_AS_BUCKET_VIEW)
        flats = {b.flat.untyped_storage().data_ptr() for b in opt._ronde_buckets.buckets}
        views = [p.grad.untyped_storage().data_ptr() in flats for p in model.parameters()
                 if p.grad is not None and p in opt._ronde_buckets]
        out[case] = {"buckets": seen, "diff": _diff(torch, model, ref),
                     "views": sum(views), "bucketed": len(views), "adopted": adopted}
    hvd.shutdown()
    return out


def steady_passes() -> dict:
    """The steady state's lean hooks (every parameter in a bucket, one backward pass a
    step: ``_ronde_lean``): a second backward pass before step() still raises
    TooManyPassesError naming the gradient; ``set_backward_passes_per_step(2)`` then
    turns the lean hooks off and two passes accumulate, and back to 1 turns them on;
    both against one process on the global batch."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    model = _model(torch, 4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[(f"sp.{k}", v)
                                                     for k, v in model.named_parameters()])
    gen = torch.Generator().manual_seed(9)

    def batch():
        x = torch.randn(4 * n, 6, generator=gen, dtype=torch.float64)
        return x, torch.randn(4 * n, 3, generator=gen, dtype=torch.float64)

    for _ in range(3):  # per tensor, the layout, then buckets
        x, y = batch()
        opt.zero_grad()
        F.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
        opt.step()
    out = {"lean": opt._ronde_lean is not None}
    x, y = batch()
    opt.zero_grad()
    F.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
    try:
        F.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
    except hvd.TooManyPassesError as exc:
        out["error"] = str(exc)
    opt.step()  # (its values are not checked: the second pass added into some gradients)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref = _model(torch, 4)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    lean = []
    for step in range(6):
        passes = 2 if step < 3 else 1
        if step in (0, 3):
            opt.set_backward_passes_per_step(passes)
        x, y = batch()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        for xs, ys in zip(x[4 * r:4 * r + 4].chunk(passes), y[4 * r:4 * r + 4].chunk(passes)):
            (F.mse_loss(model(xs), ys) / passes).backward()
        opt.step()
        lean.append(opt._ronde_lean is not None)
    out.update(after=lean, diff=_diff(torch, model, ref),
               same=_same_on_every_rank(torch, hvd, model, "steady_passes"))
    hvd.shutdown()
    return out


def calls_in_backward(tensors: int = 40, steps: int = 12) -> dict:
    """Python calls inside ronde while ``loss.backward()`` runs (the gradient hooks and
    the bucket submissions, on this thread; counts, not times) in the steady state, for
    a model of ``tensors`` gradient tensors; the calls of whole steps on every thread
    (the engine's threads included: the profile is set before ``init()`` starts them);
    and the bucket count."""
    import os
    import sys
    import threading

    import torch

    import ronde.torch as hvd

    src = os.path.dirname(os.path.dirname(os.path.abspath(hvd.__file__)))
    everywhere = [False, 0, 0]  # counting, calls on every thread, on the control thread

    def prof_all(frame, event, arg):
        if everywhere[0] and event == "call" and frame.f_code.co_filename.startswith(src):
            everywhere[1] += 1
            if threading.current_thread().name == "ronde-control":
                everywhere[2] += 1

    # set until the end: the steady lane's thread starts during the steps
    threading.setprofile(prof_all)
    torch.set_num_threads(1)
    hvd.init()
    # the structure, not the machine's load: a waiting caller spins (and drives) up to
    # 5 s instead of 200 us before it hands the round to the control thread, which a
    # busy machine (the full suite) made every step do (+150-300 calls a step)
    from ronde import _state

    _state.require().engine.exchange.set_spin(5.0)
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(tensors // 2)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    counted = [False, 0]  # in backward, calls there

    def prof(frame, event, arg):  # this thread: the whole step, and backward apart
        if event == "call" and frame.f_code.co_filename.startswith(src):
            everywhere[1] += 1
            if counted[0]:
                counted[1] += 1

    x = torch.randn(4, 8)
    per_step, whole, control = [], [], []
    for step in range(steps):
        everywhere[1] = everywhere[2] = counted[1] = 0
        everywhere[0] = True
        sys.setprofile(prof)
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        counted[0] = True
        loss.backward()
        counted[0] = False
        opt.step()
        sys.setprofile(None)
        everywhere[0] = False
        per_step.append(counted[1])
        whole.append(everywhere[1])
        control.append(everywhere[2])
    threading.setprofile(None)
    buckets = len(opt._ronde_buckets.buckets) if opt._ronde_buckets is not None else 0
    laned = _state.require().engine.lane.laned
    hvd.shutdown()
    return {"calls": per_step, "buckets": buckets, "tensors": tensors, "step_calls": whole,
            "control_calls": control, "laned": laned}


def lane_training(steps: int = 10, batch: int = 4, first: str = "1MiB") -> dict:
    """Train past the point where the buckets take the steady lane (core/lane.py), in
    float64, against one process on the global batch; and every rank against rank 0.
    Two buckets with ``RONDE_FIRST_BUCKET_BYTES=first`` 1 MiB (the first 291 KiB: not
    small enough to join the second, ``_buckets.SMALL_FRACTION``), one where ``auto``
    finds no core to spare; their buffers live in the lane's shared memory, so the lane
    reduces them where they lie (``allreduce_resident``). Returns the largest
    differences, how many collectives the lane ran (and how many where they lie) and its
    breaks."""
    import os

    os.environ["RONDE_FIRST_BUCKET_BYTES"] = first
    try:
        torch, hvd = _setup()
    finally:
        del os.environ["RONDE_FIRST_BUCKET_BYTES"]
    from ronde import _state

    r, n = hvd.rank(), hvd.size()
    nn, F = torch.nn, torch.nn.functional

    def make() -> "torch.nn.Module":
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(32, 384), nn.Tanh(), nn.Linear(384, 384), nn.Tanh(),
                             nn.Linear(384, 96)).double()

    model, ref = make(), make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(n * batch, 32, generator=gen, dtype=torch.float64)
        y = torch.randn(n * batch, 96, generator=gen, dtype=torch.float64)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(model(x[r * batch:(r + 1) * batch]), y[r * batch:(r + 1) * batch]).backward()
        opt.step()
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    root = hvd.broadcast(mine.clone(), root_rank=0, name="lane_training.weights")
    lane = _state.require().engine.lane
    out = {"vs_one_process": float((mine - ref_flat).abs().max()),
           "vs_rank0": float((mine - root).abs().max()),
           "buckets": len(opt._ronde_buckets.buckets), "laned": lane.laned,
           "resident": lane.resident, "breaks": lane.breaks}
    hvd.shutdown()
    return out
