"""``python -m ronde.bench CASE ...``: the benchmark driver.

Cases: ``allreduce`` (bandwidth over message sizes), ``latency`` (back-to-back 4-byte
allreduces) or ``all``. For each of ``--rounds`` rounds the driver runs one job per
contender (ronde per ``--transports``, then ``--peers``), rotating the start of the
order each round so that no contender always runs first on a noisy machine; each point
is the median over rounds. Prints one JSON line per point on stdout, then tables;
progress and notes go to stderr.

Example::

    python -m ronde.bench allreduce --np 2 --sizes 4B..64MiB --transports shm,tcp \\
        --peers gloo --json-out bench.json
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

from ._contenders import Contender, JobFailedError, select_contenders
from ._report import Point, combine, print_tables
from ._stats import DEFAULT_SIZES_BYTES, format_bytes, parse_sizes
from ._timing import Settings

CASES = ("allreduce", "latency")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ronde.bench",
        description="Benchmark ronde's allreduce against torch.distributed's Gloo.")
    p.add_argument("case", choices=[*CASES, "all"], help="what to measure")
    p.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--sizes", default=None,
                   help="message sizes: comma list (4B,1KiB,64MiB) or range A..B in powers "
                        "of 4 (default 4B,64B,1KiB,16KiB,256KiB,1MiB,4MiB,16MiB,64MiB)")
    p.add_argument("--rounds", type=int, default=2,
                   help="times the whole contender list runs, interleaved (default 2)")
    p.add_argument("--repeats", type=int, default=None,
                   help="fixed number of timed iterations per size (default: adaptive, "
                        "about --target-s of work, 5..1000)")
    p.add_argument("--target-s", type=float, default=0.5,
                   help="timed seconds per size for the adaptive count (default 0.5)")
    p.add_argument("--transports", default="shm,tcp", help="ronde transports (default shm,tcp)")
    p.add_argument("--peers", default="gloo", help="peer libraries: gloo or none (default gloo)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit per job (default 300)")
    p.add_argument("--json-out", default=None, help="also write points and raw rounds here")
    return p


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


def run_rounds(contenders: Sequence[Contender], rounds: int, np_: int, cases: Sequence[str],
               sizes: Sequence[int], settings: Settings,
               timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    """Run every contender ``rounds`` times, interleaved; per impl, its job summaries."""
    raw: dict[str, list[dict[str, Any]]] = {c.impl: [] for c in contenders}
    for r in range(rounds):
        k = r % len(contenders)
        for c in [*contenders[k:], *contenders[:k]]:
            t0 = time.monotonic()
            print(f"round {r + 1}/{rounds}: {c.impl} ...", end="", file=sys.stderr, flush=True)
            try:
                raw[c.impl].append(c.run(np_, cases, sizes, settings, timeout_s))
                print(f" {time.monotonic() - t0:.1f} s", file=sys.stderr)
            except (JobFailedError, OSError) as e:
                print(f" failed, its points lack this round\n{e}", file=sys.stderr)
    return raw


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the rounds, print JSON lines and tables."""
    p = _parser()
    args = p.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes) if args.sizes else list(DEFAULT_SIZES_BYTES)
        contenders = select_contenders(_split(args.transports), _split(args.peers))
    except ValueError as e:
        p.error(str(e))
    if args.np < 1 or args.rounds < 1 or (args.repeats is not None and args.repeats < 1):
        p.error("--np, --rounds and --repeats must be at least 1")
    if not contenders:
        p.error("nothing to run: give at least one transport or peer")
    cases = list(CASES) if args.case == "all" else [args.case]
    settings = Settings(target_s=args.target_s)
    if args.repeats is not None:
        settings.min_iters = settings.max_iters = args.repeats

    info = machine_info()
    print(f"ronde.bench: cases={','.join(cases)} np={args.np} rounds={args.rounds} "
          f"sizes={','.join(format_bytes(s) for s in sizes)} "
          f"contenders={','.join(c.impl for c in contenders)} "
          f"iters={args.repeats or f'adaptive ~{args.target_s}s [5, 1000]'} "
          f"cpus={info['nproc']} ({info['cpu_model']})", file=sys.stderr)
    raw = run_rounds(contenders, args.rounds, args.np, cases, sizes, settings, args.timeout_s)

    points: list[Point] = []
    for c in contenders:
        for case in cases:
            per_round = [doc["results"].get(case, []) for doc in raw[c.impl]]
            points.extend(combine(case, c.impl, c.transport, args.np, per_round))
        for doc in raw[c.impl][:1]:
            for key in ("numpy", "torch", "ronde"):
                if key in doc:
                    info.setdefault(key, doc[key])
    for pt in points:
        print(pt.json_line())
    print_tables(points, [c.impl for c in contenders if c.kind == "ronde"],
                 [c.impl for c in contenders if c.kind != "ronde"], sys.stdout)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"argv": sys.argv, "machine": info, "points": [json.loads(pt.json_line())
                                                           for pt in points],
             "raw": raw}, indent=1))
    missing = [c.impl for c in contenders if len(raw[c.impl]) < args.rounds]
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
