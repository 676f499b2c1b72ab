"""The one measurement loop, generic over a :class:`Comm` (ronde, Gloo or MPI).

Every worker kind wraps its library in a :class:`Comm` and calls :func:`run_cases`, so
every contender is timed by exactly the same code. Ranks never decide anything on their
own clock: every iteration count is agreed with a max-allreduce first, so they all run
the same number of collectives.

Per point (one case at one size): barrier; one checked call of the collective; two
warm-up iterations whose slowest-rank time sets the timed iteration count (about
``target_s`` of work, at least ``min_iters``, at most ``max_iters``) and a few more
warm-ups; then the timed iterations, each timed on its own with ``perf_counter``. The
reported time of an iteration is the slowest rank's (an elementwise max-allreduce of the
per-rank times).

Sizes are the largest buffer a rank holds, as nccl-tests counts them: the buffer for
allreduce and broadcast, the output for allgather (each rank sends ``size / n``), the
input for reducescatter (each rank keeps ``size / n``), input and output for alltoall.
Element counts are rounded down to a multiple of the number of ranks.

``fusion`` is ResNet-50's gradient set (:mod:`ronde.bench._resnet`): the 161 tensors
allreduced as separate calls (all submitted, then all waited where the library is
asynchronous), against one allreduce of a single buffer of the same total size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from ._resnet import resnet50_grad_shapes
from ._stats import median, percentile

#: The collective cases timed at each of the ``coll_sizes`` (allreduce uses ``sizes``).
COLLECTIVES = ("allgather", "broadcast", "reducescatter", "alltoall")


class Comm(Protocol):
    """What the loop needs from a library; buffers hold float32 values.

    Each collective is blocking. ``out`` is a buffer the caller allocated for the
    result; a library that cannot write into it returns a new array instead (ronde's
    allgather, reducescatter and alltoall), and the loop then checks that one.
    """

    rank: int
    size: int

    def make_buffer(self, values: np.ndarray) -> Any:
        """The library's buffer holding ``values`` (a torch tensor for Gloo)."""

    def allreduce_sum(self, buf: Any) -> Any:
        """One sum-allreduce of ``buf`` in place (return None, or the result)."""

    def allreduce_many(self, bufs: list[Any]) -> None:
        """Sum-allreduce every buffer of the list in place; return when all are done."""

    def allgather(self, buf: Any, out: Any) -> Any:
        """Gather every rank's ``buf`` into ``out`` in rank order (None or the result)."""

    def broadcast(self, buf: Any) -> Any:
        """Rank 0's ``buf`` into every rank's ``buf`` (None or the result)."""

    def reducescatter(self, buf: Any, out: Any) -> Any:
        """Sum ``buf`` over ranks; this rank's block into ``out`` (None or the result)."""

    def alltoall(self, buf: Any, out: Any) -> Any:
        """Block ``i`` of ``buf`` to rank ``i``; received blocks into ``out`` in rank order."""

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
    latency_ops: int = 10_000
    latency_batches: int = 5


def _agreed(comm: Comm, value: float) -> float:
    return float(comm.max_across_ranks(np.array([value], dtype=np.float64))[0])


def _numpy(x: Any) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _result(returned: Any, buf: Any) -> np.ndarray:
    return _numpy(returned if returned is not None else buf)


