"""Gradient compression for the wire: none, fp16, bf16 (framework-neutral).

A compressor casts a floating-point tensor to a 16-bit float before the allreduce
and back to its own dtype after it (Horovod's ``compress``/``decompress`` protocol).
Integer tensors pass through unchanged. The framework supplies a
:class:`TensorAdapter`; ``ronde.torch.Compression`` is this module bound to torch.

Overflow policy (float16 only; bfloat16 has float32's range):

* An ``Average`` is computed as a ``Sum`` of inputs pre-divided by the number of ranks
  (see :func:`wire_reduction`), so the sum itself cannot overflow when every input
  fits: it never exceeds the largest input.
* Values beyond +-65504 become +-inf in the cast. This is not silent: the result is
  checked after the reduction, and when it holds inf/nan although this rank's input
  was finite, a WARNING names the tensor (once per tensor name). The inf is kept, so
  AMP's ``GradScaler`` sees it and skips the step on every rank alike (results are
  identical on all ranks).
"""

from __future__ import annotations

import logging
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import numpy as np

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: dtypes a compressor may cast (integers are never compressed)
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
#: largest finite float16
FLOAT16_MAX = 65504.0

_warned: set[str] = set()


class TensorAdapter(Protocol[T]):
    """What a compressor needs from a framework."""

    def dtype_name(self, tensor: T) -> str:
        """The tensor's dtype as a numpy-style name (``float32``, ``bfloat16``...)."""

    def cast(self, tensor: T, dtype_name: str) -> T:
        """The tensor converted to ``dtype_name`` (a new tensor, or itself if equal)."""

    def all_finite(self, tensor: T) -> bool:
        """True when the tensor holds no inf and no nan."""


class CompressionContext(NamedTuple):
    """What :meth:`Compressor.decompress` needs to undo :meth:`Compressor.compress`."""

    dtype_name: str | None
    input_finite: bool


class Compressor(Generic[T]):
    """Casts floating tensors to ``wire_dtype`` for the transfer (``None``: no cast).

    Args:
        adapter: the framework's :class:`TensorAdapter`.
        wire_dtype: ``"float16"``, ``"bfloat16"`` or ``None``.
        name: how the compressor prints (``Compression.fp16``).
    """

    def __init__(self, adapter: TensorAdapter[T], wire_dtype: str | None, name: str) -> None:
        self.adapter = adapter
        self.wire_dtype = wire_dtype
        self.name = name

    def compresses(self, dtype_name: str) -> bool:
        """True if tensors of this dtype are cast on the wire."""
        return (self.wire_dtype is not None and dtype_name in FLOAT_DTYPES
                and dtype_name != self.wire_dtype)

    def compress(self, tensor: T) -> tuple[T, CompressionContext]:
        """Return the tensor to send and the context for :meth:`decompress`."""
        dtype = self.adapter.dtype_name(tensor)
        if not self.compresses(dtype):
            return tensor, CompressionContext(None, True)
        finite = self.wire_dtype != "float16" or self.adapter.all_finite(tensor)
        assert self.wire_dtype is not None
        return self.adapter.cast(tensor, self.wire_dtype), CompressionContext(dtype, finite)

    def decompress(self, tensor: T, ctx: CompressionContext | Any, name: str | None = None) -> T:
        """Cast the reduced tensor back; warn if float16 overflowed (see module doc)."""
        if not isinstance(ctx, CompressionContext) or ctx.dtype_name is None:
            return tensor
        if (self.wire_dtype == "float16" and ctx.input_finite
                and not self.adapter.all_finite(tensor)):
            key = name or "<unnamed>"
            if key not in _warned:
                _warned.add(key)
                logger.warning(
                    "fp16 compression of %r overflowed: the reduced values exceed +-%g and "
                    "became inf (kept, so a GradScaler skips this step on every rank); use "
                    "Compression.bf16 or scale the loss down", key, FLOAT16_MAX)
        return self.adapter.cast(tensor, ctx.dtype_name)

    def __repr__(self) -> str:
        return self.name


class Compresses(Protocol):
    """What ``compression=`` takes: a framework's ``Compression.none``, ``.fp16`` or
    ``.bf16`` (a :class:`Compressor`), or a Horovod-style compressor of the user's own (a
    class with static ``compress`` and ``decompress``)."""

    def compress(self, tensor: Any) -> tuple[Any, Any]: ...

    def decompress(self, tensor: Any, ctx: Any) -> Any: ...


