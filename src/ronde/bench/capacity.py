"""The largest model each contender trains in a memory budget per rank:
``python -m ronde.bench memory --capacity [--np 2,4] [--budget-mib 1536] [--steps 12]``.

The model is a stack of ``torch.nn.Linear(2048, 2048)`` layers (4,196,352 parameters
each, bias included), fp32, trained with ``torch.optim.AdamW`` at its defaults on a batch
of 8 rows (loss: the mean square of the output), one torch thread per rank; each
contender is built by :func:`ronde.bench.memory.build` as in the memory bench:
``distributed``, ``stage1``, ``stage2``, ``stage3`` (ronde), ``zero`` and ``zero-views``
(``ZeroRedundancyOptimizer`` inside DDP with ``gradient_as_bucket_view`` off / on),
``fsdp2`` (``fully_shard`` on Gloo). Every setting is the library's default, as users run
them; the one exception, ``torch.set_flush_denormal(True)``, changes no byte: the
gradients of a deep stack's first layers are tiny enough for Adam's squares to be
denormal, which only slows the arithmetic.

A *probe* runs ``--steps`` steps of a model of L layers in N ranks started by
``ronde.runner.launch`` (as ``ronderun``; torch's contenders meet on the ``MASTER_ADDR``
it gives), each rank in a cgroup of its own limited to the budget
(:mod:`ronde.bench._cgroup`: it joins at its start, before importing torch). It *fits* if
every rank finished every step; a rank the kernel killed for memory (the cgroup's OOM
count, or SIGKILL) means it does not, and so does a probe past ``--timeout-s`` (a rank
paging at its limit); any other failure stops the contender with its error. Where no
cgroup can be made (or with ``--cap rss``) the ranks run uncapped and a probe fits if
every rank's peak RSS (``ru_maxrss``) stayed within the budget; every row says which.

For each contender and N: the probe of one layer first (it gives the fixed cost, below),
then a binary search over the number of layers (:func:`largest_fitting`) from 1 to
``--max-layers``, whose first probe is at the formula's capacity. Reported: the largest
L that fits and its parameters; the fixed cost, the memory charged to the rank after
the one-layer model's first step (the cgroup's usage; RSS without a cgroup) less that
model's formula bytes, i.e. torch, ronde and what the step keeps beyond the formula;
ZeRO's capacity ``(budget - fixed) / bytes per parameter`` (:func:`bytes_per_param`) and
the largest model as a share of it; the peak RSS and the peak charge of the largest run
that fit (the largest over ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import json
import os
import resource
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from . import _cgroup

WIDTH = 2048
BATCH = 8
#: parameters of one layer: a 2048x2048 weight and its bias
LAYER_PARAMS = WIDTH * WIDTH + WIDTH
CONTENDERS = ("distributed", "stage1", "stage2", "stage3", "zero", "zero-views", "fsdp2")
MIB = 1 << 20


def bytes_per_param(contender: str, n: int) -> float:
    """ZeRO's bytes a parameter for fp32 Adam: 4 of weights, 4 of gradients, 8 of state,
    each divided by ``n`` where the contender shards it."""
    per = {"distributed": 16.0, "stage1": 8 + 8 / n, "stage2": 4 + 12 / n, "stage3": 16 / n,
           "zero": 8 + 8 / n, "zero-views": 8 + 8 / n, "fsdp2": 16 / n}
    if contender not in per:
        raise ValueError(f"unknown contender {contender!r}; choose from {', '.join(per)}")
    return per[contender]


def formula_params(budget_bytes: float, fixed_bytes: float, per_param: float) -> float:
    """ZeRO's capacity: the parameters whose formula bytes fill the budget after the fixed
    cost (0 where the fixed cost alone is over it)."""
    return max(0.0, (budget_bytes - fixed_bytes) / per_param)


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int,
                    first: int | None = None) -> int:
    """The largest ``k`` in ``[lo, hi)`` with ``fits(k)``, for a ``fits`` that is true up
    to some ``k`` and false after: ``fits(lo)`` is known true and ``hi`` is taken to fail
    (neither is called). ``first``, where strictly between them, is tried first (a good
    guess saves probes); then halves."""
    if first is not None and lo < first < hi:
        if fits(first):
            lo = first
        else:
            hi = first
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclasses.dataclass
class Probe:
    """One run of a model of ``layers`` layers: whether it fit and what it took (the
    largest over ranks; None where not measured)."""

    layers: int
    fits: bool
    reason: str  # "fits", "oom", "over budget", "timeout"
    wall_s: float
    peak_rss: int | None = None
    peak_charged: int | None = None
    first_step_rss: int | None = None
    first_step_charged: int | None = None


class ProbeError(RuntimeError):
    """A probe failed for a reason other than memory (the contender cannot run here)."""


@dataclasses.dataclass
class Settings:
    """What every probe of one run shares."""

    budget_bytes: int
    steps: int
    timeout_s: float
    hierarchy: _cgroup.Hierarchy | None  # None: uncapped, judged by peak RSS

    @property
    def method(self) -> str:
        return f"cgroup v{self.hierarchy.version}" if self.hierarchy else "peak RSS"


#: numbers the probes of this process (in their cgroups' names)
_PROBES = itertools.count(1)


def run_probe(contender: str, n: int, layers: int, settings: Settings) -> Probe:
    """Train ``layers`` layers for ``settings.steps`` steps in ``n`` capped ranks.

    Raises:
        ProbeError: a rank failed, not for memory (its output's tail in the message).
    """
    from ..runner import launch

    number = next(_PROBES)
    caps: list[_cgroup.Cap] = []
    t0 = time.monotonic()
    try:
        for rank in range(n) if settings.hierarchy is not None else ():
            caps.append(_cgroup.create(settings.hierarchy, f"{cgroup_prefix()}{number}-{rank}",
                                       settings.budget_bytes))
        with tempfile.TemporaryDirectory(prefix="ronde-capacity-") as out_dir:
            spec = {"contender": contender, "layers": layers, "steps": settings.steps,
                    "caps": [dataclasses.asdict(c) for c in caps], "out": out_dir}
            log = io.StringIO()
            result = launch.run([sys.executable, "-m", "ronde.bench.capacity", "--worker",
                                 json.dumps(spec)], n, env={"OMP_NUM_THREADS": "1"},
                                stdout=log, stderr=log, timeout_s=settings.timeout_s,
                                start_timeout_s=min(120.0, settings.timeout_s))
            ranks = []
            for rank in range(n):
                try:
                    with open(os.path.join(out_dir, f"rank.{rank}.json"), encoding="utf-8") as f:
                        ranks.append(json.load(f))
                except OSError:
                    pass
        probe = Probe(layers, False, "fits", round(time.monotonic() - t0, 1))
        for key in ("peak_rss", "first_step_rss", "first_step_charged"):
            values = [r[key] for r in ranks if r.get(key) is not None]
            setattr(probe, key, max(values) if values else None)
        charged = [v for v in (_cgroup.peak_bytes(c) for c in caps) if v is not None]
        probe.peak_charged = max(charged) if charged else None
        if result.returncode in (130, 143):
            raise KeyboardInterrupt(result.cause)
        if result.returncode == 0 and len(ranks) == n:
            over = settings.hierarchy is None and (probe.peak_rss or 0) > settings.budget_bytes
            probe.fits, probe.reason = not over, "over budget" if over else "fits"
        elif any(_cgroup.oom_kills(c) for c in caps) or -9 in result.exit_codes:
            probe.reason = "oom"
        elif result.returncode == 124:
            probe.reason = "timeout"
        else:
            raise ProbeError(f"{contender} at np={n} with {layers} layer(s) failed: "
                             f"{result.cause}\n{log.getvalue()[-3000:]}")
        return probe
    finally:
        for cap in caps:
            _cgroup.remove(cap)


def cgroup_prefix() -> str:
    """The name every cgroup of this run begins with (``ronde-bench-<pid>-``)."""
    return f"ronde-bench-{os.getpid()}-"


def worker(spec: dict[str, Any]) -> None:
    """One rank of a probe (started by :func:`run_probe`): join this rank's cgroup, then
    import torch, train, write ``rank.<r>.json`` into ``spec["out"]``."""
    from ..runner.env import detect

    where = detect()
    cap = _cgroup.Cap(**spec["caps"][where.rank]) if spec["caps"] else None
    if cap is not None:
        _cgroup.join(cap.path)
    import torch

    from ..transport.hugepages import resident_bytes
    from .memory import RONDE, build

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # speed only: see the module docstring
    contender = spec["contender"]
    if contender in RONDE:
        import ronde.torch as hvd

        hvd.init()
    else:
        import torch.distributed as dist

        host, port = where.master or ("127.0.0.1", 29500)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=where.rank,
                                world_size=where.size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(spec["layers"])])
    model, opt = build(torch, contender, model, torch.optim.AdamW, lr=1e-3)  # AdamW's default
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(where.rank))
    out: dict[str, Any] = {}
    for step in range(spec["steps"]):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if step == 0:
            out = {"first_step_rss": resident_bytes(),
                   "first_step_charged": _cgroup.usage_bytes(cap) if cap else None}
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(spec["out"], f"rank.{where.rank}.json"), "w",
              encoding="utf-8") as fh:
        json.dump(out, fh)
    if contender in RONDE:
        hvd.shutdown()
        return
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the memory bench: no Gloo teardown after a finished measurement


def capacity(contender: str, n: int, settings: Settings, max_layers: int) -> dict[str, Any]:
    """Search the largest model ``contender`` trains at ``n`` ranks; returns its point."""
    probes: dict[int, Probe] = {}

    def fits(layers: int) -> bool:
        probe = run_probe(contender, n, layers, settings)
        probes[layers] = probe
        print(f"capacity: {contender} np={n} {layers} layer(s): {probe.reason} "
              f"(peak RSS {_mib(probe.peak_rss)} MiB, charged {_mib(probe.peak_charged)} "
              f"MiB, {probe.wall_s} s)", file=sys.stderr, flush=True)
        return probe.fits

    per_param = bytes_per_param(contender, n)
    point: dict[str, Any] = {"case": "capacity", "contender": contender, "np": n,
                             "budget_mib": settings.budget_bytes / MIB,
                             "steps": settings.steps, "method": settings.method,
                             "bytes_per_param": round(per_param, 3)}
    largest = 0
    if fits(1):
        one = probes[1]
        reading = one.first_step_charged if settings.hierarchy else one.first_step_rss
        fixed = (reading or 0) - per_param * LAYER_PARAMS
        formula = formula_params(settings.budget_bytes, fixed, per_param)
        point.update(fixed_mib=_mib(fixed), fixed_rss_mib=_mib(
            (one.first_step_rss or 0) - per_param * LAYER_PARAMS),
            formula_params_m=round(formula / 1e6, 1))
        largest = largest_fitting(fits, 1, max_layers + 1, int(formula // LAYER_PARAMS))
        point["of_formula"] = round(largest * LAYER_PARAMS / formula, 3) if formula else None
    best = probes.get(largest)
    point.update(layers=largest, params_m=round(largest * LAYER_PARAMS / 1e6, 1),
                 at_bound=largest == max_layers,
                 peak_rss_mib=_mib(best.peak_rss) if best else None,
                 peak_charged_mib=_mib(best.peak_charged) if best else None,
                 probes=[[k, probes[k].reason] for k in sorted(probes)],
                 wall_s=round(sum(p.wall_s for p in probes.values()), 1))
    return point


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def print_table(points: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    """The points as a table, then each ronde contender's largest model over zero-views'."""
    print("\n| contender | N | cap | layers | params M | fixed MiB | B/param | formula M | "
          "of formula | peak RSS MiB | peak charged MiB | probes |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for p in points:
        if "error" in p:
            print(f"| {p['contender']} | {p['np']} | did not run | | | | | | | | | |", file=out)
            continue
        share = f"{100 * p['of_formula']:.0f} %" if p.get("of_formula") is not None else ""
        print(f"| {p['contender']} | {p['np']} | {p['method']} | "
              f"{'>= ' if p['at_bound'] else ''}{p['layers']} | {p['params_m']} | "
              f"{p.get('fixed_mib', '')} | {p['bytes_per_param']:g} | "
              f"{p.get('formula_params_m', '')} | {share} | {p['peak_rss_mib'] or ''} | "
              f"{p['peak_charged_mib'] or ''} | {len(p['probes'])} |", file=out)
    by = {(p["contender"], p["np"]): p for p in points if "error" not in p}
    for n in sorted({p["np"] for p in points}):
        ref = by.get(("zero-views", n))
        if not ref or not ref["layers"]:
            continue
        ratios = [f"{c} {by[(c, n)]['layers'] / ref['layers']:.2f}"
                  for c in ("distributed", "stage1", "stage2", "stage3") if (c, n) in by]
        if ratios:
            print(f"np={n}, largest model over zero-views': {', '.join(ratios)}", file=out)
    print("(the largest over ranks; fixed: the charge after the one-layer model's first "
          "step less its formula bytes; formula: ZeRO's (budget - fixed) / bytes a "
          "parameter; peak RSS and charge: of the largest run that fit)", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m ronde.bench memory --capacity",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacity", action="store_true", help="this mode (always on here)")
    p.add_argument("--np", default="2,4", help="comma list of rank counts (default 2,4)")
    p.add_argument("--budget-mib", type=float, default=1536.0,
                   help="memory per rank in MiB (default 1536)")
    p.add_argument("--steps", type=int, default=12, help="steps a probe trains (default 12)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--max-layers", type=int, default=96,
                   help="the search's upper bound in layers (default 96)")
    p.add_argument("--cap", choices=("auto", "cgroup", "rss"), default="auto",
                   help="cgroup where one can be made (auto), required (cgroup), or none: "
                        "judge by peak RSS (rss)")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="limit per probe; a probe past it does not fit (default 600)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    contenders = [c for c in args.contenders.split(",") if c]
    try:
        for c in contenders:
            bytes_per_param(c, 1)
        sizes = [int(v) for v in args.np.split(",") if v.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if args.steps < 1 or args.max_layers < 1 or any(n < 1 for n in sizes):
        p.error("--steps, --max-layers and --np must be at least 1")
    hierarchy = None if args.cap == "rss" else _cgroup.find_hierarchy()
    if hierarchy is None and args.cap == "cgroup":
        p.error("no memory cgroup can be made here (needs root and a writable "
                "/sys/fs/cgroup); use --cap rss to judge by peak RSS instead")
    settings = Settings(int(args.budget_mib * MIB), args.steps, args.timeout_s, hierarchy)
    print(f"ronde.bench memory --capacity: np={args.np} budget={args.budget_mib:g} MiB "
          f"steps={args.steps} max-layers={args.max_layers} cap={settings.method}"
          + (f" (cgroups {hierarchy.parent}/{cgroup_prefix()}*)" if hierarchy else ""),
          file=sys.stderr, flush=True)
    points = []
    for n in sizes:
        for c in contenders:
            try:
                point = capacity(c, n, settings, args.max_layers)
            except ProbeError as exc:
                point = {"case": "capacity", "contender": c, "np": n, "error": str(exc)[-600:]}
            print(json.dumps(point), flush=True)
            points.append(point)
    print_table(points)
    return 1 if any("error" in pt for pt in points) else 0


if __name__ == "__main__":
    raise SystemExit(main())
