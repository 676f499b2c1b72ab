"""The ronde worker: ``ronderun -np N --transport T python -m ronde.bench._worker ...``.

Every rank runs :func:`ronde.bench._timing.run_cases` through the public numpy API,
engine included: in-place ``allreduce_async(buf, op=Sum, name=..., out=buf).wait()``
and ``broadcast_async(buf, 0, name=..., out=buf).wait()``; the functional
``allgather``, ``reducescatter`` and ``alltoall`` (they return new arrays: the API has
no ``out=`` for them); for the fusion case, one named ``allreduce_async(..., out=t)``
per tensor, all submitted, then all waited. Rank 0 writes the summary as JSON to
``--out``. :func:`worker_arguments` is the command line shared with the peer workers
(:mod:`ronde.bench._gloo`, :mod:`ronde.bench._mpi`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import __version__
from .._ops import Max, Sum
from ._timing import Comm, Settings, run_cases


def worker_arguments(prog: str) -> argparse.ArgumentParser:
    """The flags every worker takes (the driver builds them with :func:`worker_argv`)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--cases", required=True, help="comma list: allreduce,latency,...")
    p.add_argument("--sizes", required=True, help="comma list of allreduce byte counts")
    p.add_argument("--coll-sizes", default=None,
                   help="comma list of byte counts for allgather .. alltoall")
    p.add_argument("--latency-ops", type=int, default=10_000)
    p.add_argument("--target-s", type=float, default=0.5)
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    return p


def worker_argv(cases: Sequence[str], sizes: Sequence[int], settings: Settings,
                out: Path, coll_sizes: Sequence[int] | None = None) -> list[str]:
    """The flags for :func:`worker_arguments` that reproduce the driver's request."""
    argv = ["--cases", ",".join(cases), "--sizes", ",".join(str(s) for s in sizes),
            "--target-s", repr(settings.target_s), "--min-iters", str(settings.min_iters),
            "--max-iters", str(settings.max_iters), "--latency-ops",
            str(settings.latency_ops), "--out", str(out)]
    if coll_sizes is not None:
        argv += ["--coll-sizes", ",".join(str(s) for s in coll_sizes)]
    return argv


def settings_from(args: argparse.Namespace) -> Settings:
    """The :class:`Settings` a parsed worker command line asks for."""
    return Settings(target_s=args.target_s, min_iters=args.min_iters, max_iters=args.max_iters,
                    latency_ops=args.latency_ops)


def run_from_args(comm: Comm, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run_cases` with the cases, sizes and settings of a parsed command line."""
    coll = [int(s) for s in args.coll_sizes.split(",")] if args.coll_sizes else None
    return run_cases(comm, args.cases.split(","), [int(s) for s in args.sizes.split(",")],
                     settings_from(args), coll)


def write_result(path: str, impl: str, np_: int, results: dict[str, Any],
                 extra: dict[str, Any]) -> None:
    """Write rank 0's summary (results plus the versions that produced them)."""
    doc = {"impl": impl, "np": np_, "results": results, "python": platform.python_version(),
           "numpy": np.__version__, **extra}
    Path(path).write_text(json.dumps(doc))


class RondeComm:
    """:class:`ronde.bench._timing.Comm` over ronde's public numpy API.

    ``ronde._api`` holds the very functions the ``ronde`` facade re-exports lazily;
    importing it directly keeps them typed.
    """

    def __init__(self) -> None:
        from .. import _api

        self._ronde = _api
        self.rank = _api.rank()
        self.size = _api.size()

    def make_buffer(self, values: np.ndarray) -> np.ndarray:
        return values

    def allreduce_sum(self, buf: np.ndarray) -> np.ndarray:
        # In place (the path of ronde.torch's allreduce_), like the peers' in-place
        # all_reduce; the functional allreduce() also pays for a fresh output array.
        return self._ronde.allreduce_async(buf, op=Sum, name="bench", out=buf).wait()

    def allreduce_many(self, bufs: list[np.ndarray]) -> None:
        allreduce_async = self._ronde.allreduce_async
        handles = [allreduce_async(b, op=Sum, name=f"bench.grad.{i}", out=b)
                   for i, b in enumerate(bufs)]
        for h in handles:
            h.wait()

    def allgather(self, buf: np.ndarray, out: np.ndarray) -> np.ndarray:
        return self._ronde.allgather(buf, name="bench.allgather")

    def broadcast(self, buf: np.ndarray) -> np.ndarray:
        return self._ronde.broadcast_async(buf, 0, name="bench.broadcast", out=buf).wait()

    def reducescatter(self, buf: np.ndarray, out: np.ndarray) -> np.ndarray:
        return self._ronde.reducescatter(buf, op=Sum, name="bench.reducescatter")

    def alltoall(self, buf: np.ndarray, out: np.ndarray) -> np.ndarray:
        result: np.ndarray = self._ronde.alltoall(buf, name="bench.alltoall")
        return result

    def max_across_ranks(self, values: np.ndarray) -> np.ndarray:
        return self._ronde.allreduce(values, op=Max, name=f"bench.max.{values.size}")

    def barrier(self) -> None:
        self._ronde.barrier()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one ronde rank."""
    args = worker_arguments("python -m ronde.bench._worker").parse_args(argv)
    from .. import _api as ronde

    ronde.init()
    try:
        comm = RondeComm()
        results = run_from_args(comm, args)
        if comm.rank == 0:
            write_result(args.out, f"ronde-{ronde.active_transport()}", comm.size, results,
                         {"ronde": __version__})
    finally:
        ronde.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
