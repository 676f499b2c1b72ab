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


def _train(torch, hvd, model, opt, ref, ref_opt, steps: int, between=None, ref_between=None,
           step=None, ref_step=None, stage: int = 1, seed: int = 3) -> None:
    """``steps`` steps of the sharded ``model`` on this rank's quarter-batch and of ``ref``
    on the global batch; ``between(step)``/``ref_between(step)`` run after backward,
    ``step``/``ref_step`` replace ``opt.step()``/``ref_opt.step()``."""
    F = torch.nn.functional
    r, n = hvd.rank(), hvd.size()
    for k, (x, y) in enumerate(_batches(torch, n, steps, seed)):
        ref_opt.zero_grad()
        F.mse_loss(_forward(ref, x), y).backward()
        if ref_between:
            ref_between(k)
        (ref_step or ref_opt.step)()
        opt.zero_grad()
        F.mse_loss(_forward(model, x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
        if between:
            between(k)
        (step or opt.step)()


def in_flight(limit: int | None = None, steps: int = 4) -> dict:
    """Stage 2 on a stack of five layers with one bucket a parameter
    (RONDE_BUCKET_BYTES=64) and RONDE_SHARDED_IN_FLIGHT=``limit`` (None: the default),
    against one process on the global batch; returns the most reduce-scatters seen in
    flight and the most buckets holding a gradient buffer at once (each gradient's hook,
    after ronde's own)."""
    import os

    keep = {k: os.environ.get(k) for k in ("RONDE_BUCKET_BYTES", "RONDE_SHARDED_IN_FLIGHT")}
    os.environ["RONDE_BUCKET_BYTES"] = "64"
    if limit is not None:
        os.environ["RONDE_SHARDED_IN_FLIGHT"] = str(limit)
    try:
        torch, hvd = _setup()
    finally:
        for k, v in keep.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    r, n = hvd.rank(), hvd.size()

    def stack():
        torch.manual_seed(5)
        return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)]).double()

    model, ref = stack(), stack()
    opt = hvd.ShardedOptimizer(OPTS["adam"](torch, model.parameters()), stage=2,
                               named_parameters=model.named_parameters())
    ref_opt = OPTS["adam"](torch, ref.parameters())
    buckets = opt.shard_layout.buckets
    seen = {"started": 0, "held": 0}

    def look(_p) -> None:
        seen["started"] = max(seen["started"], sum(b.started is not None for b in buckets))
        seen["held"] = max(seen["held"], sum(b.buf is not None for b in buckets))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(look)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(4 * n, 4, generator=gen, dtype=torch.float64)
        for m, o, batch in ((ref, ref_opt, x), (model, opt, x[4 * r:4 * r + 4])):
            o.zero_grad()
            m(batch).pow(2).mean().backward()
            o.step()
    out = {"diff": _diff(torch, model, ref), "buckets": len(buckets), **seen,
           "same": _same_on_every_rank(torch, hvd, model, f"in_flight.{limit}")}
    hvd.shutdown()
    return out


def _outcome(torch, hvd, model, ref, case: str, **extra) -> dict:
    return {"diff": _diff(torch, model, ref),
            "same": _same_on_every_rank(torch, hvd, model, f"recipes.{case}"), **extra}


