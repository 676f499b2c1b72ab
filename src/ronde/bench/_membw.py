"""Memory-bandwidth context for the allreduce numbers: ``python -m ronde.bench._membw``.

Times the two numpy passes ronde's shm allreduce is made of, on buffers of ``--mib``
MiB (default 64) of float32: a copy (``np.copyto(dst, src)``) and an add
(``np.add(a, b, out=c)``), each the median of ``--repeats`` runs, first in one process,
then in ``--procs`` processes at once (the ranks of a job run their passes at the same
time and share the memory bus). Prints one JSON line per measurement, then a table.

GB/s here is the size of the destination over the time (1e9 B/s): a copy moves twice
that (read + write), an add three times (two reads, one write).

Then (Linux) the cross-process read ronde's single-copy collectives make: a child
process holds a buffer and the parent reads it with ``process_vm_readv`` into a
cache-sized scratch buffer, 1 MiB at a time, as ``transport/cma.py`` does; once with
the child's buffer on transparent huge pages (``madvise(MADV_HUGEPAGE)``, what numpy
asks for from 4 MiB on) and once on 4 KiB pages (``MADV_NOHUGEPAGE``). The kernel pins
the source pages one by one, so the page size sets the rate.
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


def _holder(nbytes: int, huge: bool, conn: Any) -> None:
    """Child: a buffer on the requested page size; send its address, wait to be told."""
    import ctypes
    import mmap

    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(mm, dtype=np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(buf.ctypes.data, nbytes, 14 if huge else 15)  # MADV_(NO)HUGEPAGE
    buf[:] = 1  # fault every page in now
    conn.send(int(buf.ctypes.data))
    conn.recv()
    del buf


def cross_process_read(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """GB/s of chunked ``process_vm_readv`` from, and ``process_vm_writev`` into, a
    huge-page and a 4 KiB-page buffer of another process."""
    from ..transport import vm as cma

    if not cma.supported():
        return []
    chunk = 1 << 20
    scratch = np.empty(chunk, dtype=np.uint8)
    out = []
    ctx = mp.get_context("fork")
    for huge in (True, False):
        mine, theirs = ctx.Pipe()
        child = ctx.Process(target=_holder, args=(nbytes, huge, theirs))
        child.start()
        try:
            addr = mine.recv()
            # both directions: the remote side's pages set the pace either way
            for op, copy in (("process_vm_readv", cma.read_into),
                             ("process_vm_writev", cma.write_into)):
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    for off in range(0, nbytes, chunk):
                        n = min(chunk, nbytes - off)
                        copy(child.pid, [(scratch.ctypes.data, n)], [(addr + off, n)])
                    times.append(time.perf_counter() - t)
                secs = median(times)
                out.append({"op": op, "pages": "2 MiB (THP)" if huge else "4 KiB",
                            "bytes": nbytes, "median_s": secs, "GBps": nbytes / secs / 1e9})
        finally:
            mine.send(1)
            child.join(30)
    return out


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
    reads = cross_process_read(nbytes, max(3, args.repeats // 4))
    if reads:
        print(f"\n| {args.mib} MiB across processes, 1 MiB at a time | the other process's "
              "pages | time | GB/s |\n|---|---|---|---|")
        for d in reads:
            print(json.dumps(d), file=sys.stderr)
            print(f"| {d['op']} | {d['pages']} | {d['median_s'] * 1e3:.1f} ms | "
                  f"{d['GBps']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
