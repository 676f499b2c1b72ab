"""Memory of a training step per rank: ``python -m ronde.bench memory [--np 1,2,4]``.

A model of about 20 M fp32 parameters (four 1024-2304-1024 MLP blocks and a 1024x1024
head: 19.9 M) trains with Adam, one thread per rank, for each contender:

* ``distributed``: ``ronde.torch.DistributedOptimizer`` (every rank holds everything);
* ``stage1``, ``stage2``, ``stage3``: ``ronde.torch.ShardedOptimizer(stage=1 | 2 | 3)``
  (stage 3 with ``model=``: the parameters sharded too, its ``Linear`` layers the units);
* ``zero``: torch's ``ZeroRedundancyOptimizer`` inside ``DistributedDataParallel`` (Gloo);
  ``zero-views`` (not in the default list) the same with DDP's
  ``gradient_as_bucket_view=True``;
* ``fsdp2``: torch's ``fully_shard`` (FSDP2) on Gloo, where it runs;
* ``torch``: plain ``torch.optim.Adam`` in one process (N=1 only): what torch itself
  grows by beyond the formula (Adam's ``foreach`` temporaries, the allocator).

Per rank (the largest over ranks): the optimizer state's bytes after the last step; the
gradient bytes held right after the last ``backward()`` (``p.grad`` plus the library's
own gradient buffers where they can be counted: ronde's buckets and slices); the growth
of peak RSS over the RSS with the model built and torch's kernels paged in (below); and
the median step time. Beside them,
ZeRO's formula for the state (``8 P`` bytes for Adam, ``8 P / N`` sharded), and the bound
issue #52 sets the growth: that formula with the gradients', plus two buckets (25 MiB
each) and the inner optimizer's temporaries (torch's single-tensor Adam, the CPU's
default: two of the largest tensor it steps on). Prints one JSON line per point, then a
table.

Paged in first: the first forward, backward and Adam step of a process touch some 80 MB
of torch's own code and tables (file pages of ``libtorch_cpu.so``, counted in RSS), the
same for every contender and nothing a training step allocates: a small model of the
same layers takes one step before the baseline is read (:func:`_page_in`), so that the
growth is the step's memory. One process with plain Adam (``foreach=False``) then grows
260 MB against the 239 MB of ZeRO's formula (gradients and state), 383 MB without it.

``--capacity`` is another measurement, the largest model each contender trains under a
memory cap per rank: :mod:`ronde.bench.capacity` (it builds its contenders with
:func:`build`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

from ._gloo import free_port

RONDE = ("distributed", "stage1", "stage2", "stage3")
#: a bucket's bytes at the defaults (ronde's ``RONDE_BUCKET_BYTES``, DDP's ``bucket_cap_mb``)
BUCKET_BYTES = 25 * 1024 * 1024
TORCH = ("zero", "fsdp2")
#: ZeroRedundancyOptimizer inside DDP: gradients copied into DDP's buckets, or views of them
ZERO = ("zero", "zero-views")
#: one process, no distribution: the reference for the peak RSS (N=1 only)
ALONE = "torch"


def _model(torch: Any) -> Any:
    nn = torch.nn
    torch.manual_seed(0)
    blocks: list[Any] = []
    for _ in range(4):
        blocks += [nn.Linear(1024, 2304), nn.ReLU(), nn.Linear(2304, 1024), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(1024, 1024))


def _page_in(torch: Any) -> None:
    """One step of a small model of the same layers (Linear, ReLU, Adam): torch's code
    and tables for them paged in before the baseline RSS is read."""
    nn = torch.nn
    small = nn.Sequential(nn.Linear(1024, 64), nn.ReLU(), nn.Linear(64, 1024))
    for foreach in (False, True):
        adam = torch.optim.Adam(small.parameters(), lr=1e-4, foreach=foreach)
        small(torch.randn(8, 1024)).pow(2).mean().backward()
        adam.step()
        adam.zero_grad()


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _bytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's
    return local.numel() * local.element_size()


def measure(contender: str, rank: int, world: int, steps: int, warmup: int) -> dict:
    """Train in this process (the distributed runtime already set up); returns this
    rank's figures."""
    import torch

    torch.set_num_threads(1)
    model = _model(torch)
    _page_in(torch)
    rss0 = _rss()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for p in model.parameters())
    model, opt = build(torch, contender, model, torch.optim.Adam)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 1024, generator=gen)
    times, grad_bytes = [], 0
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if i == warmup + steps - 1:
            grad_bytes = _distinct_bytes([p.grad for p in model.parameters()
                                          if p.grad is not None] + _library_grads(opt))
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    inner = opt.optim if contender in ZERO else opt
    state_bytes = sum(_bytes(v) for st in inner.state.values() for v in st.values()
                      if torch.is_tensor(v))
    # the inner optimizer's temporaries: torch's single-tensor Adam (the CPU's default)
    # makes two of the tensor it steps on (sqrt, then the division), the largest counts
    stepped = [p for g in inner.param_groups for p in g["params"]]
    temp_bytes = 2 * max((_bytes(p) for p in stepped), default=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"params": params, "state_bytes": state_bytes, "grad_bytes": grad_bytes,
            "temp_bytes": temp_bytes,
            "peak_rss_growth": max(0, peak - max(base, rss0)),
            "step_ms": 1e3 * statistics.median(times)}


