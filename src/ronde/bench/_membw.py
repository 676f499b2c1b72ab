"""Memory-bandwidth context for the allreduce numbers: ``python -m ronde.bench._membw``.

Times the two numpy passes ronde's shm allreduce is made of, on buffers of ``--mib``
MiB (default 64) of float32: a copy (``np.copyto(dst, src)``) and an add
(``np.add(a, b, out=c)``), each the median of ``--repeats`` runs, first in one process,
then in ``--procs`` processes at once (the ranks of a job run their passes at the same
time and share the memory bus). Prints one JSON line per measurement, then a table.

GB/s here is the size of the destination over the time (1e9 B/s): a copy moves twice
that (read + write), an add three times (two reads, one write).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from typing import Any, Sequence

import numpy as np

from ._stats import median


def _measure(nbytes: int, repeats: int, start: Any = None) -> dict[str, float]:
    n = nbytes // 4
    a = np.ones(n, dtype=np.float32)
    b = np.ones(n, dtype=np.float32)
    c = np.ones(n, dtype=np.float32)  # all three touched: no page faults in the timing
    if start is not None:
        start.wait()
    out: dict[str, float] = {}
    for name, once in (("copy", lambda: np.copyto(c, a)),
                       ("add", lambda: np.add(a, b, out=c))):
        once()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            once()
            times.append(time.perf_counter() - t)
        out[name] = median(times)
    return out


def _child(nbytes: int, repeats: int, start: Any, results: Any) -> None:
    results.put(_measure(nbytes, repeats, start))


def measure(nbytes: int, repeats: int, procs: int) -> list[dict[str, float]]:
    """Per-process median seconds of a copy and an add, ``procs`` processes at once."""
    if procs == 1:
        return [_measure(nbytes, repeats)]
    ctx = mp.get_context("fork")
    start, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_child, args=(nbytes, repeats, start, results))
               for _ in range(procs)]
    for w in workers:
        w.start()
    got = [results.get(timeout=300) for _ in workers]
    for w in workers:
        w.join()
    return got


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ronde.bench._membw", description=__doc__)
    p.add_argument("--mib", type=int, default=64, help="buffer size in MiB (default 64)")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per pass (default 20)")
    p.add_argument("--procs", default="1,2", help="process counts, comma list (default 1,2)")
    args = p.parse_args(argv)
    nbytes = args.mib << 20
    rows = []
    for procs in [int(x) for x in args.procs.split(",")]:
        per_proc = measure(nbytes, args.repeats, procs)
        for op in ("copy", "add"):
            # the slowest process sets the pace of a job whose ranks run together
            s = max(r[op] for r in per_proc)
            doc = {"op": op, "procs": procs, "bytes": nbytes, "median_s": s,
                   "GBps": nbytes / s / 1e9, "traffic_GBps": nbytes * (2 if op == "copy"
                                                                       else 3) / s / 1e9}
            print(json.dumps(doc))
            rows.append(doc)
    print(f"\n| pass ({args.mib} MiB float32) | processes at once | time (slowest) | GB/s "
          "(dst) | GB/s (read+write) |\n|---|---|---|---|---|")
    for d in rows:
        what = "np.copyto(dst, src)" if d["op"] == "copy" else "np.add(a, b, out=c)"
        print(f"| {what} | {d['procs']} | {d['median_s'] * 1e3:.1f} ms | {d['GBps']:.2f} | "
              f"{d['traffic_GBps']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
