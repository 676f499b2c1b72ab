"""Collectives on JAX arrays: the non-differentiable layer, eager or inside ``jax.jit``.

Each function builds a host function around the one runtime implementation in
:mod:`ronde._api` and runs it with :func:`~ronde.jax._arrays.host_call` (see there for
what runs where). The differentiable, pytree-accepting forms users call are in
:mod:`ronde.jax._autodiff`; the ``*_async`` forms here are eager only.

Names are fixed when the function is called (at trace time under ``jit``): a
compiled function reuses its names at every execution, which is allowed because
each execution waits for its collectives before the next one starts.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from ..frameworks.compression import Compresses
from .. import _api
from .._ops import ReduceOp
from ..frameworks.gradients import Reduction
from ..frameworks.handles import ConvertingHandle, group
from ..frameworks.host_reduce import GradientSpec, reduce_arrays
from ..process_sets import ProcessSet, global_process_set
from ._arrays import as_jax_input, host_call, is_traced, spec_of, to_device, to_host

logger = logging.getLogger(__name__)


def resolve_op(op: Any, average: bool | None) -> ReduceOp:
    """Horovod's ``op``/``average`` arguments as one ``ReduceOp`` (default Average)."""
    return _api.resolve_op(op, average, what="allreduce", allowed=_api.ALLREDUCE_OPS)


def collective_name(kind: str, name: str | None, process_set: ProcessSet | None) -> str:
    """``name``, or the next automatic name of ``kind`` in the process set's counter."""
    return _api.auto_name(kind, name, process_set)


def set_rank_and_size(process_set: ProcessSet | None) -> tuple[int, int]:
    """This process's index in the set and the set's size."""
    return _api.set_rank(process_set), _api.set_size(process_set)


def _eager_only(what: str, x: Any) -> None:
    if is_traced(x):
        raise TypeError(f"{what} cannot run inside jax.jit/grad/vmap (its handle would escape "
                        f"the trace); call the blocking form {what.replace('_async', '')}() "
                        "there, or call this outside the traced function")


# -- blocking, jit-capable ------------------------------------------------------------------
def allreduce_arrays(xs: Sequence[Any], names: Sequence[str], op: ReduceOp, prescale: float,
                     postscale: float, process_set: ProcessSet | None,
                     compression: Compresses) -> list[Any]:
    """Allreduce each array under its own name; all start before any is awaited.

    ``compression`` is a ``Compression.none/fp16/bf16`` (the cast happens on the host,
    in :func:`ronde.frameworks.host_reduce.reduce_arrays`).
    """
    xs = [as_jax_input(x, "allreduce") for x in xs]
    specs = [GradientSpec(n) for n in names]
    reduction = Reduction(int(op), prescale, postscale, compression, process_set).on_host()

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        return reduce_arrays([to_host(a, "allreduce") for a in arrays], specs, reduction)

    return list(host_call(fn, [spec_of(x) for x in xs], xs, likes=xs))


def allgather_array(x: Any, name: str, process_set: ProcessSet | None) -> Any:
    """Concatenate every rank's array along the first dimension, in rank order.

    Under a trace the output shape must be known, so every rank is assumed to pass
    the same first dimension (a rank that does not fails with a ``ValueError``).
    """
    x = as_jax_input(x, "allgather")
    if x.ndim == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; "
                         "reshape scalars to shape (1,)")
    _, n = set_rank_and_size(process_set)

    def fn(a: np.ndarray) -> list[np.ndarray]:
        return [_api.allgather(to_host(a, "allgather"), name, process_set)]

    if is_traced(x):
        return host_call(fn, [spec_of(x, (n * x.shape[0], *x.shape[1:]))], [x])[0]
    return to_device(fn(np.asarray(x))[0], None)


def broadcast_array(x: Any, root_rank: int, name: str, process_set: ProcessSet | None) -> Any:
    """The root's array on every rank."""
    x = as_jax_input(x, "broadcast")

    def fn(a: np.ndarray) -> list[np.ndarray]:
        return [_api.broadcast(to_host(a, "broadcast"), root_rank, name, process_set)]

    return host_call(fn, [spec_of(x)], [x], likes=[x])[0]


def alltoall_array(x: Any, splits: Any, name: str, process_set: ProcessSet | None) -> Any:
    """Horovod's alltoall; with ``splits`` it returns ``(output, received_splits)``.

    With ``splits`` the output shape depends on the other ranks, so that form runs
    eagerly only; without them (equal blocks) it also runs under ``jit``.
    """
    x = as_jax_input(x, "alltoall")
    if splits is not None:
        if is_traced(x) or is_traced(splits):
            raise TypeError("alltoall with splits= has a data-dependent output shape and "
                            "cannot run inside jax.jit; call it eagerly, or use equal blocks "
                            "(splits=None)")
        out, got = _api.alltoall(to_host(x, "alltoall"),
                                  [int(v) for v in np.asarray(splits).reshape(-1)], name,
                                  process_set)
        return to_device(out, None), jnp.asarray(np.asarray(got, np.int32))

    def fn(a: np.ndarray) -> list[np.ndarray]:
        return [_api.alltoall(to_host(a, "alltoall"), None, name, process_set)]

    if x.ndim == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    return host_call(fn, [spec_of(x)], [x], likes=[x])[0]