def build(torch: Any, contender: str, model: Any, optimizer_class: Any,
          lr: float = 1e-4) -> tuple[Any, Any]:
    """The model as ``contender`` trains it and its optimizer (``optimizer_class``, its
    defaults but ``lr``), in a process where ronde or torch.distributed is set up.

    Returns:
        ``(model, optimizer)``: the model wrapped in DDP for ``zero`` and ``zero-views``,
        its ``Linear`` layers and itself sharded in place for ``fsdp2``. The state is
        ``optimizer.state`` (``optimizer.optim.state`` for ZeRO).
    """
    if contender in RONDE:
        import ronde.torch as hvd

        inner = optimizer_class(model.parameters(), lr=lr)
        if contender == "distributed":
            return model, hvd.DistributedOptimizer(
                inner, named_parameters=model.named_parameters())
        stage = int(contender[-1])
        return model, hvd.ShardedOptimizer(inner, named_parameters=model.named_parameters(),
                                           stage=stage, model=model if stage == 3 else None)
    if contender == ALONE:
        return model, optimizer_class(model.parameters(), lr=lr)
    if contender in ZERO:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=contender == "zero-views")
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer_class,
                                            lr=lr)
    if contender == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
        return model, optimizer_class(model.parameters(), lr=lr)
    raise ValueError(f"unknown contender {contender!r}; choose from "
                     f"{', '.join((ALONE,) + RONDE + ZERO + ('fsdp2',))}")


def _library_grads(opt: Any) -> list[Any]:
    """Gradient buffers ronde's optimizers hold besides ``p.grad``."""
    layout = getattr(opt, "shard_layout", None)
    if layout is not None:  # ShardedOptimizer: buffers in flight and the slices
        return [t for b in layout.buckets for t in (b.buf, b.slice) if t is not None]
    return [b.flat for b in getattr(getattr(opt, "gradient_buckets", None), "buckets", ())]


