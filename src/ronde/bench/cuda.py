"""CUDA tensors through ``ronde.torch`` against torch.distributed on the same tensors,
alternated iteration by iteration in one job.

    ronderun -np 2 python -m ronde.bench.cuda [--sizes 4B,1MiB,16MiB,64MiB,256MiB]

Each rank pins GPU ``local_rank % device_count``. Where every rank has a GPU of its own,
ronde runs its device path (fusion on the GPU, NCCL) and the peer is a raw
``torch.distributed.all_reduce`` on the same NCCL group: the ratio is the engine's
overhead. Where ranks share a GPU (NCCL refuses that), ronde stages through host memory
and the peer is torch.distributed Gloo reducing the same CUDA tensors (which also stages
through the host). ``fusion`` is ResNet-50's 161 gradients submitted separately against
one buffer of their total size through the same contender.

Prints one JSON line per point (rank 0), then a table. Timings wait for the GPU
(``torch.cuda.synchronize``) on both sides. Needs torch with CUDA and a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from typing import Callable, Sequence

import numpy as np

from ._stats import busbw_GBps, median, parse_sizes, percentile


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4B,1MiB,16MiB,64MiB,256MiB")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu runs the same measurement on CPU tensors (a smoke test; "
                             "with RONDE_TORCH_DEVICE_PATH=always they take the device path)")
    args = parser.parse_args(argv)

    import torch

    import ronde.torch as hvd
    from ronde import _state
    from ronde.torch._device import BACKEND, store_for

    from ._resnet import resnet50_grad_shapes

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("torch sees no CUDA GPU here; --device cpu runs the same measurement "
                     "on CPU tensors")
    hvd.init()
    if cuda:
        index = hvd.local_rank() % torch.cuda.device_count()
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
        where = f"GPU {torch.cuda.get_device_name(dev)} x{torch.cuda.device_count()}"
    else:
        dev, where = torch.device("cpu"), "CPU"
    n, rank = hvd.size(), hvd.rank()
    dist = torch.distributed

    # the path ronde takes for these tensors (decided collectively, at the first one)
    probe = torch.ones(1, device=dev)
    hvd.allreduce_(probe, op=hvd.Sum, name="bench.cuda.probe")
    on_device = dist.is_initialized() and (not cuda or BACKEND._placement[0][0])
    if on_device:  # the peer: the same torch.distributed group ronde reduces through
        peer_name, group = f"torch.distributed {dist.get_backend()}", None
    else:
        store = store_for(_state.current(), list(range(n)), "bench.cuda.store", None,
                       datetime.timedelta(seconds=60))
        group = dist.ProcessGroupGloo(store, rank, n, datetime.timedelta(seconds=60))
        peer_name = "torch.distributed Gloo"

    def peer(t: torch.Tensor) -> None:
        if group is None:
            dist.all_reduce(t)
        else:
            group.allreduce([t]).wait()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn: Callable[[], None]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    rows = []
    for size in parse_sizes(args.sizes):
        t = torch.ones(max(1, size // 4), dtype=torch.float32, device=dev)
        name = f"bench.cuda.{size}"
        cases = {"ronde": lambda t=t, name=name: hvd.allreduce_(t, op=hvd.Sum, name=name),
                 "peer": lambda t=t: peer(t)}
        rows.append(_measure(f"allreduce {size} B", size, n, cases, timed, args))

    shapes = resnet50_grad_shapes()
    grads = [torch.ones(s, device=dev) for s in shapes]
    total = torch.ones(sum(int(np.prod(s)) for s in shapes), device=dev)
    names = [f"bench.cuda.grad.{i}" for i in range(len(shapes))]

    submit: list[float] = []

    def ronde_set() -> None:
        t0 = time.perf_counter()
        hs = [hvd.allreduce_async_(g, op=hvd.Sum, name=nm) for g, nm in zip(grads, names)]
        submit.append(time.perf_counter() - t0)
        for h in hs:
            hvd.synchronize(h)

    cases = {"ronde": ronde_set, "peer": lambda: peer(total),
             "ronde_single": lambda: hvd.allreduce_(total, op=hvd.Sum, name="bench.cuda.single")}
    if on_device:  # the device work alone (fusion, reduction, copies), without the engine
        from ronde._ops import ReduceOp

        cases["backend_only"] = lambda: BACKEND.allreduce(
            0, list(range(n)), grads, [tuple(g.shape) for g in grads], "float32",
            ReduceOp.SUM, 1.0, 1.0, grads)
    row = _measure(f"fusion {len(shapes)} tensors", total.numel() * 4, n, cases, timed, args)
    row["ronde_submit_us"] = median(submit[args.warmup:]) * 1e6
    rows.append(row)
    if rank == 0:
        path = dist.get_backend() if on_device else "host"
        print(f"# np={n}, {where}, ronde path: {path}, peer: {peer_name}")
        for row in rows:
            row.update(np=n, device=args.device, ronde_path=path, peer=peer_name)
            print(json.dumps(row))
        print(f"{'case':<24}{'ronde us':>12}{'peer us':>12}{'ronde/peer':>12}"
              f"{'busbw GB/s':>12}")
        for row in rows:
            print(f"{row['case']:<24}{row['ronde_us']:>12.1f}{row['peer_us']:>12.1f}"
                  f"{row['ronde_us'] / row['peer_us']:>12.2f}{row['ronde_busbw_gbs']:>12.2f}")
    hvd.shutdown()
    return 0


def _measure(case: str, size: int, n: int, cases: dict, timed: Callable,
             args: argparse.Namespace) -> dict:
    times: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(args.warmup + args.iters):
        for key, fn in cases.items():
            dt = timed(fn)
            if i >= args.warmup:
                times[key].append(dt)
    row = {"case": case, "bytes": size}
    for key, xs in times.items():
        row[f"{key}_us"] = median(xs) * 1e6
        row[f"{key}_p90_us"] = percentile(xs, 90) * 1e6
    row["ronde_busbw_gbs"] = busbw_GBps(size, median(times["ronde"]), n)
    row["peer_busbw_gbs"] = busbw_GBps(size, median(times["peer"]), n)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