def reducescatter_rows(rows: int, index: int, n: int) -> int:
    """Rows of the first dimension that set member ``index`` of ``n`` receives."""
    return rows // n + (1 if index < rows % n else 0)


def reducescatter_array(x: Any, op: ReduceOp, name: str, process_set: ProcessSet | None,
                        prescale: float, postscale: float) -> Any:
    """Reduce over ranks; this rank gets its block of the first dimension."""
    x = as_jax_input(x, "reducescatter")
    if x.ndim == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    index, n = set_rank_and_size(process_set)
    shape = (reducescatter_rows(x.shape[0], index, n), *x.shape[1:])

    def fn(a: np.ndarray) -> list[np.ndarray]:
        return [_api.reducescatter(to_host(a, "reducescatter"), op, name, process_set,
                                   prescale, postscale)]

    return host_call(fn, [spec_of(x, shape)], [x])[0]


# -- asynchronous (eager only) -------------------------------------------------------------
def _handle(inner: Any, like: Any, name: str) -> ConvertingHandle:
    return ConvertingHandle(inner, lambda raw: to_device(np.asarray(raw), like), name,
                            "JaxHandle")


def allreduce_async(tensor: Any, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> ConvertingHandle:
    """Start an allreduce; ``synchronize(handle)`` returns a new ``jax.Array``."""
    _eager_only("allreduce_async", tensor)
    x = as_jax_input(tensor, "allreduce")
    inner = _api.allreduce_async(to_host(x, "allreduce"), None, name,
                                 resolve_op(op, average), prescale_factor, postscale_factor,
                                 process_set)
    return _handle(inner, x, inner.name)


def grouped_allreduce_async(tensors: Sequence[Any], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> ConvertingHandle:
    """Start an allreduce of every array; the handle's result is the list of outputs."""
    xs = [as_jax_input(t, "grouped_allreduce") for t in tensors]
    for x in xs:
        _eager_only("grouped_allreduce_async", x)
    base = collective_name("grouped_allreduce", name, process_set)
    resolved = resolve_op(op, average)
    hosts = [to_host(x, "grouped_allreduce") for x in xs]
    with _api.together():  # one negotiation round for the group
        inners = [_api.allreduce_async(h, None, f"{base}.{i}", resolved, prescale_factor,
                                       postscale_factor, process_set)
                  for i, h in enumerate(hosts)]
    return ConvertingHandle(group(inners), lambda raws: [to_device(np.asarray(r), x)
                                                         for r, x in zip(raws, xs)],
                            base, "JaxHandle")


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> ConvertingHandle:
    """Start an allgather; the result is a new ``jax.Array``."""
    _eager_only("allgather_async", tensor)
    x = as_jax_input(tensor, "allgather")
    inner = _api.allgather_async(to_host(x, "allgather"), name, process_set)
    return _handle(inner, None, inner.name)


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> ConvertingHandle:
    """Start a broadcast from ``root_rank``; the result is a new ``jax.Array``."""
    _eager_only("broadcast_async", tensor)
    x = as_jax_input(tensor, "broadcast")
    inner = _api.broadcast_async(to_host(x, "broadcast"), root_rank, name, process_set)
    return _handle(inner, x, inner.name)


def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> ConvertingHandle:
    """Start an alltoall; the result is as for :func:`ronde.jax.alltoall`."""
    _eager_only("alltoall_async", tensor)
    x = as_jax_input(tensor, "alltoall")
    sp = None if splits is None else [int(v) for v in np.asarray(splits).reshape(-1)]
    inner = _api.alltoall_async(to_host(x, "alltoall"), sp, name, process_set)

    def convert(raw: Any) -> Any:
        if isinstance(raw, tuple):
            return to_device(np.asarray(raw[0]), None), jnp.asarray(np.asarray(raw[1], np.int32))
        return to_device(np.asarray(raw), None)

    return ConvertingHandle(inner, convert, inner.name, "JaxHandle")


def reducescatter_async(tensor: Any, name: str | None = None, op: Any = ReduceOp.AVERAGE,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> ConvertingHandle:
    """Start a reducescatter; the result is this rank's block, a new ``jax.Array``."""
    _eager_only("reducescatter_async", tensor)
    x = as_jax_input(tensor, "reducescatter")
    inner = _api.reducescatter_async(to_host(x, "reducescatter"), op, name, process_set,
                                     prescale_factor, postscale_factor)
    return _handle(inner, None, inner.name)


def synchronize(handle: ConvertingHandle) -> Any:
    """Wait for an async collective and return its result (JAX arrays for JAX calls)."""
    return handle.wait()


def poll(handle: ConvertingHandle) -> bool:
    """True if the async collective behind ``handle`` finished."""
    return bool(handle.poll())

