"""torch tensors <-> the numpy buffers the engine reads and writes.

CPU tensors cross without copies: a contiguous CPU tensor's ``.numpy()`` shares its
memory, and outputs are allocated as torch tensors whose numpy view the engine
fills (``alloc=``/``out=`` of the runtime API), so the result *is* a torch tensor.
bfloat16 has no numpy dtype in torch: its int16 view is reinterpreted as
``ml_dtypes.bfloat16`` (same bits). Non-contiguous tensors are copied to a
contiguous one first. CUDA tensors that the device path (``_device.py``) does not
take (allgather, alltoall and reducescatter; every collective where ranks share a GPU,
or NCCL is missing) make a host round trip (copy to CPU, reduce, copy back); a warning
says so once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import numpy as np
import torch

from ..frameworks.handles import ConvertingHandle, GroupOfHandles

logger = logging.getLogger(__name__)

_NUMPY: dict[torch.dtype, Any] = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
    torch.uint8: np.uint8,
}
_TORCH: dict[str, torch.dtype] = {str(np.dtype(v)): k for k, v in _NUMPY.items()}
_TORCH["bfloat16"] = torch.bfloat16
_warned_device = threading.Event()


#: torch dtype -> wire name, looked up on every collective (``str(np.dtype)`` is slow)
_NAMES: dict[torch.dtype, str] = {k: str(np.dtype(v)) for k, v in _NUMPY.items()}
_NAMES[torch.bfloat16] = "bfloat16"


def dtype_name(dtype: torch.dtype) -> str:
    """The numpy-style name of a torch dtype (``float32``, ``bfloat16``...)."""
    name = _NAMES.get(dtype)
    if name is None:
        raise TypeError(f"ronde cannot send torch tensors of dtype {dtype}; supported: "
                        f"{', '.join(sorted(_TORCH))} (cast first, e.g. bool -> uint8)")
    return name


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype for a numpy dtype or dtype name (bfloat16 via ml_dtypes)."""
    if isinstance(dtype, str) and dtype in _TORCH:
        return _TORCH[dtype]
    return _TORCH[str(np.dtype(dtype))]


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with a contiguous CPU tensor."""
    dtype = t.dtype
    if dtype in _NUMPY:  # the common case, one dict lookup
        return t.numpy()
    if dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    dtype_name(dtype)  # raises a clear TypeError for unsupported dtypes
    return t.numpy()


def host(t: torch.Tensor, what: str) -> torch.Tensor:
    """The tensor detached, on the CPU and contiguous: itself when it already is."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{what} expects a dense tensor; use sparse_allreduce_async for sparse "
                        "tensors or DistributedOptimizer(sparse_as_dense=True)")
    # Only what must happen: torch releases the GIL around every operator call
    # (``detach``, ``contiguous``...), and a control thread that is waiting for it then
    # runs before this submission goes on: ~10 us a tensor instead of ~1 (gradients do
    # not require grad; ``requires_grad`` and ``is_contiguous`` do not let go of it)
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:  # (``t.device.type`` builds a device object: 0.2 us a call)
        if not _warned_device.is_set():
            _warned_device.set()
            logger.warning("ronde.torch: %s tensors are copied to host memory for this "
                           "collective and back (allgather, alltoall, reducescatter, and "
                           "every collective where NCCL is not used); expect extra latency",
                           t.device.type)
        if t.is_cuda:
            # page-locked (torch's caching host allocator keeps the blocks): the copy out
            # and the copy back run at the bus's speed, and no op faults in fresh pages
            staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            staged.copy_(t)  # blocking: the engine may read it as soon as this returns
            return staged
        return t.to("cpu").contiguous()
    return t if t.is_contiguous() else t.contiguous()


class Allocator:
    """The ``alloc=`` callable: allocates the output as a torch tensor, keeps it; or
    hands out ``into`` (a contiguous CPU tensor) where its shape and dtype are the
    output's, so that the result lands in memory the caller already holds."""

    __slots__ = ("tensor", "pin", "into")

    def __init__(self, like: torch.Tensor | None = None,
                 into: torch.Tensor | None = None) -> None:
        self.tensor: torch.Tensor | None = None
        #: results that go on to a GPU are received in page-locked memory
        self.pin = like is not None and like.is_cuda
        self.into = into

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        into, want = self.into, torch_dtype(dtype)
        if into is not None and into.dtype == want and tuple(into.shape) == tuple(shape):
            self.tensor = into
        else:
            self.tensor = torch.empty(tuple(shape), dtype=want, pin_memory=self.pin)
        return numpy_view(self.tensor)


class TorchHandle(ConvertingHandle):
    """The handle of an async torch collective; ``wait()`` returns torch tensors.

    ``hvd.synchronize(handle)`` and ``hvd.poll(handle)`` accept it, like the runtime's
    own :class:`~ronde.core.requests.Handle`, whose methods it mirrors (see
    :class:`~ronde.frameworks.handles.ConvertingHandle`).
    """

    __slots__ = ()

    def __init__(self, inner: Any, convert: Callable[[Any], Any],
                 name: str | None = None) -> None:
        super().__init__(inner, convert, name, "TorchHandle")


class MultiHandle(TorchHandle):
    """Several runtime handles finishing one torch result (grouped, sparse)."""

    __slots__ = ()

    def __init__(self, inners: list[Any], convert: Callable[[list[Any]], Any],
                 name: str = "") -> None:
        super().__init__(GroupOfHandles(inners), convert, name)


class SparseHandle(MultiHandle):
    """The handle of ``sparse_allreduce_async``: callable, as Horovod's is.

    Horovod returns a function that waits and returns the result; ``handle()``,
    ``handle.wait()`` and ``hvd.synchronize(handle)`` all do that here.
    """

    __slots__ = ()

    def __call__(self) -> Any:
        return self.wait()


def to_device(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Move a host result back to ``like``'s device (no-op on the CPU)."""
    return result if like.device.type == "cpu" else result.to(like.device)
