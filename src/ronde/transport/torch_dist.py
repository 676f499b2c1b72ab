"""The gloo data plane: collectives through a torch.distributed Gloo process group.

``RONDE_TRANSPORT=gloo`` keeps ronde's engine (negotiation, fusion, validation,
diagnostics) and moves the bytes with Gloo, for clusters that standardise on it.
numpy buffers become torch tensors with ``torch.from_numpy`` (no copy; bfloat16 is
reinterpreted bit for bit). torch is imported only when this transport is chosen.

Gloo has no variable-size allgather and no reduce-scatter: ``allgatherv`` pads every
block to the largest, and ``reducescatter`` is an allreduce followed by taking this
rank's block (twice the traffic of a true reduce-scatter); both are documented.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable

import numpy as np

from .._errors import ConfigError
from ..collectives.ops import ReduceOp
from .base import Communicator


def _torch() -> Any:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise ConfigError("RONDE_TRANSPORT=gloo needs PyTorch: pip install torch "
                          "(or choose RONDE_TRANSPORT=shm/tcp)") from None
    if not dist.is_available():
        raise ConfigError("this PyTorch build has no torch.distributed; use shm or tcp")
    return torch


def master_store(host: str, timeout_s: float) -> Any:
    """A serving ``TCPStore``, listening on a port the kernel picks before any peer
    learns it (a port picked by binding and closing could be taken in between)."""
    dist = _torch().distributed
    return dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_world(rank: int, size: int, store_addr: str, store_port: int, timeout_s: float,
               store: Any = None) -> None:
    """Create the default Gloo process group (every rank, once per ``ronde.init``);
    rank 0 passes its :func:`master_store`."""
    torch = _torch()
    dist = torch.distributed
    if dist.is_initialized():
        dist.destroy_process_group()
    if store is None:
        store = dist.TCPStore(store_addr, store_port, size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=max(timeout_s, 60.0)))
    adopt(world=True)


#: torch.distributed state ronde created and must tear down at shutdown (see below)
_owned_world = False
_cleanups: list[Callable[[], None]] = []


def adopt(cleanup: Callable[[], None] | None = None, world: bool = False) -> None:
    """Record process groups ronde made: the default group (``world``) and others that
    ``cleanup`` drops; :func:`destroy_world` tears them down at ``shutdown()``."""
    global _owned_world
    _owned_world = _owned_world or world
    if cleanup is not None and cleanup not in _cleanups:
        _cleanups.append(cleanup)


def holds_groups() -> bool:
    return _owned_world or bool(_cleanups)


def destroy_world(barrier: Callable[[], None] | None) -> None:
    """Tear down the process groups ronde made (so ``init`` can build new ones, and so
    that none is left to the process's exit, where Gloo may abort the process with
    "terminate called without an active exception").

    No rank may destroy its groups while a peer still waits for a message on them: a
    rank closes its pairs and that message is lost, and the peer waits for ever (or
    Gloo aborts the process). ``barrier`` is a meeting over ronde's own sockets, after
    every rank's engine has drained, so when it returns no Gloo operation is in flight
    anywhere. (``monitored_barrier`` cannot do this job: its rank 0 returns before its
    replies are sent, and destroying the group then can lose them.) Without a barrier,
    or when it fails (a peer is gone), the groups are left to the process's exit.
    """
    global _owned_world
    if not holds_groups() or barrier is None:
        return
    try:
        barrier()
    except Exception as exc:  # noqa: BLE001 - a peer is gone: leave the groups to exit
        # Gloo may abort this process at exit then ("terminate called without an active
        # exception"): say why, so that such an abort can be traced to this
        logging.getLogger(__name__).warning(
            "ronde: the Gloo process group is left to process exit: the closing barrier "
            "failed (%s)", exc)
        return
    for cleanup in _cleanups:
        cleanup()
    _cleanups.clear()
    dist = _torch().distributed
    if _owned_world and dist.is_initialized():
        dist.destroy_process_group()
    _owned_world = False


def new_group(members: list[int], size: int) -> Any:
    """A Gloo group for a process set; every rank of the job must call this, in order."""
    dist = _torch().distributed
    if len(members) == size:
        return dist.group.WORLD
    return dist.new_group(ranks=members, backend="gloo")


class TorchDistCommunicator(Communicator):
    """Collectives of one process set through its Gloo group."""

    name = "gloo"

    def __init__(self, group: Any, rank: int, members: list[int]) -> None:
        self.torch = _torch()
        self.dist = self.torch.distributed
        self.group = group
        self.members = members
        self.rank, self.size = members.index(rank), len(members)
        r = self.dist.ReduceOp
        self._ops = {ReduceOp.SUM: r.SUM, ReduceOp.AVERAGE: r.SUM, ReduceOp.MIN: r.MIN,
                     ReduceOp.MAX: r.MAX, ReduceOp.PRODUCT: r.PRODUCT}

    def _tensor(self, arr: np.ndarray) -> Any:
        if arr.dtype.name == "bfloat16":
            return self.torch.from_numpy(arr.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(arr)

    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        if buf.size:
            self.dist.all_reduce(self._tensor(buf), op=self._ops[op], group=self.group)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        width = max(counts) if counts else 0
        if width == 0:
            return
        padded = np.zeros(width * self.size, dtype=send.dtype)
        mine = padded[self.rank * width: self.rank * width + send.size]
        mine[:] = send
        parts = [self._tensor(padded[i * width:(i + 1) * width]) for i in range(self.size)]
        self.dist.all_gather(parts, parts[self.rank].clone(), group=self.group)
        off = 0
        for i, n in enumerate(counts):
            recv[off: off + n] = padded[i * width: i * width + n]
            off += n

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if buf.size:
            self.dist.broadcast(self._tensor(buf), src=self.members[root], group=self.group)

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int]) -> None:
        if not send.size and not recv.size:
            self.barrier()
            return
        self.dist.all_to_all_single(self._tensor(recv), self._tensor(send),
                                    output_split_sizes=list(recv_counts),
                                    input_split_sizes=list(send_counts), group=self.group)

    def reducescatter(self, buf: np.ndarray, counts: list[int], op: ReduceOp,
                      out: np.ndarray | None = None) -> np.ndarray:
        work = buf.copy()
        self.allreduce(work, op)
        start = sum(counts[: self.rank])
        return work[start: start + counts[self.rank]].copy()

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)
