"""Host-staged gradient reduction, shared by the bindings whose tensors cross as numpy.

The JAX and MXNet bindings hand the engine numpy copies of their arrays (a JAX host
callback receives numpy arrays; an MXNet ``NDArray`` becomes one with
``asnumpy()``). For them the whole gradient reduction of a step happens here, on
numpy arrays, in one place:

1. the gradients are bucketed by dtype and each bucket is flattened into **one
   buffer** (one allreduce per dtype, usually one in total, instead of one per
   parameter);
2. each buffer is compressed for the wire (:mod:`.compression`, with the numpy
   :data:`Compression` defined here), and an fp16 Average becomes a Sum of
   pre-divided inputs (:func:`~.compression.wire_reduction`);
3. the buffers are allreduced together (submitted back to back, so the engine
   negotiates them in one round), then decompressed and split back into arrays of
   the original shapes.

The buffer of dtype ``d`` is named ``<name>.<d>``, so every rank must pass arrays of
the same shapes and dtypes in the same order (the bindings check their parameter
tables with :mod:`.naming` first).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from .. import _api
from .._ops import ReduceOp
from ..process_sets import ProcessSet, global_process_set
from . import compression as _compression
from .compression import Compressor, wire_reduction

logger = logging.getLogger(__name__)


class NumpyAdapter:
    """The :class:`~.compression.TensorAdapter` for numpy arrays (bfloat16 via ml_dtypes)."""

    def dtype_name(self, tensor: np.ndarray) -> str:
        """The array's dtype name (``float32``, ``bfloat16``...)."""
        return str(tensor.dtype)

    def cast(self, tensor: np.ndarray, dtype_name: str) -> np.ndarray:
        """The array converted to ``dtype_name`` (itself when it already has it)."""
        if str(tensor.dtype) == dtype_name:
            return tensor
        return tensor.astype(numpy_dtype(dtype_name))

    def all_finite(self, tensor: np.ndarray) -> bool:
        """True when the array holds no inf and no nan."""
        if tensor.dtype.kind in "iub":
            return True
        return bool(np.isfinite(tensor.astype(np.float32, copy=False)).all())


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (``bfloat16`` needs the ml_dtypes package)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


#: the built-in compressors for numpy arrays (the JAX and MXNet bindings use these)
Compression: _compression.Compression[np.ndarray] = _compression.Compression(NumpyAdapter())


def set_size(process_set: ProcessSet | None) -> int:
    """Number of ranks in a process set (the job size for the global set)."""
    ps = process_set if process_set is not None else global_process_set
    return len(ps.ranks) if ps.ranks is not None else _api.size()


def buckets(dtypes: Sequence[str]) -> dict[str, list[int]]:
    """Indices of the arrays of each dtype, dtypes in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, d in enumerate(dtypes):
        out.setdefault(str(d), []).append(i)
    return out


def compressed_allreduce_async(array: np.ndarray, name: str, op: ReduceOp, prescale: float,
                               postscale: float, process_set: ProcessSet | None,
                               compression: Any) -> Any:
    """Start one allreduce of a numpy array through ``compression``.

    Returns a zero-argument function that waits and returns the decompressed
    result. ``compression`` is a :class:`~.compression.Compressor` (for example
    ``Compression.fp16``) or a Horovod-style object with ``compress``/``decompress``.
    """
    sent, ctx = compression.compress(array)
    if isinstance(compression, Compressor) and compression.compresses(str(array.dtype)):
        op_, prescale, postscale = wire_reduction(op, prescale, postscale,
                                                  set_size(process_set), compression.wire_dtype)
        op = ReduceOp(op_)
    handle = _api.allreduce_async(sent, None, name, op, prescale, postscale, process_set)

    def finish() -> np.ndarray:
        out = handle.wait()
        if isinstance(compression, Compressor):
            return np.asarray(compression.decompress(out, ctx, name))
        return np.asarray(compression.decompress(out, ctx))

    return finish


def fused_allreduce(arrays: Sequence[np.ndarray], name: str, op: Any = None,
                    prescale: float = 1.0, postscale: float = 1.0,
                    process_set: ProcessSet | None = None,
                    compression: Any = Compression.none) -> list[np.ndarray]:
    """Allreduce a list of arrays as one flat buffer per dtype (see the module doc).

    Args:
        arrays: the arrays (same shapes and dtypes, in the same order, on every rank).
        name: the base name; the buffer of dtype ``d`` is the collective ``<name>.<d>``.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale: multiplies every input before the reduction.
        postscale: multiplies the result.
        process_set: the ranks taking part (default: all).
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``.

    Returns:
        New arrays with the reduced values, shapes and dtypes of the inputs.
    """
    resolved = _api._resolve_op(op, None)
    if resolved == ReduceOp.ADASUM:
        raise ValueError("op=Adasum is not supported yet; use Average or Sum")
    arrs = [np.asarray(a) for a in arrays]
    pending = []
    for dtype, idx in buckets([str(a.dtype) for a in arrs]).items():
        flat = arrs[idx[0]].reshape(-1) if len(idx) == 1 else \
            np.concatenate([arrs[i].reshape(-1) for i in idx])
        if not flat.flags.c_contiguous:
            flat = np.ascontiguousarray(flat)
        pending.append((idx, compressed_allreduce_async(flat, f"{name}.{dtype}", resolved,
                                                        prescale, postscale, process_set,
                                                        compression)))
    out: list[np.ndarray] = [np.empty(0)] * len(arrs)
    for idx, finish in pending:
        flat = finish()
        offset = 0
        for i in idx:
            n = arrs[i].size
            out[i] = flat[offset:offset + n].reshape(arrs[i].shape)
            offset += n
    return out
