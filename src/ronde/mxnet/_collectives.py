"""Collectives on ``mx.nd.NDArray`` (Horovod's ``horovod.mxnet`` functions).

Every function copies the array to host memory (``asnumpy()``: it also waits for
MXNet's asynchronous engine to finish writing it), runs the one runtime
implementation in :mod:`ronde._api` on it, and returns a new NDArray in the input's
context, or writes the result back into the input for the in-place ``*_`` forms.
The calls block until the collective is done. ``priority`` is accepted for
Horovod compatibility and ignored (ronde orders collectives by negotiation).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import mxnet as mx
import numpy as np

from ..frameworks.compression import Compresses
from .. import _api
from .. import _grouped as grouped_ops
from .._ops import ReduceOp
from ..frameworks.compression import NUMPY_COMPRESSION
from ..frameworks.gradients import Reduction
from ..frameworks.host_reduce import fused_allreduce
from ..process_sets import ProcessSet, global_process_set

logger = logging.getLogger(__name__)


def to_host(tensor: Any, what: str) -> np.ndarray:
    """A contiguous numpy copy of an NDArray (after MXNet finished writing it)."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{what} expects an mx.nd.NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise TypeError(f"{what} expects a dense NDArray, got stype={tensor.stype!r}; call "
                        ".tostype('default') first")
    return _api.as_array(tensor.asnumpy(), what)


def from_host(arr: np.ndarray, like: Any) -> mx.nd.NDArray:
    """A new NDArray with ``arr``'s values, in ``like``'s context (CPU if None)."""
    ctx = like.context if like is not None else mx.cpu()
    return mx.nd.array(arr, ctx=ctx, dtype=arr.dtype)


def write_back(tensor: mx.nd.NDArray, arr: np.ndarray) -> mx.nd.NDArray:
    """Overwrite ``tensor``'s values with ``arr`` (same shape) and return ``tensor``."""
    tensor[:] = arr
    return tensor


def resolve_op(op: Any, average: bool | None) -> ReduceOp:
    """Horovod's ``op``/``average`` arguments as one ``ReduceOp`` (default Average)."""
    return _api.resolve_op(op, average, what="allreduce", allowed=_api.ALLREDUCE_OPS)


def group_names(name: str | None, n: int, process_set: ProcessSet | None,
                kind: str = "grouped_allreduce") -> list[str]:
    """Names of the members of a grouped collective: ``<name>.<i>``."""
    return _api.group_names(kind, name, n, process_set)


# -- allreduce -----------------------------------------------------------------------------
def allreduce(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: Any = None) -> mx.nd.NDArray:
    """Reduce ``tensor`` over the ranks of the process set; returns a new NDArray.

    Args:
        tensor: the array (same shape and dtype on every rank).
        average: deprecated; ``True`` means ``op=Average``, ``False`` ``op=Sum``.
        name: the collective's name (automatic when None; ranks match by name).
        priority: ignored (Horovod compatibility).
        prescale_factor: multiplies each input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part (default: all).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
    """
    out = _api.allreduce(to_host(tensor, "allreduce"), None, name, resolve_op(op, average),
                         prescale_factor, postscale_factor, process_set)
    return from_host(out, tensor)


def allreduce_(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: Any = None) -> mx.nd.NDArray:
    """In-place :func:`allreduce`: ``tensor`` gets the result and is returned."""
    out = _api.allreduce(to_host(tensor, "allreduce_"), None, name, resolve_op(op, average),
                         prescale_factor, postscale_factor, process_set)
    return write_back(tensor, out)


def _grouped(tensors: Sequence[mx.nd.NDArray], average: bool | None, name: str | None,
             prescale: float, postscale: float, process_set: ProcessSet,
             op: Any) -> list[np.ndarray]:
    resolved = resolve_op(op, average)
    hosts = [to_host(t, "grouped_allreduce") for t in tensors]
    with _api.together():  # one negotiation round for the group
        handles = [_api.allreduce_async(h, None, n, resolved, prescale, postscale, process_set)
                   for h, n in zip(hosts, group_names(name, len(hosts), process_set))]
    return [h.wait() for h in handles]


def grouped_allreduce(tensors: Sequence[mx.nd.NDArray], average: bool | None = None,
                      name: str | None = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      op: Any = None) -> list[mx.nd.NDArray]:
    """Allreduce a list of arrays together (member ``i`` is ``<name>.<i>``); new arrays."""
    outs = _grouped(tensors, average, name, prescale_factor, postscale_factor, process_set, op)
    return [from_host(o, t) for o, t in zip(outs, tensors)]


