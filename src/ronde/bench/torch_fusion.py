"""ResNet-50's gradient set as torch tensors through ``ronde.torch``: what
``DistributedOptimizer`` does each step (161 ``allreduce_async_`` calls, then waits),
against one torch buffer of the same size, alternated iteration by iteration.

    ronderun -np 2 python -m ronde.bench.torch_fusion [--iters 20]

Prints one JSON line (rank 0): median milliseconds of each, their ratio, and the median
time of the 161 submissions alone. Needs torch. torch allocates its tensors on 4 KiB
pages, so this also shows what ``RONDE_HUGEPAGES`` does for torch users.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Sequence

import numpy as np


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)

    import torch

    import ronde.torch as hvd

    from ._resnet import resnet50_grad_shapes

    hvd.init()
    torch.set_num_threads(1)
    shapes = resnet50_grad_shapes()
    total = sum(int(np.prod(s)) for s in shapes)
    single = torch.ones(total)
    tensors = [torch.full(s, 1.0) for s in shapes]
    names = [f"grad.{i}" for i in range(len(shapes))]
    submit: list[float] = []

    def many() -> None:
        t0 = time.perf_counter()
        hs = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(tensors, names)]
        submit.append(time.perf_counter() - t0)
        for h in hs:
            hvd.synchronize(h)

    def one() -> None:
        hvd.synchronize(hvd.allreduce_async_(single, name="single", op=hvd.Sum))

    for _ in range(3):
        one()
        many()
    submit.clear()
    times: dict[str, list[float]] = {"single": [], "tensors": []}
    for _ in range(args.iters):
        for key, fn in (("single", one), ("tensors", many)):
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
    if hvd.rank() == 0:
        med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
        print(json.dumps({"case": "torch_fusion", "np": hvd.size(), "tensors": len(shapes),
                          "bytes": total * 4, "single_ms": round(med["single"], 3),
                          "tensors_ms": round(med["tensors"], 3),
                          "ratio": round(med["tensors"] / med["single"], 3),
                          "submit_ms": round(float(np.median(submit)) * 1e3, 3)}))
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
