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
allreduced, sparse ones (values and indices of an ``IndexedSlices``) allgathered and
scaled, as Horovod does; both as :class:`~ronde.frameworks.gradients.Reduction` says
(the pipeline torch's gradient hooks use too: compression, the fp16 rewrite, the
scales), applied to numpy arrays.

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

from .gradients import Reduction

logger = logging.getLogger(__name__)


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

    if len(arrays) != count_inputs(specs):
        raise ValueError(f"reduce_arrays got {len(arrays)} arrays for {len(specs)} gradients "
                         f"(expected {count_inputs(specs)})")
    red = reduction.on_host()
    pending: list[Any] = []
    pos = 0
    for spec in specs:
        if spec.sparse:
            values, indices = np.asarray(arrays[pos]), np.asarray(arrays[pos + 1])
            pos += 2
            try:
                scale = red.sparse_scale()
            except ValueError as exc:
                raise ValueError(f"sparse gradient {spec.name!r}: {exc}") from None
            hv = _api.allgather_async(np.ascontiguousarray(values), f"{spec.name}.values",
                                      reduction.process_set)
            hi = _api.allgather_async(np.ascontiguousarray(indices), f"{spec.name}.indices",
                                      reduction.process_set)
            pending.append(("sparse", hv, hi, scale, values.dtype))
            continue
        arr = np.asarray(arrays[pos])
        pos += 1
        pending.append(("dense", red.start(arr, spec.name, _api.allreduce_async), arr.dtype))
    out: list[np.ndarray] = []
    for item in pending:
        if item[0] == "sparse":
            _, hv, hi, scale, dtype = item
            values = hv.wait()
            out.append((values * scale).astype(dtype, copy=False) if scale != 1.0 else values)
            out.append(hi.wait())
        else:
            _, started, dtype = item
            out.append(np.asarray(red.result(started), dtype=dtype))
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