class Compression(Generic[T]):
    """The three built-in compressors for one framework (``Compression.none`` ...)."""

    def __init__(self, adapter: TensorAdapter[T]) -> None:
        self.none: Compressor[T] = Compressor(adapter, None, "Compression.none")
        self.fp16: Compressor[T] = Compressor(adapter, "float16", "Compression.fp16")
        self.bf16: Compressor[T] = Compressor(adapter, "bfloat16", "Compression.bf16")


class WireReduction(NamedTuple):
    """The op and scale factors actually sent to the engine."""

    op: int
    prescale: float
    postscale: float


def wire_reduction(op: int, prescale: float, postscale: float, size: int,
                   wire_dtype: str | None) -> WireReduction:
    """Rewrite an ``Average`` on float16 as a ``Sum`` of pre-divided inputs.

    Pre-dividing keeps every partial sum within the range of the inputs, so a
    float16 average overflows only where an input itself does. Other ops and wire
    dtypes are returned unchanged. (Both divide by ``size``, joined ranks included.)

    Args:
        op: the requested ``ReduceOp`` value.
        prescale: the requested prescale factor.
        postscale: the requested postscale factor.
        size: number of ranks in the process set.
        wire_dtype: the dtype on the wire (``"float16"`` triggers the rewrite).
    """
    from .._ops import ReduceOp

    if wire_dtype == "float16" and int(op) == int(ReduceOp.AVERAGE) and size > 1:
        return WireReduction(int(ReduceOp.SUM), prescale / size, postscale)
    return WireReduction(int(op), prescale, postscale)


# -- numpy arrays: the host path of every binding ------------------------------------------
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (``bfloat16`` needs the ml_dtypes package)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class NumpyAdapter:
    """The :class:`~ronde.frameworks.compression.TensorAdapter` for numpy arrays.

    Also for arrays that follow numpy's ``dtype``/``astype`` protocol with a numpy
    scalar type as ``dtype`` (MXNet's ``NDArray``; ``asnumpy()`` reads them).
    """

    def dtype_name(self, tensor: np.ndarray) -> str:
        """The array's dtype name (``float32``, ``bfloat16`` through ml_dtypes...)."""
        return np.dtype(tensor.dtype).name

    def cast(self, tensor: np.ndarray, dtype_name: str) -> np.ndarray:
        """The array converted to ``dtype_name`` (itself when it already has it)."""
        if self.dtype_name(tensor) == dtype_name:
            return tensor
        return tensor.astype(numpy_dtype(dtype_name))

    def all_finite(self, tensor: np.ndarray) -> bool:
        """True when the array holds no inf and no nan."""
        if np.dtype(tensor.dtype).kind in "iub":
            return True
        values = tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor
        return bool(np.isfinite(np.asarray(values).astype(np.float32, copy=False)).all())


#: the built-in compressors for numpy arrays (``Compression`` of the JAX, MXNet and
#: Keras bindings; what the host reduction applies for every binding)
NUMPY_COMPRESSION: Compression[np.ndarray] = Compression(NumpyAdapter())


def wire_dtype_of(compression: Compresses) -> str | None:
    """The wire dtype of a ronde compressor of any binding (``None``: no cast).

    Raises:
        TypeError: ``compression`` is not one of ronde's ``Compression.none/fp16/bf16``
            (Horovod-style custom compressors run on framework tensors and cannot be
            applied on the host).
    """
    if compression is None:
        return None
    if isinstance(compression, Compressor):
        return compression.wire_dtype
    raise TypeError(f"compression={compression!r} is not supported here; use "
                    "Compression.none, Compression.fp16 or Compression.bf16")


def host_compressor(wire_dtype: str | None) -> Compressor[np.ndarray]:
    """The numpy compressor that casts to ``wire_dtype``."""
    if wire_dtype is None:
        return NUMPY_COMPRESSION.none
    if wire_dtype == "float16":
        return NUMPY_COMPRESSION.fp16
    if wire_dtype == "bfloat16":
        return NUMPY_COMPRESSION.bf16
    raise ValueError(f"unknown wire dtype {wire_dtype!r}")
