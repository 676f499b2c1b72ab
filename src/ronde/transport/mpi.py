"""The mpi data plane: collectives as MPI calls through mpi4py.

``RONDE_TRANSPORT=mpi`` (or ``ronderun --mpi``) is for clusters whose fast path is
their MPI: the workers run under ``mpirun``/``mpiexec``/``srun``, ronde's engine
negotiates, fuses and validates as always, and each agreed collective becomes one
MPI call on the numpy buffer (``Allreduce`` with ``IN_PLACE``, ``Allgatherv``,
``Bcast``, ``Alltoallv``, ``Reduce_scatter``, ``Barrier``). A process set becomes an
MPI communicator made with ``Create_group`` by its members.

MPI has no 16-bit float types: float16 and bfloat16 reductions use a user-defined
MPI op that reduces with numpy. mpi4py is imported only when this transport is
chosen; its import initialises MPI with ``MPI_THREAD_MULTIPLE`` (the executor
thread makes the calls).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import ConfigError
from ..collectives.ops import ReduceOp, reduce_into
from .base import Communicator

_HALF_OPS: dict[tuple[str, int], Any] = {}


def mpi() -> Any:
    """The ``mpi4py.MPI`` module, or a ConfigError that says what to install."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError("RONDE_TRANSPORT=mpi needs mpi4py and an MPI library: "
                          "pip install 'ronde[mpi]' (mpi4py + MPICH from PyPI), or use "
                          "RONDE_TRANSPORT=shm/tcp") from None
    return MPI


def check_world(rank: int, size: int) -> Any:
    """Check MPI agrees with ronde about who is who; return COMM_WORLD."""
    MPI = mpi()
    world = MPI.COMM_WORLD
    if world.Get_size() != size or world.Get_rank() != rank:
        raise ConfigError(
            f"RONDE_TRANSPORT=mpi: MPI says rank {world.Get_rank()} of {world.Get_size()}, "
            f"ronde says rank {rank} of {size}; start the job with mpirun/mpiexec (or "
            "ronderun --mpi) so that both agree")
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise ConfigError("RONDE_TRANSPORT=mpi needs an MPI initialised with at least "
                          "MPI_THREAD_SERIALIZED (ronde calls MPI from its executor thread)")
    return world


def _half_op(dtype: np.dtype, op: ReduceOp) -> Any:
    key = (dtype.name, int(op))
    found = _HALF_OPS.get(key)
    if found is None:
        MPI = mpi()

        def apply(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            a = np.frombuffer(inbuf, dtype=dtype)
            b = np.frombuffer(inoutbuf, dtype=dtype)
            reduce_into(b, a, op)

        found = _HALF_OPS[key] = MPI.Op.Create(apply, commute=True)
    return found


class MPICommunicator(Communicator):
    """Collectives of one process set through an mpi4py communicator."""

    name = "mpi"

    def __init__(self, comm: Any) -> None:
        self.MPI = mpi()
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        M = self.MPI
        self._ops = {ReduceOp.SUM: M.SUM, ReduceOp.AVERAGE: M.SUM, ReduceOp.MIN: M.MIN,
                     ReduceOp.MAX: M.MAX, ReduceOp.PRODUCT: M.PROD}

    @staticmethod
    def create(world: Any, members: list[int], rank: int) -> "MPICommunicator | None":
        """Build the communicator of a process set (collective over its members only)."""
        if len(members) == world.Get_size():
            return MPICommunicator(world.Dup())
        if rank not in members:
            return None
        group = world.Get_group().Incl(members)
        return MPICommunicator(world.Create_group(group))

    def _bytes(self, arr: np.ndarray) -> Any:
        """Data movement needs no types: any dtype travels as bytes."""
        return [arr.reshape(-1).view(np.uint8), self.MPI.BYTE]

    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        if not buf.size:
            return
        if buf.dtype.name in ("float16", "bfloat16"):
            self.comm.Allreduce(self.MPI.IN_PLACE, [buf.view(np.uint16), self.MPI.UINT16_T],
                                op=_half_op(buf.dtype, op))
        else:
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self._ops[op])

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        item = send.dtype.itemsize
        nbytes = [c * item for c in counts]
        displs = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(int).tolist()
        out = recv.reshape(-1).view(np.uint8)
        if np.may_share_memory(send, recv):
            # the input in the output (a sharded optimizer sends its own block of it): MPI
            # forbids aliased buffers (MPICH refuses them), its in-place form reads the block
            lo = displs[self.rank]
            out[lo:lo + nbytes[self.rank]] = send.reshape(-1).view(np.uint8)  # none if it is
            self.comm.Allgatherv(self.MPI.IN_PLACE, [out, nbytes, displs, self.MPI.BYTE])
            return
        self.comm.Allgatherv(self._bytes(send), [out, nbytes, displs, self.MPI.BYTE])

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if buf.size:
            self.comm.Bcast(self._bytes(buf), root=root)

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int]) -> None:
        item = send.dtype.itemsize
        sc = [c * item for c in send_counts]
        rc = [c * item for c in recv_counts]
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]]).astype(int).tolist()
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]]).astype(int).tolist()
        self.comm.Alltoallv([send.reshape(-1).view(np.uint8), sc, sd, self.MPI.BYTE],
                            [recv.reshape(-1).view(np.uint8), rc, rd, self.MPI.BYTE])

    def reducescatter(self, buf: np.ndarray, counts: list[int], op: ReduceOp,
                      out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty(counts[self.rank], dtype=buf.dtype)
        if buf.dtype.name in ("float16", "bfloat16"):
            work = buf.copy()
            self.allreduce(work, op)
            start = sum(counts[: self.rank])
            out[:] = work[start: start + counts[self.rank]]
            return out
        self.comm.Reduce_scatter(buf, out, recvcounts=counts, op=self._ops[op])
        return out

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - freeing at shutdown is best effort
            pass