def recipes(steps: int = 5) -> dict:
    """What users write around an optimizer, with ShardedOptimizer at stages 1 and 2
    (issue #52), each against one process on the global batch: torch's own
    clip_grad_norm_ / clip_grad_value_ on model.parameters(), docs/pytorch.md's
    synchronize() recipe, a clip_grad_norm_ taken before ronde patched it (refused),
    broadcast_optimizer_state at the start and after steps (each rank's slices kept,
    rank 0's hyperparameters), and torch's GradScaler recipes with an overflow on one
    rank's slice only (every rank skips the same steps)."""
    torch, hvd = _setup()
    r = hvd.rank()
    F = torch.nn.functional
    # a reference to torch's function as a script that imported it before ronde holds it
    captured = torch.nn.utils.clip_grad_norm_
    captured = getattr(captured, "__wrapped__", captured)
    out: dict = {}
    for stage in (1, 2):
        def make(opt_name="adam", seed=5, **kw):
            model, ref = _net(torch, seed), _net(torch, seed)
            opt = hvd.ShardedOptimizer(OPTS[opt_name](torch, model.parameters()), stage=stage,
                                       named_parameters=model.named_parameters(), **kw)
            return model, opt, ref, OPTS[opt_name](torch, ref.parameters())

        # torch.nn.utils.clip_grad_norm_(model.parameters(), c): the global norm
        model, opt, ref, ref_opt = make()
        norms: list = []
        _train(torch, hvd, model, opt, ref, ref_opt, steps,
               lambda k: norms.append(float(torch.nn.utils.clip_grad_norm_(
                   model.parameters(), 0.05))),
               lambda k: norms.append(-float(torch.nn.utils.clip_grad_norm_(
                   ref.parameters(), 0.05))))
        out[f"stage{stage}.clip_norm"] = _outcome(
            torch, hvd, model, ref, "norm",
            norm_diff=max(abs(a + b) for a, b in zip(norms[1::2], norms[0::2])))
        # clip_grad_value_ and the inf norm
        model, opt, ref, ref_opt = make("sgd")
        _train(torch, hvd, model, opt, ref, ref_opt, steps,
               lambda k: (torch.nn.utils.clip_grad_value_(model.parameters(), 0.02),
                          torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, "inf")),
               lambda k: (torch.nn.utils.clip_grad_value_(ref.parameters(), 0.02),
                          torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, "inf")))
        out[f"stage{stage}.clip_value"] = _outcome(torch, hvd, model, ref, "value")
        # docs/pytorch.md's recipe: synchronize(), torch's clip, step in skip_synchronize()
        model, opt, ref, ref_opt = make("adamw")

        def synced_step(opt=opt):
            with opt.skip_synchronize():
                opt.step()

        _train(torch, hvd, model, opt, ref, ref_opt, steps,
               lambda k: (opt.synchronize(),
                          torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)),
               lambda k: torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05),
               step=synced_step)
        out[f"stage{stage}.synchronize_recipe"] = _outcome(torch, hvd, model, ref, "sync")
        # torch's function held from before ronde's patch: refused before any step
        model, opt, ref, ref_opt = make()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            _train(torch, hvd, model, opt, ref, ref_opt, 1,
                   lambda k: captured(model.parameters(), 0.05))
            out[f"stage{stage}.captured"] = "accepted"
        except hvd.RondeError as exc:
            out[f"stage{stage}.captured"] = str(exc)
        out[f"stage{stage}.captured_moved"] = any(
            not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        opt.zero_grad()
        if stage == 1:  # p.grad (a view of the bucket in flight) changed in place: refused
            model, opt, ref, ref_opt = make()
            try:
                _train(torch, hvd, model, opt, ref, ref_opt, 1,
                       lambda k: model["a"].weight.grad.mul_(2.0))
                out["stage1.inplace"] = "accepted"
            except hvd.RondeError as exc:
                out["stage1.inplace"] = f"{type(exc).__name__}: {exc}"
            opt.zero_grad()
        # broadcast_optimizer_state at the start (rank 1's lr differs: rank 0's wins) and
        # after steps: each rank's slices stay its own
        model, opt, ref, ref_opt = make()
        if r:
            opt.param_groups[0]["lr"] = 0.5
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        _train(torch, hvd, model, opt, ref, ref_opt, steps)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        _train(torch, hvd, model, opt, ref, ref_opt, steps, seed=4)
        out[f"stage{stage}.broadcast"] = _outcome(torch, hvd, model, ref, "bcast",
                                                  lr=opt.param_groups[0]["lr"])
        # GradScaler: torch's recipe, and unscale_ + clip; an inf in c.bias's gradient on
        # rank 0 at steps 1 and 3 (c.bias sits in one rank's slice only)
        for recipe in ("plain", "unscale_clip"):
            model, opt, ref, ref_opt = make()
            scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
                       for _ in range(2)]
            skipped = [[], []]

            def scaled(which, m, o, k, scaler):
                def run():
                    if recipe == "unscale_clip":
                        scaler.unscale_(o)
                        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                    before = scaler.get_scale()
                    scaler.step(o)
                    scaler.update()
                    skipped[which].append(scaler.get_scale() < before)
                return run

            for k, (x, y) in enumerate(_batches(torch, hvd.size(), steps)):
                for which, (m, o, xs, ys) in enumerate(
                        ((ref, ref_opt, x, y),
                         (model, opt, x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]))):
                    o.zero_grad()
                    hook = m["c"].bias.register_hook(lambda g: g * float("inf")) \
                        if k in (1, 3) and (which == 0 or r == 0) else None
                    scalers[which].scale(F.mse_loss(_forward(m, xs), ys)).backward()
                    if hook is not None:
                        hook.remove()
                    scaled(which, m, o, k, scalers[which])()
            out[f"stage{stage}.amp_{recipe}"] = _outcome(
                torch, hvd, model, ref, f"amp.{recipe}", skipped=skipped[1],
                ref_skipped=skipped[0], scale=scalers[1].get_scale(),
                ref_scale=scalers[0].get_scale())
    hvd.shutdown()
    return out


