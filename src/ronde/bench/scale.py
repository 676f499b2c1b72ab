"""``python -m ronde.bench scale``: how ronde's costs grow with the number of ranks.

For each N of ``--np`` (default 2,4,8,16) it runs, in one session and interleaved per N:
the ``latency`` case (back-to-back blocking 4-byte allreduces) and the ``allreduce``
case at 4 B and 1 MiB for ronde (``--transports``, default shm) and Gloo, then the
start-up cost: the slowest rank's ``init()`` plus a first allreduce (ronde under
``ronderun``, Gloo with ``init_process_group`` over TCP), and the whole job's wall time
(processes started, met, one allreduce, shut down). On a machine with fewer cores than
N this measures ranks that share cores, which is the point: a wait that spins takes
the core the rank it waits for needs. Prints a table with the ratios to Gloo.

::

    python -m ronde.bench scale --np 2,4,8,16 [--init-np 2,8,32,64] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Sequence

from ._contenders import ronderun_command, select_contenders
from ._gloo import free_port, torch_available
from ._runs import _points, run_rounds
from ._timing import Settings

_RONDE_INIT = textwrap.dedent("""
    import json, os, sys, time
    t0 = time.perf_counter()
    import numpy as np
    import ronde
    ronde.init()
    ronde.allreduce(np.ones(1, np.float32), name="first")
    took = time.perf_counter() - t0
    slowest = max(ronde.allgather_object(took))
    if ronde.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"init_s": slowest}, f)
    ronde.shutdown()
""")

_GLOO_INIT = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch, torch.distributed as dist
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    dist.all_reduce(torch.ones(1))
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"init_s": float(took[0])}, f)
    dist.destroy_process_group()
""")


def init_times(np_: int, timeout_s: float) -> dict[str, dict[str, float]]:
    """Start-up at ``np_`` ranks: ronde's and Gloo's slowest init (+ first allreduce)
    and the job's wall time, seconds."""
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "init.py")
        with open(script, "w") as f:
            f.write(_RONDE_INIT)
        res = os.path.join(tmp, "ronde.json")
        t0 = time.monotonic()
        proc = subprocess.run([*ronderun_command(), "-np", str(np_), sys.executable, script,
                               res], capture_output=True, text=True, timeout=timeout_s)
        wall = time.monotonic() - t0
        if proc.returncode == 0 and os.path.exists(res):
            out["ronde"] = {**json.load(open(res)), "wall_s": wall}
        else:
            print(f"ronde init at np={np_} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        if torch_available():
            gscript = os.path.join(tmp, "gloo_init.py")
            with open(gscript, "w") as f:
                f.write(_GLOO_INIT)
            gres, port = os.path.join(tmp, "gloo.json"), free_port()
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            t0 = time.monotonic()
            procs = [subprocess.Popen([sys.executable, gscript, str(r), str(np_), str(port),
                                       gres], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE) for r in range(np_)]
            codes = []
            for p in procs:
                try:
                    codes.append(p.wait(timeout=timeout_s))
                except subprocess.TimeoutExpired:
                    p.kill()
                    codes.append(-9)
            wall = time.monotonic() - t0
            if all(c == 0 for c in codes) and os.path.exists(gres):
                out["gloo"] = {**json.load(open(gres)), "wall_s": wall}
            else:
                print(f"gloo init at np={np_} failed: exit codes {codes}", file=sys.stderr)
    return out


def collective_times(np_: int, transports: Sequence[str], rounds: int, settings: Settings,
                     timeout_s: float) -> dict[str, dict[str, float]]:
    """Per contender: ``latency_s`` (4 B back to back), ``4B_s`` and ``1MiB_s``
    (allreduce medians, the slowest rank's) at ``np_`` ranks."""
    peers = ["gloo"] if torch_available() else []
    contenders = select_contenders(list(transports), peers, None)
    raw = run_rounds(contenders, rounds, np_, ["allreduce", "latency"], [4, 1 << 20],
                     settings, timeout_s)
    out: dict[str, dict[str, float]] = {}
    for pt in _points(contenders, ["allreduce", "latency"], np_, raw):
        row = out.setdefault(pt.impl, {})
        if pt.case == "latency":
            row["latency_s"] = pt.median_s
        else:
            row["4B_s" if pt.bytes == 4 else "1MiB_s"] = pt.median_s
    return out


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else (
        f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s")


def _ratio(peer: float | None, ours: float | None) -> str:
    return f"{peer / ours:.2f}" if peer and ours else "-"


def print_table(coll: dict[int, dict[str, dict[str, float]]],
                init: dict[int, dict[str, dict[str, float]]], impl: str) -> None:
    print(f"\nscale: {impl} against gloo, same session; ratio = gloo time / ronde time "
          "(> 1: ronde faster)\n")
    if coll:
        print("| N | latency 4 B | gloo | ratio | allreduce 4 B | gloo | ratio | "
              "allreduce 1 MiB | gloo | ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for n, row in sorted(coll.items()):
            ours, peer = row.get(impl, {}), row.get("gloo", {})
            cells = []
            for key in ("latency_s", "4B_s", "1MiB_s"):
                cells += [_fmt(ours.get(key)), _fmt(peer.get(key)),
                          _ratio(peer.get(key), ours.get(key))]
            print(f"| {n} | " + " | ".join(cells) + " |")
    if init:
        print("\n| N | ronde init | gloo init | ratio | ronde job wall | gloo job wall |")
        print("|---|---|---|---|---|---|")
        for n, row in sorted(init.items()):
            ours, peer = row.get("ronde", {}), row.get("gloo", {})
            print(f"| {n} | {_fmt(ours.get('init_s'))} | {_fmt(peer.get('init_s'))} | "
                  f"{_ratio(peer.get('init_s'), ours.get('init_s'))} | "
                  f"{_fmt(ours.get('wall_s'))} | {_fmt(peer.get('wall_s'))} |")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ronde.bench scale",
                                description="ronde's costs against N, beside Gloo")
    p.add_argument("--np", default="2,4,8,16", help="rank counts for the collectives")
    p.add_argument("--init-np", default="2,8,32,64", help="rank counts for start-up "
                   "('' skips it)")
    p.add_argument("--transports", default="shm", help="ronde transports (default shm)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--target-s", type=float, default=0.2)
    p.add_argument("--latency-ops", type=int, default=1000)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    settings = Settings(target_s=args.target_s, latency_ops=args.latency_ops)
    settings.min_iters = 3
    transports = [t for t in args.transports.split(",") if t]
    coll: dict[int, dict[str, dict[str, float]]] = {}
    init: dict[int, dict[str, dict[str, float]]] = {}
    print(f"ronde.bench scale: np={args.np} init-np={args.init_np} cpus={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.2f}", file=sys.stderr)
    for n in _ints(args.np):
        coll[n] = collective_times(n, transports, args.rounds, settings, args.timeout_s)
    for n in _ints(args.init_np):
        print(f"init at np={n} ...", file=sys.stderr, flush=True)
        init[n] = init_times(n, args.timeout_s)
    for impl in [f"ronde-{t}" for t in transports]:
        print_table(coll, init if impl == f"ronde-{transports[0]}" else {}, impl)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"collectives": coll, "init": init}, f, indent=1)
    return 0
