"""The one measurement loop, generic over a :class:`Comm` (ronde or Gloo).

Both worker kinds wrap their library in a :class:`Comm` and call :func:`run_cases`, so
every contender is timed by exactly the same code. Ranks never decide anything on their
own clock: every iteration count is agreed with a max-allreduce first, so they all run
the same number of collectives.

Per size: barrier; one checked allreduce (values ``rank + 1``); two warm-up iterations
whose slowest-rank time sets the timed iteration count (about ``target_s`` of work, at
least ``min_iters``, at most ``max_iters``) and a few more warm-ups; then the timed
iterations, each timed on its own with ``perf_counter``. The reported time of an
iteration is the slowest rank's (an elementwise max-allreduce of the per-rank times).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ._stats import median, percentile


class Comm(Protocol):
    """What the loop needs from a library; buffers are float32 numpy arrays."""

    rank: int
    size: int

    def make_buffer(self, values: np.ndarray) -> Any:
        """The library's buffer holding ``values`` (a torch tensor for Gloo)."""

    def allreduce_sum(self, buf: Any) -> np.ndarray | None:
        """One blocking sum-allreduce of ``buf``; return the result (or None if in place)."""

    def max_across_ranks(self, values: np.ndarray) -> np.ndarray:
        """Elementwise max over ranks of a float64 array (bookkeeping, not timed)."""

    def barrier(self) -> None:
        """Wait for every rank."""


@dataclass
class Settings:
    """Knobs of the loop, identical on every rank."""

    target_s: float = 0.5
    min_iters: int = 5
    max_iters: int = 1000
    warmup_s: float = 0.05
    max_warmup: int = 50
    latency_batches: int = 5
    latency_batch_s: float = 0.2


def _agreed(comm: Comm, value: float) -> float:
    return float(comm.max_across_ranks(np.array([value], dtype=np.float64))[0])


def _check(comm: Comm, nbytes: int) -> None:
    count = nbytes // 4
    buf = comm.make_buffer(np.full(count, comm.rank + 1, dtype=np.float32))
    out = comm.allreduce_sum(buf)
    got = np.asarray(out if out is not None else buf)
    want = comm.size * (comm.size + 1) / 2
    if got.shape != (count,) or not np.all(got == want):
        raise RuntimeError(f"allreduce of {nbytes} bytes returned wrong values "
                           f"(expected all {want}); the benchmark would be meaningless")


def measure_allreduce(comm: Comm, nbytes: int, settings: Settings) -> dict[str, Any]:
    """Time sum-allreduces of ``nbytes`` of float32; returns a summary for the point."""
    comm.barrier()
    _check(comm, nbytes)
    buf = comm.make_buffer(np.zeros(nbytes // 4, dtype=np.float32))
    t0 = time.perf_counter()
    for _ in range(2):
        comm.allreduce_sum(buf)
    est_s = _agreed(comm, (time.perf_counter() - t0) / 2)
    iters = int(min(settings.max_iters, max(settings.min_iters, settings.target_s / est_s)))
    warmup = int(min(settings.max_warmup, settings.warmup_s / est_s))
    for _ in range(warmup):
        comm.allreduce_sum(buf)
    comm.barrier()
    times = np.empty(iters, dtype=np.float64)
    clock = time.perf_counter
    for i in range(iters):
        t = clock()
        comm.allreduce_sum(buf)
        times[i] = clock() - t
    slowest = comm.max_across_ranks(times).tolist()
    return {"bytes": nbytes, "iters": iters, "warmup": warmup + 2,
            "median_s": median(slowest), "p90_s": percentile(slowest, 90.0),
            "min_s": min(slowest)}


def measure_latency(comm: Comm, settings: Settings) -> dict[str, Any]:
    """Back-to-back 4-byte allreduces: per-op time over ``latency_batches`` batches."""
    comm.barrier()
    _check(comm, 4)
    buf = comm.make_buffer(np.zeros(1, dtype=np.float32))
    for _ in range(20):  # the first ops negotiate and fill caches: keep them out of the estimate
        comm.allreduce_sum(buf)
    t0 = time.perf_counter()
    for _ in range(20):
        comm.allreduce_sum(buf)
    est_s = _agreed(comm, (time.perf_counter() - t0) / 20)
    ops = int(min(20000, max(20, settings.latency_batch_s / est_s)))
    per_op = np.empty(settings.latency_batches, dtype=np.float64)
    for b in range(settings.latency_batches):
        comm.barrier()
        t = time.perf_counter()
        for _ in range(ops):
            comm.allreduce_sum(buf)
        per_op[b] = (time.perf_counter() - t) / ops
    slowest = comm.max_across_ranks(per_op).tolist()
    return {"bytes": 4, "iters": ops * settings.latency_batches, "ops_per_batch": ops,
            "median_s": median(slowest), "p90_s": percentile(slowest, 90.0),
            "min_s": min(slowest)}


def run_cases(comm: Comm, cases: list[str], sizes: list[int],
              settings: Settings) -> dict[str, list[dict[str, Any]]]:
    """Run every requested case; ``{"allreduce": [point, ...], "latency": [point]}``."""
    results: dict[str, list[dict[str, Any]]] = {}
    if "latency" in cases:
        results["latency"] = [measure_latency(comm, settings)]
    if "allreduce" in cases:
        results["allreduce"] = [measure_allreduce(comm, s, settings) for s in sizes]
    return results
