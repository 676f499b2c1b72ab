"""Python calls into ronde per steady training step, every thread (issue #34, item 3).

Usage: ``ronderun -np 2 python scripts/step_calls.py [tensors] [steps]``

A profiler set on every thread before ``init()`` counts calls into ronde's own files
while each step runs (zero_grad, forward, backward with its hooks, step); the first
six steps (per-tensor, then the bucket layout) are left out. Prints, per rank, the
median, 25th and 75th percentile over the steady steps. Counts, not times: stable on
a noisy machine, though the engine's polling loops more when the cores are busy.
"""

import os
import statistics
import sys
import threading

import torch

import ronde.torch as hvd

SRC = os.path.dirname(os.path.dirname(os.path.abspath(hvd.__file__)))
counting = [False, 0]


def prof(frame, event, arg):
    if counting[0] and event == "call" and frame.f_code.co_filename.startswith(SRC):
        counting[1] += 1


def main() -> None:
    tensors = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    threading.setprofile(prof)
    torch.set_num_threads(1)
    hvd.init()
    # (left set: threads started later, the steady lane's, are counted too)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(tensors // 2)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x = torch.randn(4, 8)
    per = []
    for step in range(steps):
        counting[1] = 0
        if step >= 6:
            counting[0] = True
            sys.setprofile(prof)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        counting[0] = False
        sys.setprofile(None)
        if step >= 6:
            per.append(counting[1])
    threading.setprofile(None)
    per.sort()
    print(f"rank {hvd.rank()}: {tensors} gradients, median {statistics.median(per)} calls "
          f"a step (p25 {per[len(per) // 4]}, p75 {per[3 * len(per) // 4]})")
    hvd.shutdown()


if __name__ == "__main__":
    main()
