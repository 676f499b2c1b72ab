"""The Gloo peer: torch.distributed's ``gloo`` backend, timed by the same loop.

Collectives: in-place ``all_reduce`` (161 blocking calls for the fusion case),
``all_gather_into_tensor``, in-place ``broadcast``, ``reduce_scatter_tensor`` and
``all_to_all_single``, into preallocated outputs.

The driver starts one process per rank (:func:`launch_gloo`) running
``python -m ronde.bench._gloo --rank R --world N --port P ...``; they meet with
``init_process_group("gloo", init_method="tcp://127.0.0.1:P")``. For fairness with
ronde's single-threaded numpy reductions, workers run with ``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)``. torch is optional: :func:`torch_available` says whether
this contender can run.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

from ._worker import run_from_args, worker_arguments, write_result


def torch_available() -> bool:
    """True if ``import torch`` can work here (checked without importing it)."""
    return importlib.util.find_spec("torch") is not None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class GlooComm:
    """:class:`ronde.bench._timing.Comm` over ``torch.distributed`` (in-place allreduce)."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        self._torch = torch
        self._dist = dist
        self.rank = rank
        self.size = world

    def make_buffer(self, values: np.ndarray) -> Any:
        return self._torch.from_numpy(values.copy())

    def allreduce_sum(self, buf: Any) -> None:
        self._dist.all_reduce(buf, op=self._dist.ReduceOp.SUM)

    def allreduce_many(self, bufs: list[Any]) -> None:
        # blocking calls one after the other: Gloo's all_reduce has no fusion to exploit
        for b in bufs:
            self._dist.all_reduce(b, op=self._dist.ReduceOp.SUM)

    def allgather(self, buf: Any, out: Any) -> None:
        self._dist.all_gather_into_tensor(out, buf)

    def broadcast(self, buf: Any) -> None:
        self._dist.broadcast(buf, 0)

    def reducescatter(self, buf: Any, out: Any) -> None:
        self._dist.reduce_scatter_tensor(out, buf, op=self._dist.ReduceOp.SUM)

    def alltoall(self, buf: Any, out: Any) -> None:
        self._dist.all_to_all_single(out, buf)

    def max_across_ranks(self, values: np.ndarray) -> np.ndarray:
        t = self._torch.from_numpy(values.copy())
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        result: np.ndarray = t.numpy()
        return result

    def barrier(self) -> None:
        self._dist.barrier()

    def close(self) -> None:
        self._dist.destroy_process_group()


def launch_gloo(np_: int, worker_flags: Sequence[str], timeout_s: float) -> tuple[int, str]:
    """Run one Gloo job of ``np_`` ranks; returns (exit code, captured stderr of failures).

    If a rank fails the others are killed (they would wait for it forever).
    """
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-m", "ronde.bench._gloo", "--rank", str(r),
                               "--world", str(np_), "--port", str(port), *worker_flags],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
             for r in range(np_)]
    deadline = time.monotonic() + timeout_s
    rc = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            rc = failed[0].returncode if failed else 124
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    errors = []
    for r, p in enumerate(procs):
        _, err = p.communicate()
        rc = rc or p.returncode
        if p.returncode:
            errors.append(f"gloo rank {r} exited {p.returncode}:\n{err[-2000:]}")
    return rc, "\n".join(errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one Gloo rank."""
    p = worker_arguments("python -m ronde.bench._gloo")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    comm = GlooComm(args.rank, args.world, args.port)
    try:
        results = run_from_args(comm, args)
        if comm.rank == 0:
            import torch

            write_result(args.out, "gloo", comm.size, results, {"torch": torch.__version__})
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(None if len(sys.argv) > 1 else ["--help"]))