def ddp_around_the_model() -> dict:
    """torch's DistributedDataParallel around the model (as Hugging Face Trainer does
    under ronderun) with a ShardedOptimizer: refused on every rank at the first step,
    the weights not moved."""
    torch, hvd = _setup()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
    F = torch.nn.functional
    out = {}
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.d = _net(torch, 5)

        def forward(self, x):
            return _forward(self.d, x)

    for stage in (1, 2):
        model = torch.nn.parallel.DistributedDataParallel(Net(), find_unused_parameters=True)
        opt = hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), stage=stage,
                                   named_parameters=model.named_parameters())
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batches(torch, 1, 1)[0]
        F.mse_loss(model(x), y).backward()
        try:
            opt.step()
            out[stage] = {"error": "accepted"}
        except hvd.RondeError as exc:
            out[stage] = {"error": f"{type(exc).__name__}: {exc}"}
        out[stage]["moved"] = any(not torch.equal(a, b)
                                  for a, b in zip(before, model.parameters()))
        opt.zero_grad()
    dist.destroy_process_group()
    hvd.shutdown()
    return out


def changed_model(directory: str) -> dict:
    """load_sharded into a model that is not the saved one: a renamed layer, a changed
    shape, a changed dtype; each refused naming the parameter, nothing loaded."""
    torch, hvd = _setup()
    F = torch.nn.functional
    nn = torch.nn
    model = _net(torch, 2)
    opt = hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), stage=2,
                               named_parameters=model.named_parameters())
    x, y = _batches(torch, hvd.size(), 1)[0]
    F.mse_loss(_forward(model, x), y).backward()
    opt.step()
    hvd.save_sharded(directory, model, opt)
    out = {}
    for change in ("renamed", "shape", "dtype", "same"):
        m = _net(torch, 2)
        if change == "renamed":
            m["z"] = m.pop("c")
        elif change == "shape":
            m["c"] = nn.Linear(5, 4).double()
        elif change == "dtype":
            m["b"] = m["b"].float()
        o = hvd.ShardedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01), stage=2,
                                 named_parameters=m.named_parameters())
        try:
            hvd.load_sharded(directory, None, o)
            if change == "same":  # a resume script's broadcast after the load: kept
                mine = [v.clone() for st in o.state.values() for v in st.values()]
                hvd.broadcast_optimizer_state(o, root_rank=0)
                out["kept"] = all(torch.equal(a, b) for a, b in zip(
                    mine, [v for st in o.state.values() for v in st.values()]))
            out[change] = ("loaded", sum(len(s) for s in o.state.values()))
        except hvd.RondeError as exc:
            out[change] = (str(exc), sum(len(s) for s in o.state.values()))
    hvd.shutdown()
    return out


def _views_of_storage(torch, opt) -> bool:
    """Whether each bucket's parameters are views of its one flat storage."""
    layout = opt.shard_layout
    return all(b.storage is not None and {layout.params[i].untyped_storage().data_ptr()
                                          for i in b.members}
               == {b.storage.untyped_storage().data_ptr()} for b in layout.buckets)


