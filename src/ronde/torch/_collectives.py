"""Async and in-place collectives on torch tensors (the non-differentiable layer).

Every function hands the tensor's numpy view to the one runtime implementation in
:mod:`ronde._api` and returns a :class:`~ronde.torch._tensors.TorchHandle` whose
``wait()`` (or ``hvd.synchronize(handle)``) gives the torch result. Signatures are
Horovod's ``horovod.torch`` ones. The differentiable blocking forms live in
:mod:`ronde.torch._autograd`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import _api
from .._ops import ReduceOp
from ..frameworks.gradients import Reduction
from ..process_sets import ProcessSet, global_process_set
from . import _device
from ._tensors import (Allocator, MultiHandle, SparseHandle, TorchHandle, host, numpy_view,
                       to_device)

logger = logging.getLogger(__name__)


def from_numpy(arr: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing memory with a numpy array (bfloat16 included)."""
    if str(arr.dtype) == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _result(alloc: Allocator, raw: Any, like: torch.Tensor) -> torch.Tensor:
    out = alloc.tensor if alloc.tensor is not None else from_numpy(np.asarray(raw))
    return to_device(out, like)


def _inplace(tensor: torch.Tensor, staged: torch.Tensor) -> Any:
    """The converter of an in-place collective: copy back only if ``staged`` is a copy."""
    copied = staged is not tensor and (
        staged.device != tensor.device or staged.data_ptr() != tensor.data_ptr()
        or staged.stride() != tensor.stride())

    def convert(_raw: Any) -> torch.Tensor:
        if copied:
            with torch.no_grad():
                tensor.detach().copy_(staged)
        return tensor

    return convert


set_size = _api.set_size
resolve_op = _api.resolve_op


# -- allreduce -----------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start an allreduce of ``tensor``; ``synchronize()`` the handle for a new tensor."""
    if _device.wants_device_path(tensor, process_set):
        inner = _device.submit_allreduce(tensor, average, name, op, prescale_factor,
                                         postscale_factor, process_set, inplace=False)
        return TorchHandle(inner, _device.on_caller_stream)
    staged = host(tensor, "allreduce")
    alloc = Allocator(tensor)
    inner = _api.allreduce_async(numpy_view(staged), average, name, op, prescale_factor,
                                 postscale_factor, process_set, alloc=alloc)
    return TorchHandle(inner, lambda raw: _result(alloc, raw, tensor))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start an in-place allreduce; ``synchronize()`` returns ``tensor`` itself, reduced."""
    if _device.wants_device_path(tensor, process_set):
        inner = _device.submit_allreduce(tensor, average, name, op, prescale_factor,
                                         postscale_factor, process_set, inplace=True)
        return TorchHandle(inner, lambda raw: _device.on_caller_stream(tensor))
    staged = host(tensor, "allreduce_")
    arr = numpy_view(staged)
    inner = _api.allreduce_async(arr, average, name, op, prescale_factor, postscale_factor,
                                 process_set, out=arr)
    return TorchHandle(inner, _inplace(tensor, staged))


def host_allreduce_async_(tensor: torch.Tensor, average: bool | None, name: str | None,
                          op: Any, prescale_factor: float, postscale_factor: float,
                          process_set: ProcessSet) -> TorchHandle:
    """:func:`allreduce_async_` of a dense, contiguous CPU tensor (a gradient bucket's
    flat buffer, or its cast): no device path and no staging copy to consider."""
    arr = numpy_view(tensor)
    inner = _api.allreduce_async(arr, average, name, op, prescale_factor, postscale_factor,
                                 process_set, out=arr)
    return TorchHandle(inner, lambda _raw: tensor)


def bucket_allreduce() -> Callable[..., TorchHandle]:
    """The in-place allreduce for gradient buckets: :func:`host_allreduce_async_`, or
    :func:`allreduce_async_` where the device path is forced on CPU tensors
    (``RONDE_TORCH_DEVICE_PATH=always``, how that path is tested without GPUs)."""
    return allreduce_async_ if _device.forced() else host_allreduce_async_


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Allreduce ``tensor`` in place and return it (not differentiable)."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set).wait()


def _group_names(name: str | None, n: int, process_set: ProcessSet | None,
                 kind: str = "grouped_allreduce") -> list[str]:
    return _api.group_names(kind, name, n, process_set)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> MultiHandle:
    """Start an allreduce of every tensor; the handle's result is the list of outputs."""
    with _api.together():
        hs = [allreduce_async(t, average, n, op, prescale_factor, postscale_factor, process_set)
              for t, n in zip(tensors, _group_names(name, len(tensors), process_set))]
    return MultiHandle(hs, lambda outs: list(outs), name or "grouped_allreduce")


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> MultiHandle:
    """In-place form of :func:`grouped_allreduce_async`."""
    with _api.together():
        hs = [allreduce_async_(t, average, n, op, prescale_factor, postscale_factor, process_set)
              for t, n in zip(tensors, _group_names(name, len(tensors), process_set))]
    return MultiHandle(hs, lambda outs: list(outs), name or "grouped_allreduce")


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce every tensor of the list in place; returns the list."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                    postscale_factor, process_set).wait()


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = None,
                           process_set: ProcessSet = global_process_set,
                           prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0) -> MultiHandle:
    """Allreduce a sparse COO tensor by allgathering its indices and values.

    The result is the coalesced sum over ranks (divided by the set size for Average).
    """
    resolved = resolve_op(op, None, what="sparse allreduce", allowed=_api.REDUCESCATTER_OPS)
    base = _api.auto_name("sparse_allreduce", name, process_set)
    t = tensor.detach().coalesce()
    indices = t.indices().t().contiguous()
    values = t.values().contiguous()
    hi = allgather_async(indices, f"{base}.indices", process_set)
    hv = allgather_async(values, f"{base}.values", process_set)
    scale = Reduction(resolved, prescale_factor, postscale_factor,
                      process_set=process_set).sparse_scale()

    def convert(outs: list[Any]) -> torch.Tensor:
        idx, vals = hi.wait(), hv.wait()
        out = torch.sparse_coo_tensor(idx.t(), vals, t.shape, check_invariants=False).coalesce()
        return out * scale if scale != 1.0 else out

    return SparseHandle([hi, hv], convert, base)


