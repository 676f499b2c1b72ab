"""The communicator interface the executor calls, and its point-to-point implementation.

A *communicator* runs one collective among the members of one process set, on
flat contiguous numpy buffers. The engine never cares how: over sockets with the
algorithms in :mod:`ronde.collectives` (:class:`P2PCommunicator`), through shared
memory (:class:`ronde.transport.shm.ShmCommunicator`), or alone
(:class:`SelfCommunicator`). All ranks call the same sequence of methods.
"""

from __future__ import annotations

import abc

import numpy as np

from typing import Sequence

from .. import collectives as algo
from ..collectives.ops import ReduceOp
from ..collectives.p2p import P2P
from . import strategies


class Communicator(abc.ABC):
    """Collectives among ``size`` ranks; ``rank`` is this process's index in the group.

    Besides the collectives, a communicator declares what the executor may rely on:
    its allreduce strategies, in the order to try them (:mod:`.strategies`), and the
    capabilities below. ``name`` is for people (logs, ``active_transport()``); the
    executor never reads it.
    """

    rank: int
    size: int
    name: str = "base"
    #: how a fused allreduce runs here, in order (the first that takes a plan runs it)
    allreduce_strategies: Sequence[strategies.Strategy] = strategies.DEFAULT
    #: ``alltoallv`` wants ``max_count`` (the largest block of any rank, in elements)
    alltoall_takes_max_count: bool = False
    #: ``reducescatter`` leaves its input alone (else the executor passes a copy)
    reducescatter_keeps_input: bool = False

    def reads_peers(self, nbytes: int, n_tensors: int) -> bool:
        """Whether an allreduce of this shape reads the peers' tensors in place, so that
        no fusion buffer bounds it (a round's fused groups then run as one operation):
        decided from what every member knows alike, the same on every rank; False
        unless the transport can."""
        return False

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``buf`` (1-D) in place across the group."""

    @abc.abstractmethod
    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        """``recv`` (sum(counts) elements) gets block r = rank r's ``send``."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy the root's ``buf`` into everyone's ``buf`` (root is a group index)."""

    @abc.abstractmethod
    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int]) -> None:
        """Block i of ``send`` goes to rank i; ``recv`` holds the blocks in rank order."""

    @abc.abstractmethod
    def reducescatter(self, buf: np.ndarray, counts: list[int], op: ReduceOp,
                      out: np.ndarray | None = None) -> np.ndarray:
        """Reduce ``buf`` across ranks; return this rank's block (``counts[rank]`` items):
        ``out`` itself where the transport reduced straight into it, else a new array."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every member reached the barrier."""

    def staging(self, nbytes: int) -> np.ndarray | None:
        """A byte buffer the engine may fuse into, if that saves a copy (shm); else None."""
        return None

    def allreduce_staged(self, nbytes: int, dtype: np.dtype, op: ReduceOp
                         ) -> list[tuple[int, np.ndarray]]:
        """Allreduce the first ``nbytes`` of :meth:`staging`.

        Returns the result as ``(element offset, flat view)`` pieces in order; the
        views stay valid until :meth:`release`.
        """
        raise NotImplementedError

    def release(self) -> None:
        """Done reading the pieces returned by :meth:`allreduce_staged`."""

    def close(self) -> None:
        """Release resources (sockets are owned by the mesh, not closed here)."""


class SelfCommunicator(Communicator):
    """The group of one: every collective is a copy (or nothing)."""

    name = "self"

    def __init__(self) -> None:
        self.rank, self.size = 0, 1

    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        return None

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        recv[: send.size] = send

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        return None

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int]) -> None:
        recv[:] = send[: recv.size]

    def reducescatter(self, buf: np.ndarray, counts: list[int], op: ReduceOp,
                      out: np.ndarray | None = None) -> np.ndarray:
        return buf[: counts[0]].copy()

    def barrier(self) -> None:
        return None


class P2PCommunicator(Communicator):
    """Collectives built from point-to-point messages (tcp, loopback)."""

    def __init__(self, p2p: P2P, small_bytes: int = 64 * 1024, name: str = "tcp") -> None:
        self.p2p = p2p
        self.rank, self.size = p2p.rank, p2p.size
        self.small_bytes = small_bytes
        self.name = name

    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        algo.allreduce(self.p2p, buf, op, small_bytes=self.small_bytes)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        algo.allgatherv(self.p2p, send, recv, counts)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        algo.broadcast(self.p2p, buf, root)

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int]) -> None:
        algo.alltoallv(self.p2p, send, send_counts, recv, recv_counts)

    def reducescatter(self, buf: np.ndarray, counts: list[int], op: ReduceOp,
                      out: np.ndarray | None = None) -> np.ndarray:
        return algo.reducescatter(self.p2p, buf, counts, op)

    def barrier(self) -> None:
        algo.barrier(self.p2p)