def _distinct_bytes(tensors: list[Any]) -> int:
    """Bytes of the memory behind ``tensors``, each block once: a gradient that is a view
    of a bucket (``RONDE_GRADIENT_AS_BUCKET_VIEW``) is the bucket's memory, not more."""
    blocks: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor
        storage = local.untyped_storage()
        blocks[storage.data_ptr()] = max(blocks.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(blocks.values())


def ronde_worker(contender: str, steps: int, warmup: int) -> dict:
    import ronde.torch as hvd

    hvd.init()
    out = measure(contender, hvd.rank(), hvd.size(), steps, warmup)
    hvd.shutdown()
    return out


def _torch_worker(spec: str, contender: str, steps: int, warmup: int) -> None:
    import torch.distributed as dist

    rank, world, port = (int(v) for v in spec.split(","))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    out = measure(contender, rank, world, steps, warmup)
    dist.barrier()
    print(json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)  # see train.py: no Gloo teardown that could abort a finished measurement


def _run_torch(contender: str, n: int, steps: int, warmup: int, timeout_s: float) -> list:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-m", "ronde.bench.memory", "--torch-worker",
                               f"{r},{n},{port}", "--contenders", contender, "--steps",
                               str(steps), "--warmup", str(warmup)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{contender} at np={n}: timed out")
        if p.returncode != 0:
            raise RuntimeError(f"{contender} at np={n} failed (exit {p.returncode}): "
                               f"{se.strip().splitlines()[-1] if se.strip() else ''}")
        out.append(json.loads(so.strip().splitlines()[-1]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m ronde.bench memory", description=__doc__)
    p.add_argument("--np", default="1,2,4")
    p.add_argument("--contenders", default=",".join((ALONE,) + RONDE + TORCH))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--torch-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    contenders = [c for c in args.contenders.split(",") if c]
    if args.torch_worker:
        _torch_worker(args.torch_worker, contenders[0], args.steps, args.warmup)
        return 0
    from ..testing import run_ranks
    from . import memory as importable

    rows = []
    for n in [int(v) for v in args.np.split(",") if v.strip()]:
        for c in contenders:
            if c == ALONE and n != 1:
                continue
            try:
                if c in RONDE or c == ALONE:
                    per_rank = run_ranks(n, importable.ronde_worker, c, args.steps, args.warmup,
                                         timeout_s=args.timeout_s, env={"OMP_NUM_THREADS": "1"})
                else:
                    per_rank = _run_torch(c, n, args.steps, args.warmup, args.timeout_s)
            except Exception as exc:  # noqa: BLE001 - a contender that cannot run here
                print(json.dumps({"case": "memory", "contender": c, "np": n,
                                  "error": str(exc)[-300:]}), flush=True)
                rows.append((c, n, None))
                continue
            point = {"case": "memory", "contender": c, "np": n,
                     "params": per_rank[0]["params"],
                     **{k: max(r[k] for r in per_rank) for k in
                        ("state_bytes", "grad_bytes", "temp_bytes", "peak_rss_growth",
                         "step_ms")}}
            print(json.dumps(point), flush=True)
            rows.append((c, n, point))
    print("\n| contender | N | state MB/rank | formula MB | state/formula | grad MB/rank | "
          "peak RSS growth MB | state+grad formula MB | growth/formula | bound MB | "
          "within bound | step ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c, n, pt in rows:
        if pt is None:
            print(f"| {c} | {n} | did not run | | | | | | | | | |")
            continue
        sharded = c not in ("distributed", ALONE)
        formula = 8 * pt["params"] / (n if sharded else 1)
        # ZeRO's gradients: whole (4 P) but at stage 2 and FSDP's, sharded (4 P / N)
        grads = 4 * pt["params"] / (n if c in ("stage2", "stage3", "fsdp2") else 1)
        # #52's bound: the formula, two buckets in flight, the inner optimizer's temporaries
        bound = formula + grads + 2 * BUCKET_BYTES + pt.get("temp_bytes", 0)
        print(f"| {c} | {n} | {pt['state_bytes'] / 1e6:.1f} | {formula / 1e6:.1f} | "
              f"{pt['state_bytes'] / formula:.3f} | {pt['grad_bytes'] / 1e6:.1f} | "
              f"{pt['peak_rss_growth'] / 1e6:.1f} | {(formula + grads) / 1e6:.1f} | "
              f"{pt['peak_rss_growth'] / (formula + grads):.2f} | {bound / 1e6:.1f} | "
              f"{'yes' if pt['peak_rss_growth'] <= bound else 'no'} | {pt['step_ms']:.0f} |")
    print("(the largest over ranks; fp32 Adam; formula: ZeRO's 8 P bytes of Adam state, / N "
          "where sharded; grad = p.grad after backward plus ronde's own gradient buffers; "
          "peak RSS growth over the RSS with the model built and torch's kernels paged in; "
          "state+grad formula: that state plus 4 P of gradients, / N at stage 2 and FSDP2; "
          "bound: that plus two buckets of 25 MiB and the inner optimizer's temporaries, "
          "two of the largest tensor it steps on)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
