"""Overlap of communication with the backward pass: eager against ``torch.compile``.

    ronderun -np 2 python scripts/compile_overlap.py [MODEL] [BACKEND]

Trains the benchmark's MODEL (``resnet``, ``transformer`` or ``cnn`` of
``python -m ronde.bench train``; default ``resnet``) with ``DistributedOptimizer`` in
three ways, each for 10 warm-up and 30 timed steps with a timeline per rank of the timed
ones (``hvd.start_timeline``), and prints what ``python -m ronde.timeline summary``
makes of them, per rank (p50 per step, ms): the step, its communication, how much of
that ran while the rank still computed (overlapped) and how much after its last
submission (exposed: the rank only waited).

* ``eager``: the model as it is;
* ``compiled``: ``torch.compile(model, backend=BACKEND)`` (default ``aot_eager``: the
  same graphs as inductor's, without the C++ build): one compiled backward, after
  which every gradient's hook fires at once;
* ``compiled, split``: ``torch.compile(model, backend=hvd.compile_backend(BACKEND))``:
  the graph split at bucket boundaries (Dynamo's DDPOptimizer, as DDP does), one
  compiled backward per piece;
* ``per block``: ``torch.compile`` of each top-level child of the model: one
  compiled backward per block, so the hooks of a block fire when its backward is done.

Buckets are 256 KiB (``RONDE_BUCKET_BYTES``) so that the small models have several.
docs/benchmarks.md quotes a run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("RONDE_BUCKET_BYTES", "256KiB")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ronde.torch as hvd  # noqa: E402
from ronde import timeline  # noqa: E402
from ronde.bench.train import _model  # noqa: E402

MODEL = sys.argv[1] if len(sys.argv) > 1 else "resnet"
BACKEND = sys.argv[2] if len(sys.argv) > 2 else "aot_eager"
WARMUP, STEPS, BATCH = 10, 30, 32


def run(mode: str, out: str) -> None:
    torch.set_num_threads(1)
    model, shape, classes = _model(torch, MODEL)
    if mode == "compiled":
        net = torch.compile(model, backend=BACKEND)
    elif mode == "compiled, split":
        net = torch.compile(model, backend=hvd.compile_backend(BACKEND))
    elif mode == "per block":
        for name, child in list(model.named_children()):
            setattr(model, name, torch.compile(child, backend=BACKEND))
        net = model
    else:
        net = model
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=[(f"{mode}.{n}", p)
                                                     for n, p in net.named_parameters()])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(BATCH, *shape, generator=gen)
    y = torch.randint(0, classes, (BATCH,), generator=gen)
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            hvd.start_timeline(os.path.join(out, mode.replace(" ", "_") + ".{rank}.json"))
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    hvd.stop_timeline()
    opt.remove_hooks()


def main() -> None:
    hvd.init()
    out = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    modes = ("eager", "compiled", "compiled, split", "per block")
    for mode in modes:
        run(mode, out)
    hvd.barrier()
    if hvd.rank() == 0:
        print(f"{MODEL}, backend {BACKEND}, np={hvd.size()}: p50 per step, ms (rank 0 / 1)")
        print("| mode | step (wall) | communication | overlapped | exposed |")
        print("|---|---|---|---|---|")
        for mode in modes:
            stem = mode.replace(" ", "_")
            paths = [os.path.join(out, f"{stem}.{r}.json") for r in range(hvd.size())]
            stats = timeline.summarize(paths)["stats"]
            cells = []
            for key in ("wall", "communication", "overlapped", "exposed"):
                cells.append(" / ".join(f"{stats[r][key]['p50_us'] / 1e3:.1f}"
                                        for r in sorted(stats)))
            print(f"| {mode} | " + " | ".join(cells) + " |")
        print(json.dumps({"dir": out}))
    hvd.shutdown()


if __name__ == "__main__":
    main()
