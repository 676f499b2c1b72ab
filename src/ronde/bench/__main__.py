"""``python -m ronde.bench CASE ...``: the benchmark driver.

Cases: ``allreduce`` (bandwidth over ``--sizes``), ``latency`` (``--latency-ops``
back-to-back 4-byte allreduces), ``allgather``, ``broadcast``, ``reducescatter``,
``alltoall`` (over ``--coll-sizes``), ``fusion`` (ResNet-50's 161 gradient tensors as
separate allreduces against one buffer of their total size), a comma list of these, or
``all``. For each of ``--rounds`` rounds the driver runs one job per contender (ronde per
``--transports``, then ``--peers``: gloo, mpich, openmpi), rotating the start of the
order each round so that no contender always runs first on a noisy machine; each point
is the median over rounds. Prints one JSON line per point on stdout, then tables;
progress and notes go to stderr. ``--quick`` is a preset for a run of under two minutes.

Example::

    python -m ronde.bench allreduce --np 2 --sizes 4B..64MiB --transports shm,tcp \\
        --peers gloo,mpich,openmpi --json-out bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ._contenders import PEERS, select_contenders
from ._mpi import MPI_PEERS
from ._report import points_from_json, print_tables
from ._runs import _points, run_rounds
from ._stats import DEFAULT_SIZES_BYTES, format_bytes, parse_sizes
from ._timing import COLLECTIVES, Settings

CASES = ("allreduce", "latency", *COLLECTIVES, "fusion")
DEFAULT_COLL_SIZES = "4KiB,1MiB,16MiB"

#: ``--quick``: what it sets unless the flag is given explicitly
QUICK: dict[str, Any] = {"rounds": 1, "sizes": "4B,64KiB,1MiB,16MiB,64MiB",
                         "coll_sizes": "4KiB,1MiB,16MiB", "target_s": 0.1, "min_iters": 3,
                         "latency_ops": 2000}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ronde.bench",
        description="Benchmark ronde's collectives against Gloo, MPICH and Open MPI.")
    p.add_argument("case", help=f"what to measure: {', '.join(CASES)}, a comma list of "
                                "these, or all; separate commands: train (training "
                                "throughput vs DDP), multihost (simulated hosts, root), "
                                "scale (costs against N, beside Gloo), control (one "
                                "negotiation round's work against N), memory (bytes per rank of "
                                "sharded optimizers, ZeRO, FSDP2; with --capacity the largest "
                                "model each trains in a budget per rank), recommend (the "
                                "fusion threshold and cycle time to use here)")
    p.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--sizes", default=None,
                   help="allreduce sizes: comma list (4B,1KiB,64MiB) or range A..B in powers "
                        "of 4 (default 4B,64B,1KiB,16KiB,256KiB,1MiB,4MiB,16MiB,64MiB)")
    p.add_argument("--coll-sizes", default=None,
                   help="sizes for allgather/broadcast/reducescatter/alltoall, the largest "
                        f"buffer per rank (default {DEFAULT_COLL_SIZES})")
    p.add_argument("--rounds", type=int, default=None,
                   help="times the whole contender list runs, interleaved (default 2)")
    p.add_argument("--repeats", type=int, default=None,
                   help="fixed number of timed iterations per size (default: adaptive, "
                        "about --target-s of work, 5..1000)")
    p.add_argument("--target-s", type=float, default=None,
                   help="timed seconds per size for the adaptive count (default 0.5)")
    p.add_argument("--latency-ops", type=int, default=None,
                   help="4-byte allreduces in the latency case, in 5 timed batches "
                        "(default 10000)")
    p.add_argument("--transports", default="shm,tcp", help="ronde transports (default shm,tcp)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="peer libraries, comma list of gloo, mpich, openmpi, or none "
                        "(default: all of them that can run here)")
    p.add_argument("--cache-dir", default=None,
                   help="where the MPI peers' venvs live (default ~/.cache/ronde-bench)")
    p.add_argument("--quick", action="store_true",
                   help="a short run (< 2 min): 1 round, fewer sizes, ~0.1 s per point, "
                        "2000 latency ops; explicit flags still win")
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit per job (default 300)")
    p.add_argument("--json-out", default=None, help="also write points and raw rounds here")
    p.add_argument("--replay", default=None, metavar="FILE",
                   help="measure nothing: print the tables of a --json-out file again")
    return p


def replay(path: str) -> int:
    """Print the tables of a saved run (the contenders in the order they were measured)."""
    points = points_from_json(json.loads(Path(path).read_text())["points"])
    impls = list(dict.fromkeys(p.impl for p in points))
    print_tables(points, [i for i in impls if i.startswith("ronde-")],
                 [i for i in impls if not i.startswith("ronde-")], sys.stdout,
                 mpi_impls=[i for i in impls if i in MPI_PEERS])
    return 0


def _cases(text: str) -> list[str]:
    if text == "all":
        return list(CASES)
    cases = _split(text)
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        raise ValueError(f"unknown case(s) {', '.join(bad) or text!r}; choose from "
                         f"{', '.join(CASES)} or all")
    return [c for c in CASES if c in cases]


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"]


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: cores, CPU model, Python (worker versions added later)."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor() or "unknown"
    return {"nproc": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version()}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the rounds, print JSON lines and tables."""
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["train"]:  # training throughput: ronde vs DDP vs one process
        from .train import main as train_main

        return train_main(raw[1:])
    if raw[:1] == ["memory"] and "--capacity" in raw:  # the largest model in a budget
        from .capacity import main as capacity_main

        return capacity_main(raw[1:])
    if raw[:1] == ["memory"]:  # memory per rank: sharded optimizers, ZeRO, FSDP2
        from .memory import main as memory_main

        return memory_main(raw[1:])
    if raw[:1] == ["scale"]:  # costs against the number of ranks, beside Gloo
        from .scale import main as scale_main

        return scale_main(raw[1:])
    if raw[:1] == ["control"]:  # one negotiation round's work against N, in-process
        from .control import main as control_main

        return control_main(raw[1:])
    if raw[:1] == ["recommend"]:  # the fusion threshold and cycle time to use here
        from .recommend import main as recommend_main

        return recommend_main(raw[1:])
    if raw[:1] == ["multihost"]:  # simulated hosts (needs root)
        from .multihost import main as multihost_main

        return multihost_main(raw[1:])
    p = _parser()
    args = p.parse_args(argv)
    if args.replay:
        return replay(args.replay)
    if args.quick:
        for key, value in QUICK.items():
            if key != "min_iters" and getattr(args, key) is None:
                setattr(args, key, value)
    args.rounds = 2 if args.rounds is None else args.rounds
    args.target_s = 0.5 if args.target_s is None else args.target_s
    args.latency_ops = 10_000 if args.latency_ops is None else args.latency_ops
    try:
        cases = _cases(args.case)
        sizes = parse_sizes(args.sizes) if args.sizes else list(DEFAULT_SIZES_BYTES)
        coll_sizes = parse_sizes(args.coll_sizes or DEFAULT_COLL_SIZES)
        transports, peers = _split(args.transports), _split(args.peers)
        bad = [x for x in peers if x not in PEERS]
        if bad:
            raise ValueError(f"unknown peer(s) {', '.join(bad)}; choose from "
                             f"{', '.join(PEERS)} or 'none'")
    except ValueError as e:
        p.error(str(e))
    if args.np < 1 or args.rounds < 1 or (args.repeats is not None and args.repeats < 1) \
            or args.latency_ops < 1:
        p.error("--np, --rounds, --repeats and --latency-ops must be at least 1")
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else None
    try:
        contenders = select_contenders(transports, peers, cache_dir)
    except ValueError as e:
        p.error(str(e))
    if not contenders:
        p.error("nothing to run: give at least one transport or peer")
    settings = Settings(target_s=args.target_s, latency_ops=args.latency_ops)
    if args.quick:
        settings.min_iters = int(QUICK["min_iters"])
    if args.repeats is not None:
        settings.min_iters = settings.max_iters = args.repeats

    info = machine_info()
    print(f"ronde.bench: cases={','.join(cases)} np={args.np} rounds={args.rounds} "
          f"sizes={','.join(format_bytes(s) for s in sizes)} "
          f"coll-sizes={','.join(format_bytes(s) for s in coll_sizes)} "
          f"latency-ops={args.latency_ops} "
          f"contenders={','.join(c.impl for c in contenders)} "
          f"iters={args.repeats or f'adaptive ~{args.target_s}s [{settings.min_iters}, 1000]'} "
          f"cpus={info['nproc']} ({info['cpu_model']}) "
          f"load={os.getloadavg()[0]:.2f}", file=sys.stderr)
    t0 = time.monotonic()
    raw = run_rounds(contenders, args.rounds, args.np, cases, sizes, settings, args.timeout_s,
                     coll_sizes)
    info["wall_s"] = round(time.monotonic() - t0, 1)
    info["loadavg_end"] = os.getloadavg()

    points = _points(contenders, cases, args.np, raw)
    for c in contenders:
        for doc in raw[c.impl][:1]:
            for key in ("numpy", "torch", "ronde"):
                if key in doc:
                    info.setdefault(key, doc[key])
            if c.is_mpi:
                info[c.impl] = {k: doc[k] for k in ("mpi_library", "mpi4py", "numpy",
                                                    f"{c.impl}_package") if k in doc}
    for pt in points:
        print(pt.json_line())
    print_tables(points, [c.impl for c in contenders if c.kind == "ronde"],
                 [c.impl for c in contenders if c.kind != "ronde"], sys.stdout,
                 mpi_impls=[c.impl for c in contenders if c.kind in MPI_PEERS])
    print(f"\nwall time {info['wall_s']} s; load average at the end "
          f"{info['loadavg_end'][0]:.2f}", file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"argv": sys.argv, "machine": info, "points": [json.loads(pt.json_line())
                                                           for pt in points],
             "raw": raw}, indent=1))
    missing = [c.impl for c in contenders if len(raw[c.impl]) < args.rounds]
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
