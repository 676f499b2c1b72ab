"""Reducing one step's gradients on the host, as numpy arrays (framework-neutral).

Where it sits: between a binding and the engine (:mod:`ronde._api`), for every
binding whose tensors reach the engine as numpy arrays. TensorFlow graphs and
Keras 3 (JAX, TensorFlow and torch backends) move a whole step's gradients to the
host in *one* call (``tf.numpy_function``, ``jax.pure_callback``, or directly when
eager); the JAX binding's host callbacks receive numpy arrays, and MXNet's
``NDArray`` becomes one with ``asnumpy()``. All of them reduce here.

:func:`reduce_arrays` submits every allreduce before waiting on any, so the engine
negotiates and fuses them together (on one host its single-copy path then reads
each array in place), and a single host call per step means ranks can never order
their blocking calls differently (the deadlock a call per tensor could cause when a
graph runs independent ops in a different order on each rank).

Each gradient is described by a :class:`GradientSpec`: dense gradients are
allreduced (compressed to a 16-bit wire dtype when asked, with the overflow policy
of :mod:`.compression`, an fp16 Average becoming a Sum of pre-divided inputs);
sparse ones (values and indices of an ``IndexedSlices``) are allgathered and
scaled, as Horovod does.

:func:`fused_allreduce` is the form whose public contract is one collective per
dtype (``<name>.<dtype>``: the JAX ``DistributedOptimizer`` and MXNet's
``fused_allreduce_``): it flattens each dtype's arrays into one buffer and reduces
the buffers with :func:`reduce_arrays`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..process_sets import ProcessSet
from .compression import Compresses, Compression, Compressor, wire_reduction

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class GradientSpec:
    """One gradient of a host reduction.

    Attributes:
        name: the collective's name (identical on every rank).
        sparse: True for an ``IndexedSlices``-like pair (values, indices), which
            is allgathered; False for a dense array, which is allreduced.
    """

    name: str
    sparse: bool = False


@dataclass(frozen=True)
class Reduction:
    """How the gradients of a host reduction are combined.

    Attributes:
        op: a ``ReduceOp`` value (Average, Sum, Min, Max, Product).
        prescale: factor applied before the reduction.
        postscale: factor applied after it.
        wire_dtype: ``"float16"``/``"bfloat16"`` to compress floats, or None
            (:func:`wire_dtype_of` turns a binding's ``Compression.*`` into it).
        process_set: the ranks taking part (None: all).
    """

    op: int
    prescale: float = 1.0
    postscale: float = 1.0
    wire_dtype: str | None = None
    process_set: ProcessSet | None = None


def set_size(process_set: ProcessSet) -> int:
    """Number of ranks of a process set (the job size for None or the global set)."""
    from .. import _api

    ranks = getattr(process_set, "ranks", None)
    return len(ranks) if ranks is not None else _api.size()


def count_inputs(specs: Sequence[GradientSpec]) -> int:
    """How many arrays :func:`reduce_arrays` takes (and returns) for ``specs``."""
    return sum(2 if s.sparse else 1 for s in specs)


def reduce_arrays(arrays: Sequence[np.ndarray], specs: Sequence[GradientSpec],
                  reduction: Reduction) -> list[np.ndarray]:
    """Reduce a step's gradients over the ranks; returns the arrays in input order.

    Dense gradients come back with their own shape and dtype; a sparse pair comes
    back as (every rank's values concatenated and scaled, every rank's indices).

    Args:
        arrays: the flattened inputs: one array per dense spec, two per sparse spec.
        specs: what each gradient is.
        reduction: how to combine them.
    """
    from .. import _api
    from .._ops import ReduceOp

    if len(arrays) != count_inputs(specs):
        raise ValueError(f"reduce_arrays got {len(arrays)} arrays for {len(specs)} gradients "
                         f"(expected {count_inputs(specs)})")
    compressor = host_compressor(reduction.wire_dtype)
    size = set_size(reduction.process_set)
    pending: list[Any] = []
    pos = 0
    for spec in specs:
        if spec.sparse:
            values, indices = np.asarray(arrays[pos]), np.asarray(arrays[pos + 1])
            pos += 2
            scale = reduction.prescale * reduction.postscale
            if int(reduction.op) == int(ReduceOp.AVERAGE):
                scale /= size
            elif int(reduction.op) != int(ReduceOp.SUM):
                raise ValueError(f"sparse gradient {spec.name!r}: only Sum and Average are "
                                 "supported; pass sparse_as_dense=True")
            hv = _api.allgather_async(np.ascontiguousarray(values), f"{spec.name}.values",
                                      reduction.process_set)
            hi = _api.allgather_async(np.ascontiguousarray(indices), f"{spec.name}.indices",
                                      reduction.process_set)
            pending.append(("sparse", hv, hi, scale, values.dtype))
            continue
        arr = np.asarray(arrays[pos])
        pos += 1
        sent, ctx = compressor.compress(arr)
        op, pre, post = int(reduction.op), reduction.prescale, reduction.postscale
        if compressor.compresses(str(arr.dtype)):
            op, pre, post = wire_reduction(op, pre, post, size, compressor.wire_dtype)
        h = _api.allreduce_async(sent, None, spec.name, op, pre, post, reduction.process_set)
        pending.append(("dense", h, ctx, spec.name, arr.dtype))
    out: list[np.ndarray] = []
    for item in pending:
        if item[0] == "sparse":
            _, hv, hi, scale, dtype = item
            values = hv.wait()
            out.append((values * scale).astype(dtype, copy=False) if scale != 1.0 else values)
            out.append(hi.wait())
        else:
            _, h, ctx, name, dtype = item
            value = compressor.decompress(np.asarray(h.wait()), ctx, name)
            out.append(np.asarray(value, dtype=dtype))
    return out


def fused_allreduce(arrays: Sequence[np.ndarray], name: str,
                    reduction: Reduction) -> list[np.ndarray]:
    """Allreduce dense arrays as one flat buffer per dtype (``<name>.<dtype>``).

    The buffers are reduced together by :func:`reduce_arrays` (compression
    included) and split back. With ``op=Adasum`` each array is its own allreduce
    (``<name>.<index>``): Adasum combines tensor by tensor. Every rank must pass
    arrays of the same shapes and dtypes in the same order (the bindings check their
    parameter tables with :mod:`.naming` first). Flattening costs a copy in and out;
    use it only where one collective per dtype is the contract, :func:`reduce_arrays`
    otherwise.

    Returns:
        New arrays with the reduced values, shapes and dtypes of the inputs.
    """
    from .._ops import ReduceOp

    arrs = [np.asarray(a) for a in arrays]
    if int(reduction.op) == int(ReduceOp.ADASUM):
        # Adasum's dot products and norms are per tensor: one per array, never one buffer
        return reduce_arrays(arrs, [GradientSpec(f"{name}.{i}") for i in range(len(arrs))],
                             reduction)
    by_dtype: dict[str, list[int]] = {}  # dtypes in order of first appearance
    for i, a in enumerate(arrs):
        by_dtype.setdefault(str(a.dtype), []).append(i)
    flats = [arrs[idx[0]].reshape(-1) if len(idx) == 1 else
             np.concatenate([arrs[i].reshape(-1) for i in idx]) for idx in by_dtype.values()]
    reduced = reduce_arrays(flats, [GradientSpec(f"{name}.{d}") for d in by_dtype], reduction)
    out: list[np.ndarray] = [np.empty(0)] * len(arrs)
    for idx, flat in zip(by_dtype.values(), reduced):
        offset = 0
        for i in idx:
            n = arrs[i].size
            out[i] = flat[offset:offset + n].reshape(arrs[i].shape)
            offset += n
    return out
