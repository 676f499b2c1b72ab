"""Rank functions for the ShardedOptimizer tests (run by ronde.testing.run_ranks)."""

from __future__ import annotations

from torch_workers import _diff, _same_on_every_rank, _setup


def _net(torch, seed: int):
    nn = torch.nn
    torch.manual_seed(seed)
    model = nn.ModuleDict({"a": nn.Linear(6, 7), "b": nn.Linear(7, 5), "c": nn.Linear(5, 3),
                           "unused": nn.Linear(3, 3), "d": nn.Linear(2, 2)})
    return model.double()


def _forward(model, x):  # "unused" and "d" are used by no rank
    return model["c"](model["b"](model["a"](x).tanh()).tanh())


OPTS = {
    "sgd": lambda torch, ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda torch, ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda torch, ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda torch, ps: torch.optim.RMSprop(ps, lr=0.01),
}


def _batches(torch, n: int, steps: int, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4 * n, 6, generator=gen, dtype=torch.float64),
             torch.randn(4 * n, 3, generator=gen, dtype=torch.float64)) for _ in range(steps)]


def equivalence(steps: int = 6) -> dict:
    """ShardedOptimizer at stages 1 and 2, SGD/Adam/AdamW/RMSprop, 1 and 2 backward passes
    per step, a layer frozen mid-run, fp16 compression, clipping by the global norm,
    against one process on the global batch; returns
    per case the largest difference, and whether every rank holds the same weights."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    out = {}
    cases = [(stage, opt, bpps, extra) for stage in (1, 2) for opt, bpps, extra in
             (("sgd", 1, ""), ("adam", 4, ""), ("adamw", 1, "freeze"), ("rmsprop", 2, "freeze"))]
    cases += [(2, "sgd", 1, "fp16"), (1, "adam", 1, "clip"), (2, "adamw", 2, "clip")]
    # zero_grad(set_to_none=False): stage 1's gradients are views of the buckets (torch's
    # detach_() refused them); zeroed in place, the next backward accumulates into them
    cases += [(1, "adam", 2, "zero"), (2, "sgd", 1, "zero")]
    for stage, opt_name, bpps, extra in cases:
        case = f"stage{stage}.{opt_name}.x{bpps}{'.' + extra if extra else ''}"
        model, ref = _net(torch, 5), _net(torch, 5)
        opt = hvd.ShardedOptimizer(OPTS[opt_name](torch, model.parameters()), stage=stage,
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=bpps,
                                   compression=getattr(hvd.Compression, extra or "none",
                                                       hvd.Compression.none))
        ref_opt = OPTS[opt_name](torch, ref.parameters())
        for step, (x, y) in enumerate(_batches(torch, n, steps)):
            if extra == "freeze" and step == 3:
                for m in (model, ref):
                    m["b"].requires_grad_(False)
            ref_opt.zero_grad(set_to_none=extra != "zero")
            F.mse_loss(_forward(ref, x), y).backward()
            if extra == "clip":  # the global norm, small enough to clip every step
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step()
            opt.zero_grad(set_to_none=extra != "zero")
            xs, ys = x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]
            for xc, yc in zip(xs.chunk(bpps), ys.chunk(bpps)):
                (F.mse_loss(_forward(model, xc), yc) / bpps).backward()
            if extra == "clip":
                opt.clip_grad_norm_(0.05)
            opt.step()
        same = _same_on_every_rank(torch, hvd, model, f"sharded.{case}")
        held = sum(v.numel() for st in opt.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim() > 0)
        total = sum(p.numel() for p in model.parameters())
        # stage 1: the model's gradients live in the buckets (RONDE_GRADIENT_AS_BUCKET_VIEW)
        bufs = {b.buf.untyped_storage().data_ptr() for b in opt._ronde_buckets
                if b.buf is not None}
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out[case] = {"diff": _diff(torch, model, ref), "same": same, "held": held,
                     "total": total, "unused_moved": bool((model["unused"].weight
                                                          != ref["unused"].weight).any()),
                     "grads": len(grads),
                     "views": sum(g.untyped_storage().data_ptr() in bufs for g in grads)}
    hvd.shutdown()
    return out


def unused_on_some_ranks(steps: int = 4) -> dict:
    """A layer used by rank 0's batch only ("unused") is averaged with the others' zeros;
    one no rank uses ("d") keeps grad=None and does not move under AdamW; against one
    process on the ranks' losses averaged."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    out = {}
    for stage in (1, 2):
        model, ref = _net(torch, 9), _net(torch, 9)
        opt = hvd.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01,
                                                     weight_decay=0.1),
                                   named_parameters=model.named_parameters(), stage=stage)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
        x = torch.randn(n, 2, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

        def loss_of(m, q):
            h = _forward(m, x[q])
            return (h + m["unused"](h) if q == 0 else h).pow(2).sum()

        start_d = model["d"].weight.detach().clone()
        for _ in range(steps):
            ref_opt.zero_grad()
            (sum(loss_of(ref, q) for q in range(n)) / n).backward()
            ref_opt.step()
            opt.zero_grad()
            loss_of(model, r).backward()
            opt.step()
        out[stage] = {"diff": _diff(torch, model, ref),
                      "same": _same_on_every_rank(torch, hvd, model, f"unused.{stage}"),
                      "d_still": bool(torch.equal(model["d"].weight, start_d))}
    hvd.shutdown()
    return out


def refusals() -> list:
    """What ShardedOptimizer refuses, each with its message's key words."""
    torch, hvd = _setup()
    model = _net(torch, 1)
    out = []
    for make in (lambda: torch.optim.LBFGS(model.parameters()),
                 lambda: torch.optim.SparseAdam(list(model.parameters()))):
        try:
            hvd.ShardedOptimizer(make(), named_parameters=model.named_parameters())
            out.append("accepted")
        except hvd.UnsupportedError as exc:
            out.append(str(exc))

    class Mine(torch.optim.SGD):
        pass

    for kwargs in ({}, {"op": hvd.Adasum}, {"sparse_as_dense": True}):
        try:
            hvd.ShardedOptimizer(Mine(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), **kwargs)
            out.append("accepted")
        except hvd.UnsupportedError as exc:
            out.append(str(exc))
    opt = hvd.ShardedOptimizer(Mine(model.parameters(), lr=0.1), elementwise=True,
                               named_parameters=model.named_parameters())
    out.append(type(opt).__name__)
    hvd.shutdown()
    return out


def fp16_near_its_limit() -> dict:
    """fp16 compression of gradients whose average fits float16 but whose sum over the
    ranks does not (40,000 on every rank: the sum overflows at 65,504). The reduce-scatter
    now takes every binding's rule (an Average as a Sum of predivided inputs); before, it
    summed in float16 and every parameter became inf. Each optimizer's parameters after
    one SGD step of lr 1, and a DistributedOptimizer's beside them."""
    torch, hvd = _setup()
    out = {}
    for kind in ("sharded", "distributed"):
        p = torch.nn.Parameter(torch.zeros(16))
        make = hvd.ShardedOptimizer if kind == "sharded" else hvd.DistributedOptimizer
        opt = make(torch.optim.SGD([p], lr=1.0), named_parameters=[(f"{kind}.w", p)],
                   compression=hvd.Compression.fp16)
        (p * 40000.0).sum().backward()
        opt.step()
        out[kind] = p.detach().tolist()
    hvd.shutdown()
    return out


def checkpoint(directory: str, phase: str, steps: int = 3) -> dict:
    """Adam, against one process that trained every step so far on the global batches
    (12 samples a step, whatever the world size), ``steps`` steps a phase:

    ``save``: sharded (stage 2) from the start, then save_sharded to ``directory``.
    ``resume`` (at another world size): load_sharded into a new ShardedOptimizer, train.
    ``plain`` (one process): load into a plain Adam (the export), train, then save_sharded
    the plain optimizer to ``directory + ".plain"``.
    ``from_plain``: load that into a ShardedOptimizer, train.
    """
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(11)
    batches = [(torch.randn(12, 6, generator=gen, dtype=torch.float64),
                torch.randn(12, 3, generator=gen, dtype=torch.float64)) for _ in range(3 * steps)]
    first = {"save": 0, "resume": steps, "plain": steps, "from_plain": 2 * steps}[phase]
    todo = batches[first:first + steps]
    ref = _net(torch, 2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for x, y in batches[:first + steps]:
        ref_opt.zero_grad()
        F.mse_loss(_forward(ref, x), y).backward()
        ref_opt.step()
    model = _net(torch, 2)
    lr = 0.01 if phase == "save" else 0.5  # resumed: the lr comes from the file
    if phase == "plain":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        hvd.load_sharded(directory, model, opt)
        for x, y in todo:
            opt.zero_grad()
            F.mse_loss(_forward(model, x), y).backward()
            opt.step()
        hvd.save_sharded(directory + ".plain", model, opt)
        hvd.shutdown()
        return {"diff": _diff(torch, model, ref), "lr": opt.param_groups[0]["lr"]}
    opt = hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=lr), stage=2,
                               named_parameters=model.named_parameters())
    if phase != "save":
        hvd.load_sharded(directory + (".plain" if phase == "from_plain" else ""), model, opt)
    per = 12 // n
    for x, y in todo:
        opt.zero_grad()
        F.mse_loss(_forward(model, x[per * r:per * r + per]), y[per * r:per * r + per]).backward()
        opt.step()
    if phase == "save":
        hvd.save_sharded(directory, model, opt)
    res = {"diff": _diff(torch, model, ref), "lr": opt.param_groups[0]["lr"],
           "same": _same_on_every_rank(torch, hvd, model, f"ckpt.{phase}")}
    # the whole state gathered in the running job, on the last rank: a plain Adam's
    # state_dict(), equal to the one process's
    root = n - 1
    whole = hvd.gather_sharded(opt, root=root)
    res["gathered"] = whole is not None
    if whole is not None:
        plain = torch.optim.Adam(_net(torch, 2).parameters(), lr=0.5)
        plain.load_state_dict(whole)
        mine, theirs = plain.state_dict(), ref_opt.state_dict()
        res["keys"] = (sorted(mine["state"]) == sorted(theirs["state"]) and all(
            sorted(mine["state"][k]) == sorted(theirs["state"][k]) for k in theirs["state"]))
        res["state_diff"] = max(float((v - theirs["state"][k][key]).abs().max())
                                for k, st in mine["state"].items() for key, v in st.items())
        res["lr_gathered"] = mine["param_groups"][0]["lr"]
    hvd.shutdown()
    return res


