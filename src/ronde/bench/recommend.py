"""``python -m ronde.bench recommend``: the fusion threshold and cycle time to use here.

Runs a training-like workload on ``--np`` ranks of this machine: every step "computes"
for ``--compute-ms`` (sleeping, spread over the backward pass the way gradients become
ready: the last layer's first) and allreduces each gradient as it becomes ready, then
waits for all of them; the gradient sizes are ResNet-50's (``--model resnet50``, the
default), a small CNN's or transformer's (``cnn``, ``transformer``: needs torch), or
yours (``--sizes FILE``: a JSON list of element counts or shapes, in parameter order,
e.g. ``json.dump([p.numel() for p in model.parameters()], f)``).

1. One job runs the autotuner (docs/autotune.md) to the end and reports its best values.
2. Jobs with the configured values (the defaults, or what you set) and with the
   recommended ones then alternate (``--rounds``), each timing ``--steps`` steps after
   warming up; the median step time of the slowest rank is compared.

Prints the recommended variables and ``ronderun`` flags, and the measured gain; when the
recommendation is not measurably faster (under 2 %), it says to keep the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Sequence

import numpy as np

_TUNED_VARS = ("RONDE_FUSION_THRESHOLD", "RONDE_CYCLE_TIME", "RONDE_INLINE_BYTES",
               "RONDE_SPIN_TIME")


def gradient_counts(model: str, sizes_file: str | None) -> list[int]:
    """Element counts per gradient, in parameter order."""
    if sizes_file:
        with open(sizes_file, encoding="utf-8") as fh:
            raw = json.load(fh)
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"{sizes_file}: expected a JSON list of element counts or shapes")
        return [int(np.prod(s)) if isinstance(s, list) else int(s) for s in raw]
    if model == "resnet50":
        from ._resnet import resnet50_grad_shapes

        return [int(np.prod(s)) for s in resnet50_grad_shapes()]
    import torch

    from .train import _model

    net, _, _ = _model(torch, model)
    return [p.numel() for p in net.parameters()]


def _step(hvd: Any, grads: list[np.ndarray], compute_s: float) -> None:
    total = sum(g.size for g in grads)
    handles = []
    for i in reversed(range(len(grads))):  # backward: the last layer's gradient first
        time.sleep(compute_s * grads[i].size / total)
        handles.append(hvd.allreduce_async(grads[i], name=f"grad.{i}"))
    for h in handles:
        hvd.synchronize(h)


def worker(counts: list[int], compute_ms: float, steps: int, warmup: int) -> dict[str, Any]:
    """One rank: ``warmup`` steps (the tuning, when RONDE_AUTOTUNE is on), then ``steps``
    timed ones; rank 0 also returns the tuner's verdict."""
    import ronde as hvd
    from ronde import _state

    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    grads = [rng.standard_normal(n).astype(np.float32) for n in counts]
    compute_s = compute_ms / 1000.0
    for _ in range(warmup):
        _step(hvd, grads, compute_s)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        _step(hvd, grads, compute_s)
        times.append(time.perf_counter() - t)
    slowest = max(hvd.allgather_object(float(np.median(times))))
    out: dict[str, Any] = {"step_s": slowest}
    tuner = _state.require().engine.autotune.tuner
    if tuner is not None:
        best = tuner.current
        out.update(done=tuner.done, samples=len(tuner.samples), values={
            "RONDE_FUSION_THRESHOLD": str(best.fusion_threshold_bytes),
            "RONDE_CYCLE_TIME": f"{best.cycle_time_ms:g}",
            "RONDE_INLINE_BYTES": str(best.inline_bytes),
            "RONDE_SPIN_TIME": f"{best.spin_time_us:g}"},
            default_score=tuner.samples[0][1] if tuner.samples else None)
    hvd.shutdown()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m ronde.bench recommend", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--model", default="resnet50", choices=("resnet50", "cnn", "transformer"))
    p.add_argument("--sizes", default=None, metavar="FILE",
                   help="JSON list of your gradients' element counts or shapes")
    p.add_argument("--compute-ms", type=float, default=50.0,
                   help="compute per step, spread over the backward pass (default 50)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per job (default 20)")
    p.add_argument("--rounds", type=int, default=3,
                   help="defaults/recommended jobs, alternating (default 3 each)")
    p.add_argument("--steps-per-sample", type=int, default=5,
                   help="RONDE_AUTOTUNE_STEPS_PER_SAMPLE for the search (default 5)")
    p.add_argument("--max-samples", type=int, default=12,
                   help="RONDE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES for the search (default 12)")
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.np < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--np, --steps and --rounds must be at least 1")
    from .. import _config
    from ..core.autotune import search_steps
    from ..testing import run_ranks
    from . import recommend as importable  # run_ranks imports the worker by module name

    counts = gradient_counts(args.model, args.sizes)
    what = (f"{len(counts)} gradients from {args.sizes}" if args.sizes
            else f"{args.model}'s {len(counts)} gradients")
    base_env = {k: v for k, v in os.environ.items() if k in _TUNED_VARS}
    tune_env = dict(base_env, RONDE_AUTOTUNE="1",
                    RONDE_AUTOTUNE_STEPS_PER_SAMPLE=str(args.steps_per_sample),
                    RONDE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES=str(args.max_samples))
    warm = search_steps(_config.load(tune_env))
    print(f"tuning on {args.np} ranks: {what} ({sum(counts) * 4 / 2**20:.1f} MiB float32), "
          f"{args.compute_ms:g} ms compute per step, {warm} steps ...", flush=True)
    t0 = time.perf_counter()
    tuned = run_ranks(args.np, importable.worker, counts, args.compute_ms, 1, warm,
                      timeout_s=args.timeout_s, env=tune_env)[0]
    if not tuned.get("done"):
        print(f"the search did not finish in {warm} steps ({tuned.get('samples')} samples)")
        return 1
    best_env = dict(tuned["values"])
    for var in base_env:  # a knob you set is not tuned: it stays as you set it
        best_env[var] = base_env[var]
    print(f"search done in {time.perf_counter() - t0:.0f} s, {tuned['samples']} samples",
          flush=True)
    times: dict[str, list[float]] = {"configured": [], "recommended": []}
    for _ in range(args.rounds):
        for label, env in (("configured", base_env), ("recommended", best_env)):
            r = run_ranks(args.np, importable.worker, counts, args.compute_ms, args.steps, 3,
                          timeout_s=args.timeout_s, env=env)[0]
            times[label].append(r["step_s"])
    conf, rec = float(np.median(times["configured"])), float(np.median(times["recommended"]))
    gain = conf / rec
    print(json.dumps({"case": "recommend", "np": args.np, "model": args.sizes or args.model,
                      "compute_ms": args.compute_ms, "configured_step_ms": round(conf * 1e3, 2),
                      "recommended_step_ms": round(rec * 1e3, 2), "gain": round(gain, 3),
                      "values": best_env}), flush=True)
    print(f"\nstep time, median of {args.rounds} jobs x {args.steps} steps (slowest rank): "
          f"configured {conf * 1e3:.1f} ms, recommended {rec * 1e3:.1f} ms ({gain:.2f}x)")
    if gain < 1.02:
        print("recommendation: keep the configured values (the search found nothing "
              "measurably faster here)")
        return 0
    mb = int(best_env["RONDE_FUSION_THRESHOLD"]) / 2**20
    print("recommendation: " + " ".join(f"{k}={v}" for k, v in best_env.items()))
    print(f"  (ronderun --fusion-threshold-mb {mb:g} --cycle-time-ms "
          f"{best_env['RONDE_CYCLE_TIME']}, plus -x for the other two)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