def flat_params(flat: bool = True, steps: int = 6) -> dict:
    """Parameters as views of each bucket's flat storage (RONDE_SHARDED_FLAT_PARAMS; off:
    the parameters keep their own memory), at stages 1 and 2, against one process on the
    global batch: hvd.broadcast_parameters after wrapping (rank 1's weights differ), a
    ``p.data = p.data.clone()`` of every parameter after a backward, model.load_state_dict
    of new values (flat only), then a parameter turned float32 after a backward on rank 0
    only (refused on every rank at the step, nothing moved) and model.float() before a
    forward on every rank (refused in backward)."""
    import os

    os.environ["RONDE_SHARDED_FLAT_PARAMS"] = "1" if flat else "0"
    torch, hvd = _setup()
    del os.environ["RONDE_SHARDED_FLAT_PARAMS"]
    r = hvd.rank()
    F = torch.nn.functional
    out: dict = {}

    def new_values(module):  # the same on every rank and for the reference
        gen = torch.Generator().manual_seed(7)
        return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) * 0.3
                for k, v in module.state_dict().items()}

    def between(model, k):
        if k == 2 and flat:
            for p in model.parameters():
                p.data = p.data.clone()
        if k == 4 and flat:
            model.load_state_dict(new_values(model))

    for stage in (1, 2):
        model, ref = _net(torch, 5), _net(torch, 5)
        opt = hvd.ShardedOptimizer(OPTS["adam"](torch, model.parameters()), stage=stage,
                                   named_parameters=model.named_parameters())
        ref_opt = OPTS["adam"](torch, ref.parameters())
        views = _views_of_storage(torch, opt)
        distinct = len({p.untyped_storage().data_ptr() for p in model.parameters()})
        if r:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        _train(torch, hvd, model, opt, ref, ref_opt, steps, lambda k: between(model, k),
               lambda k: between(ref, k))
        res = _outcome(torch, hvd, model, ref, f"flat.{flat}.{stage}", views=views,
                       views_after=_views_of_storage(torch, opt), distinct=distinct)
        if flat:  # a dtype changed after a backward, on rank 0 only: refused on every rank
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            x, y = _batches(torch, hvd.size(), 1)[0]
            F.mse_loss(_forward(model, x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
            if r == 0:
                model["b"].weight.data = model["b"].weight.data.float()
            res["dtype"] = _refused(hvd, opt.step)
            res["moved"] = any(not torch.equal(a.to(b.dtype), b)
                               for a, b in zip(before, model.parameters()))
            opt.zero_grad()
            # the same after the user's own synchronize() (Horovod's clipping recipe): the
            # step checks again, on every rank (rank 0 alone raised, the others waited in
            # the allgather)
            model["b"].weight.data = model["b"].weight.data.double()
            F.mse_loss(_forward(model, x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
            opt.synchronize()
            if r == 0:
                model["b"].weight.data = model["b"].weight.data.float()
            with opt.skip_synchronize():
                res["dtype_synced"] = _refused(hvd, opt.step)
            model["b"].weight.data = model["b"].weight.data.double()
            opt.zero_grad()
            model.float()  # on every rank, before a forward: refused in backward
            res["float"] = _refused(hvd, lambda: F.mse_loss(
                _forward(model, x[4 * r:4 * r + 4].float()), y[4 * r:4 * r + 4].float()
            ).backward())
            opt.zero_grad()
        out[stage] = res
    hvd.shutdown()
    return out


def _refused(hvd, call) -> str:
    try:
        call()
        return "accepted"
    except hvd.RondeError as exc:
        return f"{type(exc).__name__}: {exc}"


def inplace_allgather() -> str:
    """The allgather of ShardedOptimizer's flat parameters: each rank's input is its own
    block of the output (the transports write only the other blocks; MPI gets its
    in-place form), small and large (shm's single-copy path), float32 and bfloat16."""
    torch, hvd = _setup()
    from ronde.torch import _collectives as C

    r, n = hvd.rank(), hvd.size()
    for per in (3, 300_007):
        for dtype in (torch.float32, torch.bfloat16):
            def block(q):
                return (torch.arange(per) % 100 + q).to(dtype)

            full = torch.full((per * n,), -1.0, dtype=dtype)
            full[r * per:(r + 1) * per] = block(r)
            got = C.allgather_async(full[r * per:(r + 1) * per], f"inplace.{per}.{dtype}",
                                    out=full).wait()
            assert got.data_ptr() == full.data_ptr(), (per, dtype)
            assert torch.equal(full, torch.cat([block(q) for q in range(n)])), (per, dtype)
    hvd.shutdown()
    return "ok"


def _stack3(torch):
    torch.manual_seed(5)
    nn = torch.nn
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def _stage3_steps(torch, hvd, model, opt, ref, ref_opt, steps: int, skip: int = 0,
                  mode: str = "plain", model_steps: bool = True) -> None:
    """``steps`` steps (the first ``skip`` of the batch sequence only for ``ref``): the
    sharded ``model`` on this rank's rows of a 12-row global batch, ``ref`` on all."""
    F = torch.nn.functional
    r, n = hvd.rank(), hvd.size()
    rows = 12 // n
    gen = torch.Generator().manual_seed(3)
    passes = 2 if mode == "accum" else 1
    for k in range(skip + steps):
        xs = [torch.randn(12, 6, generator=gen, dtype=torch.float64) for _ in range(passes)]
        ys = [torch.randn(12, 3, generator=gen, dtype=torch.float64) for _ in range(passes)]
        ref_opt.zero_grad()
        for x, y in zip(xs, ys):
            (F.mse_loss(ref(x), y) / passes).backward()
        if mode == "clip":
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        if k < skip or not model_steps:
            continue
        opt.zero_grad()
        for x, y in zip(xs, ys):
            x, y = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
            if mode == "checkpoint":  # the middle unit recomputed in backward
                h = model[1](model[0](x))
                h = torch.utils.checkpoint.checkpoint(model[2], h, use_reentrant=False)
                out = model[4](model[3](h))
            else:
                out = model(x)
            (F.mse_loss(out, y) / passes).backward()
        if mode == "clip":  # torch's own, on the model's parameters (ronde's patch)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()


def _stage3_outcome(torch, hvd, model, opt, ref, case: str) -> dict:
    held = sum(p.numel() for p in model.parameters())  # between steps: nothing whole
    kept = sum(b.own.numel() for b in opt.shard_layout.buckets)
    per = sum(b.per for b in opt.shard_layout.buckets)
    # and no bucket holds a whole buffer
    flat = sum(b.storage is not None for b in opt.shard_layout.buckets)
    with opt.whole_parameters():
        diff = _diff(torch, model, ref)
        same = _same_on_every_rank(torch, hvd, model, f"stage3.{case}")
    return {"diff": diff, "same": same, "held": held, "kept": kept, "per": per,
            "flat": flat}


def stage3(directory: str, phase: str) -> dict:
    """ShardedOptimizer(stage=3) against one process on the global batch (Adam, float64):
    phase "train", cases plain, accumulation (2 passes), torch's clip_grad_norm_ on the
    model's parameters, activation checkpointing of a unit, evaluation under no_grad,
    the model's state_dict() refused and inside whole_parameters(), then save_sharded;
    phase "resume" (any N): load_sharded and two more steps; phase "plain" (one
    process): load_sharded into a plain model and torch.optim.Adam."""
    import os

    torch, hvd = _setup()
    out: dict = {}
    make = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)  # noqa: E731
    if phase == "train":
        for mode in ("plain", "accum", "clip", "checkpoint"):
            model, ref = _stack3(torch), _stack3(torch)
            opt = hvd.ShardedOptimizer(make(model), named_parameters=model.named_parameters(),
                                       stage=3, model=model,
                                       backward_passes_per_step=2 if mode == "accum" else 1)
            ref_opt = make(ref)
            _stage3_steps(torch, hvd, model, opt, ref, ref_opt, 4, mode=mode)
            out[mode] = _stage3_outcome(torch, hvd, model, opt, ref, mode)
        x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            out["eval"] = float((model(x) - ref(x)).abs().max())
        out["refused"] = _refused(hvd, model.state_dict)
        with opt.whole_parameters():
            out["state_dict"] = sorted(k for k in model.state_dict())
        hvd.save_sharded(directory, model, opt)  # (the "checkpoint" case, 4 steps)
    elif phase == "resume":
        model, ref = _stack3(torch), _stack3(torch)
        opt = hvd.ShardedOptimizer(make(model), named_parameters=model.named_parameters(),
                                   stage=3, model=model)
        ref_opt = make(ref)
        hvd.load_sharded(directory, model, opt)
        _stage3_steps(torch, hvd, model, opt, ref, ref_opt, 2, skip=4)
        out["resume"] = _stage3_outcome(torch, hvd, model, opt, ref, "resume")
    else:  # one process, a plain model and optimizer
        model, ref = _stack3(torch), _stack3(torch)
        opt, ref_opt = make(model), make(ref)
        hvd.load_sharded(directory, model, opt)
        _stage3_steps(torch, hvd, model, opt, ref, ref_opt, 0, skip=4, model_steps=False)
        out["plain"] = _diff(torch, model, ref)
        out["files"] = sorted(os.listdir(directory))[:1]
    hvd.shutdown()
    return out


def stage3_refusals() -> list:
    """What stage 3 refuses, each message: no model, a parameter in two units, a
    parameter in no unit, an elastic relayout."""
    torch, hvd = _setup()
    nn = torch.nn
    out = []
    m = _stack3(torch)
    try:
        hvd.ShardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), stage=3)
        out.append("accepted")
    except TypeError as exc:
        out.append(f"TypeError: {exc}")
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    out.append(_refused(hvd, lambda: hvd.ShardedOptimizer(
        torch.optim.SGD(tied.parameters(), lr=0.1), stage=3, model=tied)))
    root = nn.Sequential(nn.Linear(4, 4))  # and a parameter of its own, in no child
    root.register_parameter("scale", nn.Parameter(torch.ones(4)))
    out.append(_refused(hvd, lambda: hvd.ShardedOptimizer(
        torch.optim.SGD(root.parameters(), lr=0.1), stage=3, model=root)))
    opt = hvd.ShardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), stage=3, model=m)
    out.append(_refused(hvd, opt.relayout))
    hvd.shutdown()
    return out
