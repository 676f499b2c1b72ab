"""Where the time of the fusion case goes: per-stage timers around the engine's steps.

    ronderun -np 2 python -m ronde.bench.fusion_stages [--iters 60]

ResNet-50's gradient set three ways, alternated op by op as in ``python -m ronde.bench
fusion``: one buffer (``single``), 161 views of one buffer (``views``) and 161
separately allocated arrays (``tensors``). Each rank prints one JSON line per variant:
milliseconds per op of the whole op (``total``), of the 161 submissions (``submit``),
of the wait, and of each stage inside (building, exchanging and applying the round,
the executor, the single-copy data path and its reads, writes and reductions), summed
over the op; and, where ``/proc/self/pagemap`` and ``/proc/kpageflags`` are readable
(root), the share of the variant's memory still on 4 KiB pages.

A developer's tool: the timers wrap internal functions (a few hundred nanoseconds
each), so ``total`` runs a little above ``python -m ronde.bench fusion``'s numbers;
the stages say where the difference between the variants lies.
"""

from __future__ import annotations

import argparse
import collections
import json
import struct
import time
from typing import Any, Callable, Sequence

import numpy as np

_ACC: dict[str, float] = collections.defaultdict(float)


def _wrap(owner: Any, attr: str, label: str) -> None:
    fn = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _ACC[label] += time.perf_counter() - t

    setattr(owner, attr, timed)


def _instrument() -> None:
    from ..core import engine, exchange, executor, negotiation
    from ..transport.shm import counters, single_copy

    _wrap(engine.Engine, "_build_message", "round.build")
    _wrap(exchange.Exchange, "run", "round.exchange")
    _wrap(negotiation.Negotiator, "apply_round", "round.apply")
    _wrap(executor.Executor, "execute", "execute")
    _wrap(single_copy, "allreduce", "data")
    _wrap(single_copy, "coalesce", "data.coalesce")
    _wrap(single_copy, "read_into", "data.read")
    _wrap(single_copy, "write_into", "data.write")
    _wrap(single_copy, "reduce_in_rank_order", "data.read+reduce")
    _wrap(counters.Counters, "wait_all", "data.wait")


def small_page_share(arrays: Sequence[np.ndarray]) -> float | None:
    """The share of the arrays' bytes on 4 KiB pages (not in a transparent huge page),
    or None where the page flags cannot be read."""
    page = 4096
    small = total = 0
    try:
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            for a in arrays:
                lo = a.ctypes.data // page
                hi = (a.ctypes.data + a.nbytes - 1) // page + 1
                pm.seek(lo * 8)
                for entry in struct.unpack(f"{hi - lo}Q", pm.read((hi - lo) * 8)):
                    total += 1
                    pfn = entry & ((1 << 55) - 1)
                    if not entry >> 63 or not pfn:
                        small += 1
                        continue
                    kf.seek(pfn * 8)
                    if not (struct.unpack("Q", kf.read(8))[0] >> 22) & 1:  # KPF_THP
                        small += 1
    except (OSError, struct.error):
        return None
    return small / total if total else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)

    import ronde as hvd

    from ._resnet import resnet50_grad_shapes

    _instrument()
    hvd.init()
    r = hvd.rank()
    shapes = resnet50_grad_shapes()
    total = sum(int(np.prod(s)) for s in shapes)
    flat = np.full(total, r + 1.0, dtype=np.float32)
    views, off = [], 0
    for s in shapes:
        n = int(np.prod(s))
        views.append(flat[off: off + n].reshape(s))
        off += n
    variants: dict[str, list[np.ndarray]] = {
        "single": [np.full(total, r + 1.0, dtype=np.float32)],
        "views": views,
        "tensors": [np.full(s, r + 1.0, dtype=np.float32) for s in shapes]}
    names = {k: [f"{k}.{i}" for i in range(len(v))] for k, v in variants.items()}
    sums: dict[str, dict[str, float]] = {k: collections.defaultdict(float) for k in variants}
    submit_one: Callable[..., Any] = hvd.allreduce_async
    for i in range(args.warmup + args.iters):
        for key, arrays in variants.items():
            _ACC.clear()
            t0 = time.perf_counter()
            handles = [submit_one(a, name=n, op=hvd.Sum, out=a)
                       for a, n in zip(arrays, names[key])]
            t1 = time.perf_counter()
            for h in handles:
                h.wait()
            t2 = time.perf_counter()
            if i >= args.warmup:
                acc = sums[key]
                acc["total"] += t2 - t0
                acc["submit"] += t1 - t0
                acc["wait"] += t2 - t1
                for label, s in _ACC.items():
                    acc[label] += s
    for key, acc in sums.items():
        ms = {label: round(s / args.iters * 1e3, 3) for label, s in sorted(acc.items())}
        print(json.dumps({"fusion_stages": key, "rank": r, "tensors": len(variants[key]),
                          "ms_per_op": ms,
                          "small_page_share": small_page_share(variants[key])}))
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