def versus_distributed(steps: int = 100) -> dict:
    """The same float32 training through DistributedOptimizer and ShardedOptimizer (stage
    1 and 2; SGD with momentum, Adam, AdamW), same data: per case the largest relative
    difference of the losses over ``steps`` steps, and of the final weights."""
    torch, hvd = _setup()
    r = hvd.rank()
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(21 + r)
    data = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen))
            for _ in range(steps)]
    out = {}
    for opt_name in ("sgd", "adam", "adamw"):
        runs = {}
        for kind in ("distributed", "stage1", "stage2"):
            model = _net(torch, 4).float()
            inner = OPTS[opt_name](torch, model.parameters())
            named = [(f"{kind}.{opt_name}.{k}", v) for k, v in model.named_parameters()]
            opt = hvd.DistributedOptimizer(inner, named_parameters=named) \
                if kind == "distributed" else hvd.ShardedOptimizer(
                    inner, named_parameters=named, stage=int(kind[-1]))
            losses = []
            for x, y in data:
                opt.zero_grad()
                loss = F.mse_loss(_forward(model, x), y)
                loss.backward()
                opt.step()
                losses.append(float(loss))
            runs[kind] = (torch.tensor(losses, dtype=torch.float64),
                          torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        base_l, base_w = runs["distributed"]
        for kind in ("stage1", "stage2"):
            lo, w = runs[kind]
            out[f"{opt_name}.{kind}"] = {
                "loss": float(((lo - base_l).abs() / base_l.abs()).max()),
                "weights": float(((w - base_w).abs() / base_w.abs().clamp_min(1e-3)).max())}
    hvd.shutdown()
    return out


def process_set(steps: int = 4) -> dict:
    """A ShardedOptimizer on the process set {0, 1} of a 3-rank job: ranks 0 and 1 shard
    and average between them (as one process on their two batches), rank 2 steps alone on
    its own batch (as Horovod's DistributedOptimizer does outside its set)."""
    torch, hvd = _setup()
    r = hvd.rank()
    F = torch.nn.functional
    pair = hvd.add_process_set([0, 1])
    model, ref = _net(torch, 6), _net(torch, 6)
    opt = hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), stage=2,
                               named_parameters=model.named_parameters(), process_set=pair)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(8)
    for _ in range(steps):
        x, y = torch.randn(12, 6, generator=gen, dtype=torch.float64), \
            torch.randn(12, 3, generator=gen, dtype=torch.float64)
        mine = slice(4 * r, 4 * r + 4)
        ref_opt.zero_grad()  # ranks 0 and 1: their 8 samples; rank 2: its own 4
        want = slice(0, 8) if r < 2 else mine
        F.mse_loss(_forward(ref, x[want]), y[want]).backward()
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(_forward(model, x[mine]), y[mine]).backward()
        opt.step()
    held = sum(v.numel() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)
    out = {"diff": _diff(torch, model, ref), "held": held}
    hvd.shutdown()
    return out