# -- allgather, broadcast, alltoall, reducescatter ------------------------------------------
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set,
                    out: torch.Tensor | None = None) -> TorchHandle:
    """Start an allgather (concatenation along the first dimension, in rank order);
    ``out``: a CPU tensor of the result's shape and dtype to receive it."""
    staged = host(tensor, "allgather")
    alloc = Allocator(tensor, out)
    inner = _api.allgather_async(numpy_view(staged), name, process_set, alloc=alloc)
    return TorchHandle(inner, lambda raw: _result(alloc, raw, tensor))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> MultiHandle:
    """Start an allgather of every tensor; the handle's result is the list of outputs."""
    with _api.together():
        hs = [allgather_async(t, n, process_set)
              for t, n in zip(tensors, _group_names(name, len(tensors), process_set,
                                                    "grouped_allgather"))]
    return MultiHandle(hs, lambda outs: list(outs), name or "grouped_allgather")


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start a broadcast from ``root_rank``; the result is a new tensor."""
    if _device.wants_device_path(tensor, process_set):
        inner = _device.submit_broadcast(tensor, root_rank, name, process_set, inplace=False)
        return TorchHandle(inner, _device.on_caller_stream)
    staged = host(tensor, "broadcast")
    alloc = Allocator(tensor)
    inner = _api.broadcast_async(numpy_view(staged), root_rank, name, process_set, alloc=alloc)
    return TorchHandle(inner, lambda raw: _result(alloc, raw, tensor))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start an in-place broadcast; ``synchronize()`` returns ``tensor`` itself."""
    if _device.wants_device_path(tensor, process_set):
        inner = _device.submit_broadcast(tensor, root_rank, name, process_set, inplace=True)
        return TorchHandle(inner, lambda raw: _device.on_caller_stream(tensor))
    staged = host(tensor, "broadcast_")
    arr = numpy_view(staged)
    inner = _api.broadcast_async(arr, root_rank, name, process_set, out=arr)
    return TorchHandle(inner, _inplace(tensor, staged))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with the root's tensor, in place; returns it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start an alltoall; the result is ``(output, received_splits)`` as for :func:`alltoall`."""
    staged = host(tensor, "alltoall")
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().reshape(-1).tolist()
    alloc = Allocator(tensor)
    inner = _api.alltoall_async(numpy_view(staged), splits, name, process_set, alloc=alloc)

    def convert(raw: Any) -> Any:
        if isinstance(raw, tuple):
            return _result(alloc, raw[0], tensor), torch.from_numpy(np.asarray(raw[1]))
        return _result(alloc, raw, tensor)

    return TorchHandle(inner, convert)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = ReduceOp.AVERAGE,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0,
                        out: torch.Tensor | None = None) -> TorchHandle:
    """Start a reducescatter (rank r gets its block of the first dimension); ``out``:
    a CPU tensor of the block's shape and dtype to receive it (not a view of
    ``tensor``: the transports read the input while they write the output)."""
    staged = host(tensor, "reducescatter")
    alloc = Allocator(tensor, out)
    inner = _api.reducescatter_async(numpy_view(staged), op, name, process_set,
                                     prescale_factor, postscale_factor, alloc=alloc)
    return TorchHandle(inner, lambda raw: _result(alloc, raw, tensor))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = ReduceOp.AVERAGE,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> MultiHandle:
    """Start a reducescatter of every tensor; the result is the list of this rank's blocks."""
    with _api.together():
        hs = [reducescatter_async(t, n, op, process_set, prescale_factor, postscale_factor)
              for t, n in zip(tensors, _group_names(name, len(tensors), process_set,
                                                    "grouped_reducescatter"))]
    return MultiHandle(hs, lambda outs: list(outs), name or "grouped_reducescatter")


def synchronize(handle: TorchHandle) -> Any:
    """Wait for an async collective and return its result (torch tensors for torch calls)."""
    return handle.wait()


def poll(handle: TorchHandle) -> bool:
    """True if the async collective behind ``handle`` finished."""
    return bool(handle.poll())
