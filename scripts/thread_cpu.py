"""Where a rank's extra CPU goes: each thread's CPU per paired training step (issue #34).

Usage: ``ronderun -np 2 python scripts/thread_cpu.py [model] [pairs] [bare]``
(model: ``cnn``, ``transformer`` or ``resnet`` from ``python -m ronde.bench train``;
default ``transformer``, 80 pairs)

``bare``: the model's compute taken out. A real step's CPU time moves by several
milliseconds from one identical step to the next (a ResNet step: a standard deviation of
8-10 ms in 100, docs/benchmarks.md), and ronde adds 1-3 ms. With ``bare`` the loss is the
sum of the parameters (times 1.0), so a step is the hooks, the copies into the buckets,
the reductions and the optimizer's step over the same gradients, and almost nothing
else: measured to a few hundredths of a millisecond. What it leaves out is how ronde's
work and the model's share the caches and the cores.

Each rank alternates one step through ``DistributedOptimizer`` with one step of an
identical model without it (the bench's paired extra CPU, ``bench/train.py``), and
prints: the training thread's CPU a library step and a plain step (``time.thread_time``)
and their difference, then each of ronde's threads' CPU a pair (its CPU clock). The
sum of the difference and the threads is the rank's paired extra CPU.
"""

import copy
import sys
import time

import torch
import torch.nn.functional as F

import ronde.torch as hvd
from ronde.bench.train import _model, ronde_threads_cpu_s


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "transformer"
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 80
    bare = len(sys.argv) > 3 and sys.argv[3] == "bare"
    hvd.init()
    torch.set_num_threads(1)
    model, shape, classes = _model(torch, name)
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(32, *shape, generator=gen)
    y = torch.randint(0, classes, (32,), generator=gen)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad()
        loss = sum((p * 1.0).sum() for p in m.parameters()) if bare \
            else F.cross_entropy(m(x), y)
        loss.backward()
        o.step()

    for _ in range(5):  # the per-tensor steps, the bucket layout, allocations
        step(model, opt)
        step(plain, plain_opt)
    lib = base = 0.0
    before = ronde_threads_cpu_s()
    for _ in range(pairs):
        t0 = time.thread_time()
        step(model, opt)
        t1 = time.thread_time()
        step(plain, plain_opt)
        t2 = time.thread_time()
        lib, base = lib + t1 - t0, base + t2 - t1
    after = ronde_threads_cpu_s()
    ms = 1e3 / pairs
    spent = {k: (v - before.get(k, 0.0)) * ms for k, v in after.items()}
    print(f"rank {hvd.rank()}: training thread {lib * ms:.3f} ms a library step, "
          f"{base * ms:.3f} a plain one, extra {(lib - base) * ms:.3f}; ronde's threads "
          + " ".join(f"{k}={v:.3f}" for k, v in sorted(spent.items()) if v >= 0.0005)
          + f"; total extra {(lib - base) * ms + sum(spent.values()):.3f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
