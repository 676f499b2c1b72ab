"""A library step's CPU beyond a plain one with the model's compute taken out (issue #34).

Usage: ``ronderun -np 2 python scripts/bare_step_cpu.py [model] [pairs]``
(model: ``cnn``, ``transformer`` or ``resnet`` from ``python -m ronde.bench train``;
default ``resnet``, 300 pairs)

``scripts/thread_cpu.py`` pairs real training steps, whose CPU time moves by several
milliseconds from one identical step to the next (a ResNet step: a standard deviation of
8-10 ms in 100, docs/benchmarks.md); what ronde adds is 1-3 ms. Here the loss is the sum
of the parameters (times 1.0), so a step is the hooks, the copies into the buckets, the
reductions and the optimizer's step over the same 62 gradients of the same sizes, and
almost nothing else: the difference between a library step and a plain one is then
measured to a few hundredths of a millisecond. What it leaves out is how ronde's work
and the model's share the caches and the cores; ``thread_cpu.py`` and the bench measure
that. Prints, per rank: the training thread's CPU a library step and a plain one, their
difference, and each of ronde's threads' CPU a pair.
"""

import copy
import sys
import time

import torch

import ronde.torch as hvd
from ronde.bench.train import _model, ronde_threads_cpu_s


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "resnet"
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    hvd.init()
    torch.set_num_threads(1)
    model, _, _ = _model(torch, name)
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad()
        sum((p * 1.0).sum() for p in m.parameters()).backward()
        o.step()

    for _ in range(6):  # the per-tensor steps, the bucket layout, the lane
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
