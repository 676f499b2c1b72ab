"""``ronderun -np N python -m ronde.bench.adasum``: Adasum against Average on ResNet-50's
gradient set (161 float32 tensors, 25.6 M values: ``_resnet.py``), one step of async
allreduces each, the slowest rank's median of 3 (after one warm-up step)."""

from __future__ import annotations

import time

import numpy as np


def main() -> None:
    import ronde

    from ._resnet import resnet50_grad_shapes

    ronde.init()
    xs = [np.random.default_rng(ronde.rank() + i).standard_normal(int(np.prod(s)))
          .astype(np.float32) for i, s in enumerate(resnet50_grad_shapes())]
    for op, name in ((ronde.Average, "Average"), (ronde.Adasum, "Adasum")):
        times = []
        for _ in range(4):
            t = time.perf_counter()
            hs = [ronde.allreduce_async(x, op=op, name=f"{name}.{i}") for i, x in enumerate(xs)]
            for h in hs:
                ronde.synchronize(h)
            times.append(time.perf_counter() - t)
        worst = max(ronde.allgather_object(float(np.median(times[1:]))))
        if ronde.rank() == 0:
            print(f"{name}: {worst * 1e3:.0f} ms per step of ResNet-50's {len(xs)} "
                  f"gradients, np={ronde.size()}", flush=True)
    ronde.shutdown()


if __name__ == "__main__":
    main()