class _Point:
    """One case at one size: ``once()`` runs the collective, ``check()`` verifies it."""

    def __init__(self, comm: Comm, case: str, nbytes: int) -> None:
        n, r = comm.size, comm.rank
        count = max(n, (nbytes // 4) // n * n)
        block = count // n
        self.case, self.nbytes = case, nbytes
        self.comm = comm
        make = comm.make_buffer
        zeros = np.zeros
        if case == "allreduce":
            self.inp = make(np.full(count, r + 1, dtype=np.float32))
            self.want = np.full(count, n * (n + 1) / 2, dtype=np.float32)
            self.once: Callable[[], Any] = lambda: comm.allreduce_sum(self.inp)
        elif case == "allgather":
            self.inp = make(np.full(block, r + 1, dtype=np.float32))
            self.out = make(zeros(count, dtype=np.float32))
            self.want = np.repeat(np.arange(1, n + 1, dtype=np.float32), block)
            self.once = lambda: comm.allgather(self.inp, self.out)
        elif case == "broadcast":
            self.inp = make(np.full(count, 1.0 if r == 0 else 0.0, dtype=np.float32))
            self.want = np.ones(count, dtype=np.float32)
            self.once = lambda: comm.broadcast(self.inp)
        elif case == "reducescatter":
            self.inp = make(np.full(count, r + 1, dtype=np.float32))
            self.out = make(zeros(block, dtype=np.float32))
            self.want = np.full(block, n * (n + 1) / 2, dtype=np.float32)
            self.once = lambda: comm.reducescatter(self.inp, self.out)
        elif case == "alltoall":
            # block j of rank r holds r * n + j, so rank r receives i * n + r from rank i
            self.inp = make(np.repeat(np.arange(r * n, r * n + n, dtype=np.float32), block))
            self.out = make(zeros(count, dtype=np.float32))
            self.want = np.repeat(np.arange(n, dtype=np.float32) * n + r, block)
            self.once = lambda: comm.alltoall(self.inp, self.out)
        else:
            raise ValueError(f"unknown case {case!r}")

    def check(self) -> None:
        got = _result(self.once(), getattr(self, "out", self.inp))
        if got.shape != self.want.shape or not np.array_equal(got, self.want):
            raise RuntimeError(f"{self.case} of {self.nbytes} bytes returned wrong values; "
                               "the benchmark would be meaningless")
        if self.case == "allreduce":
            _numpy(self.inp)[...] = 0  # timed in-place sums then stay 0 (no overflow to inf)


def _time_loop(comm: Comm, once: Callable[[], Any], settings: Settings) -> dict[str, Any]:
    """Warm up, agree on an iteration count, time each iteration; slowest-rank summary."""
    t0 = time.perf_counter()
    for _ in range(2):
        once()
    est_s = max(_agreed(comm, (time.perf_counter() - t0) / 2), 1e-9)
    iters = int(min(settings.max_iters, max(settings.min_iters, settings.target_s / est_s)))
    warmup = int(min(settings.max_warmup, settings.warmup_s / est_s))
    for _ in range(warmup):
        once()
    comm.barrier()
    times = np.empty(iters, dtype=np.float64)
    clock = time.perf_counter
    for i in range(iters):
        t = clock()
        once()
        times[i] = clock() - t
    slowest = comm.max_across_ranks(times).tolist()
    return {"iters": iters, "warmup": warmup + 2, "median_s": median(slowest),
            "p90_s": percentile(slowest, 90.0), "min_s": min(slowest)}


def measure(comm: Comm, case: str, nbytes: int, settings: Settings) -> dict[str, Any]:
    """Time one collective ``case`` at ``nbytes``; returns a summary for the point."""
    comm.barrier()
    point = _Point(comm, case, nbytes)
    point.check()
    return {"bytes": nbytes, **_time_loop(comm, point.once, settings)}


def measure_latency(comm: Comm, settings: Settings) -> dict[str, Any]:
    """``latency_ops`` back-to-back 4-byte allreduces in ``latency_batches`` batches.

    Each batch is timed as a whole; a batch's per-op time is its time over its ops.
    """
    comm.barrier()
    _Point(comm, "allreduce", 4).check()
    buf = comm.make_buffer(np.zeros(1, dtype=np.float32))
    for _ in range(20):  # the first ops negotiate and fill caches: keep them out
        comm.allreduce_sum(buf)
    batches = max(1, settings.latency_batches)
    ops = max(1, settings.latency_ops // batches)
    per_op = np.empty(batches, dtype=np.float64)
    for b in range(batches):
        comm.barrier()
        t = time.perf_counter()
        for _ in range(ops):
            comm.allreduce_sum(buf)
        per_op[b] = (time.perf_counter() - t) / ops
    slowest = comm.max_across_ranks(per_op).tolist()
    return {"bytes": 4, "iters": ops * batches, "ops_per_batch": ops,
            "median_s": median(slowest), "p90_s": percentile(slowest, 90.0),
            "min_s": min(slowest)}


#: untimed passes of every fusion variant before the two that estimate its time
FUSION_WARMUP = 4


def measure_fusion(comm: Comm, settings: Settings) -> list[dict[str, Any]]:
    """ResNet-50's 161 gradient tensors as separate allreduces vs one buffer of their size.

    Three summaries, ``variant`` ``"single"``, ``"tensors"`` (161 separately allocated
    tensors) and ``"views"`` (the same 161 tensors as views of one buffer: the same
    calls, but memory laid out like the single buffer, which separates the cost of
    161 calls from the cost of their memory), all with ``bytes`` the total size
    (25,557,032 float32 values) and ``tensors`` the number of calls' tensors. The
    variants alternate iteration by iteration. Values are non-zero (the kernel may
    reclaim zero-filled huge pages, which real gradients are not).
    """
    shapes = resnet50_grad_shapes()
    total = sum(int(np.prod(s)) for s in shapes)
    comm.barrier()
    r, n = comm.rank, comm.size
    tensors = [comm.make_buffer(np.full(s, r + 1, dtype=np.float32)) for s in shapes]
    comm.allreduce_many(tensors)
    want = n * (n + 1) / 2
    if not all(np.all(_numpy(t) == want) for t in tensors):
        raise RuntimeError("fusion: the separate allreduces returned wrong values")
    single = comm.make_buffer(np.ones(total, dtype=np.float32))
    flat = comm.make_buffer(np.ones(total, dtype=np.float32))
    views, off = [], 0
    for s in shapes:
        count = int(np.prod(s))
        views.append(flat[off: off + count].reshape(s))
        off += count
    variants: list[tuple[str, Callable[[], Any]]] = [
        ("single", lambda: comm.allreduce_sum(single)),
        ("tensors", lambda: comm.allreduce_many(tensors)),
        ("views", lambda: comm.allreduce_many(views))]
    # warm up to the steady state of a training run (ronde moves memory its peers read
    # onto huge pages the second time it sees it and sizes its blocks over the first
    # few ops; every contender gets the same passes), estimate the time of a pass from
    # two more, agree on one iteration count, then alternate the variants iteration by
    # iteration so that a burst of machine noise hits them alike
    for _, once in variants * FUSION_WARMUP:
        once()
    t0 = time.perf_counter()
    for _, once in variants * 2:
        once()
    est_s = max(_agreed(comm, (time.perf_counter() - t0) / 2), 1e-9)
    iters = int(min(settings.max_iters, max(settings.min_iters, settings.target_s / est_s)))
    comm.barrier()
    times = np.empty((len(variants), iters), dtype=np.float64)
    clock = time.perf_counter
    for i in range(iters):
        for v, (_, once) in enumerate(variants):
            t = clock()
            once()
            times[v, i] = clock() - t
    slowest = comm.max_across_ranks(times.ravel()).reshape(times.shape)
    out = []
    for v, (variant, _) in enumerate(variants):
        row = slowest[v].tolist()
        out.append({"bytes": total * 4, "variant": variant, "tensors": 1 if v == 0 else
                    len(shapes), "iters": iters, "warmup": FUSION_WARMUP + 2,
                    "median_s": median(row),
                    "p90_s": percentile(row, 90.0), "min_s": min(row)})
    return out


def run_cases(comm: Comm, cases: list[str], sizes: list[int], settings: Settings,
              coll_sizes: list[int] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Run every requested case; ``{"allreduce": [point, ...], "latency": [point], ...}``.

    ``sizes`` are the allreduce sizes, ``coll_sizes`` (default: ``sizes``) those of the
    other collectives.
    """
    coll = sizes if coll_sizes is None else coll_sizes
    results: dict[str, list[dict[str, Any]]] = {}
    if "latency" in cases:
        results["latency"] = [measure_latency(comm, settings)]
    if "allreduce" in cases:
        results["allreduce"] = [measure(comm, "allreduce", s, settings) for s in sizes]
    for case in COLLECTIVES:
        if case in cases:
            results[case] = [measure(comm, case, s, settings) for s in coll]
    if "fusion" in cases:
        results["fusion"] = measure_fusion(comm, settings)
    return results