def grouped_allreduce_(tensors: Sequence[mx.nd.NDArray], average: bool | None = None,
                       name: str | None = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       op: Any = None) -> list[mx.nd.NDArray]:
    """In-place :func:`grouped_allreduce`; returns the input list."""
    outs = _grouped(tensors, average, name, prescale_factor, postscale_factor, process_set, op)
    return [write_back(t, o) for o, t in zip(outs, tensors)]


def fused_allreduce_(tensors: Sequence[mx.nd.NDArray], name: str, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set,
                     compression: Compresses = NUMPY_COMPRESSION.none) -> list[mx.nd.NDArray]:
    """Allreduce arrays in place as one flat buffer per dtype, with compression.

    The buffer of dtype ``d`` is the collective ``<name>.<d>``; see
    :func:`ronde.frameworks.host_reduce.fused_allreduce`.
    """
    return reduce_fused_(tensors, name, Reduction(int(resolve_op(op, None)), prescale_factor,
                                                  postscale_factor, compression, process_set))


def reduce_fused_(tensors: Sequence[mx.nd.NDArray], name: str,
                  reduction: Reduction) -> list[mx.nd.NDArray]:
    """:func:`fused_allreduce_` as ``reduction`` says (the optimizers' gradients)."""
    hosts = [to_host(t, name) for t in tensors]
    outs = fused_allreduce(hosts, name, reduction)
    return [write_back(t, o) for o, t in zip(outs, tensors)]


# -- allgather, broadcast, alltoall, reducescatter ------------------------------------------
def allgather(tensor: mx.nd.NDArray, name: str | None = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Concatenate every rank's array along the first dimension, in rank order."""
    return from_host(_api.allgather(to_host(tensor, "allgather"), name, process_set), tensor)


def broadcast(tensor: mx.nd.NDArray, root_rank: int, name: str | None = None,
              priority: int = 0, process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """The root's array on every rank, as a new NDArray."""
    out = _api.broadcast(to_host(tensor, "broadcast"), root_rank, name, process_set)
    return from_host(out, tensor)


def broadcast_(tensor: mx.nd.NDArray, root_rank: int, name: str | None = None,
               priority: int = 0, process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Overwrite ``tensor`` with the root's values, in place; returns it."""
    out = _api.broadcast(to_host(tensor, "broadcast_"), root_rank, name, process_set)
    return write_back(tensor, out)


def alltoall(tensor: mx.nd.NDArray, splits: Any = None, name: str | None = None,
             priority: int = 0, process_set: ProcessSet = global_process_set) -> Any:
    """Send block ``i`` of the first dimension to rank ``i``.

    Without ``splits`` the blocks are equal and the result is one NDArray; with
    ``splits`` (an NDArray or sequence of row counts) the result is
    ``(output, received_splits)`` as in Horovod.
    """
    if isinstance(splits, mx.nd.NDArray):
        if not np.issubdtype(splits.dtype, np.integer):
            raise ValueError(f"alltoall splits must be integers (int32), got {splits.dtype}")
        splits = splits.asnumpy()
    sp = None if splits is None else [int(v) for v in np.asarray(splits).reshape(-1)]
    raw = _api.alltoall(to_host(tensor, "alltoall"), sp, name, process_set)
    if isinstance(raw, tuple):
        return from_host(raw[0], tensor), mx.nd.array(np.asarray(raw[1]), dtype="int32")
    return from_host(raw, tensor)


def reducescatter(tensor: mx.nd.NDArray, op: Any = ReduceOp.AVERAGE, name: str | None = None,
                  priority: int = 0, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> mx.nd.NDArray:
    """Reduce over ranks; rank ``r`` of the set gets its block of the first dimension."""
    out = _api.reducescatter(to_host(tensor, "reducescatter"), op, name, process_set,
                             prescale_factor, postscale_factor)
    return from_host(out, tensor)


def grouped_allgather(tensors: Sequence[mx.nd.NDArray], name: str | None = None,
                      priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> list[mx.nd.NDArray]:
    """Allgather every array of the list (``<name>.<i>`` each), all started at once."""
    hosts = [to_host(t, "grouped_allgather") for t in tensors]
    outs = grouped_ops.grouped_allgather_async(hosts, name, process_set).wait()
    return [from_host(o, t) for o, t in zip(outs, tensors)]


def grouped_reducescatter(tensors: Sequence[mx.nd.NDArray], op: Any = ReduceOp.AVERAGE,
                          name: str | None = None, priority: int = 0,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[mx.nd.NDArray]:
    """Reducescatter every array of the list (``<name>.<i>`` each), all started at once."""
    hosts = [to_host(t, "grouped_reducescatter") for t in tensors]
    outs = grouped_ops.grouped_reducescatter_async(hosts, op, name, process_set, prescale_factor,
                                            postscale_factor).wait()
    return [from_host(o, t) for o, t in zip(outs, tensors)]
