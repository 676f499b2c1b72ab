"""The ronde worker: ``ronderun -np N --transport T python -m ronde.bench._worker ...``.

Every rank runs :func:`ronde.bench._timing.run_cases` through the public numpy API
(blocking ``ronde.allreduce(buf, op=ronde.Sum, name="bench")``, engine included);
rank 0 writes the summary as JSON to ``--out``. :func:`worker_arguments` is the command
line shared with the Gloo worker (:mod:`ronde.bench._gloo`).
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
from ._timing import Settings, run_cases


def worker_arguments(prog: str) -> argparse.ArgumentParser:
    """The flags every worker takes (the driver builds them with :func:`worker_argv`)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--cases", required=True, help="comma list: allreduce,latency")
    p.add_argument("--sizes", required=True, help="comma list of byte counts")
    p.add_argument("--target-s", type=float, default=0.5)
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    return p


def worker_argv(cases: Sequence[str], sizes: Sequence[int], settings: Settings,
                out: Path) -> list[str]:
    """The flags for :func:`worker_arguments` that reproduce ``cases``/``sizes``/``settings``."""
    return ["--cases", ",".join(cases), "--sizes", ",".join(str(s) for s in sizes),
            "--target-s", repr(settings.target_s), "--min-iters", str(settings.min_iters),
            "--max-iters", str(settings.max_iters), "--out", str(out)]


def settings_from(args: argparse.Namespace) -> Settings:
    """The :class:`Settings` a parsed worker command line asks for."""
    return Settings(target_s=args.target_s, min_iters=args.min_iters, max_iters=args.max_iters)


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
        results = run_cases(comm, args.cases.split(","),
                            [int(s) for s in args.sizes.split(",")], settings_from(args))
        if comm.rank == 0:
            write_result(args.out, f"ronde-{ronde.active_transport()}", comm.size, results,
                         {"ronde": __version__})
    finally:
        ronde.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
