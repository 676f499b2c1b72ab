"""Collectives on ``tf.Tensor``/``tf.Variable``, eager and in ``tf.function``, differentiable.

Every function hands numpy arrays to the one runtime implementation in
:mod:`ronde._api` through :func:`~ronde.tensorflow._bridge.host_call` (a
``tf.numpy_function`` in graphs). Gradients are registered with
``tf.custom_gradient``: the gradient of an allreduce is the same allreduce of the
upstream gradient; of an allgather, this rank's rows of the summed gradient; of a
broadcast, the summed gradient on the root and zeros elsewhere; of an alltoall,
the reverse alltoall; of a reducescatter, the allgather (scaled as the forward).
Signatures are Horovod's ``horovod.tensorflow`` ones.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from .. import _api
from .._ops import ReduceOp
from ..frameworks.host_reduce import GradientSpec, Reduction, reduce_arrays, set_size, \
    wire_dtype_of
from ..process_sets import ProcessSet, global_process_set
from ._bridge import host_call

logger = logging.getLogger(__name__)


def _name(kind: str, name: str | None, ps: ProcessSet) -> str:
    """A name fixed at trace time (given) or drawn per execution (auto)."""
    return name if name is not None else ""


def _resolve(name: str, kind: str, ps: ProcessSet) -> str:
    return name or _api._auto_name(kind, _api._ps_id(ps))


def _sparse(tensor: tf.IndexedSlices, op: ReduceOp, name: str | None, pre: float,
            post: float, ps: ProcessSet) -> tf.IndexedSlices:
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError("allreduce of IndexedSlices supports op=Sum or Average only")
    base = _name("allreduce", name, ps)
    red = Reduction(int(op), pre, post, None, ps)

    def fn(values: np.ndarray, indices: np.ndarray) -> list[np.ndarray]:
        spec = GradientSpec(_resolve(base, "sparse_allreduce", ps), sparse=True)
        return reduce_arrays([values, indices], [spec], red)

    v, i = host_call(fn, [tensor.values, tensor.indices], [tensor.values.dtype,
                     tensor.indices.dtype], [tf.TensorShape([None]).concatenate(
                         tensor.values.shape[1:]), tf.TensorShape([None])],
                     "ronde_sparse_allreduce")
    return tf.IndexedSlices(v, i, dense_shape=tensor.dense_shape)


def _reduce(tensors: Sequence[tf.Tensor], names: Sequence[str], red: Reduction,
            kind: str) -> list[tf.Tensor]:
    ps = red.process_set

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        auto = _api._auto_name(kind, _api._ps_id(ps)) if not all(names) else ""
        specs = [GradientSpec(n or f"{auto}.{i}") for i, n in enumerate(names)]
        return reduce_arrays(list(arrays), specs, red)

    return host_call(fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors],
                     f"ronde_{kind}")


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = None, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over the ranks of ``process_set`` (default op: Average).

    ``tf.IndexedSlices`` are allgathered (values and indices) and scaled, as in
    Horovod. Differentiable for Sum and Average. ``device_*`` and
    ``ignore_name_scope`` are accepted for Horovod compatibility and ignored.
    """
    op = _api._resolve_op(op, average)
    if op == ReduceOp.ADASUM:
        raise ValueError("op=Adasum is not supported yet; use Average or Sum")
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse(tensor, op, name, prescale_factor, postscale_factor, process_set)
    red = Reduction(int(op), prescale_factor, postscale_factor, wire_dtype_of(compression),
                    process_set)
    base = _name("allreduce", name, process_set)
    gname = f"{base}.grad" if base else ""

    @tf.custom_gradient
    def fwd(x: tf.Tensor) -> Any:
        y = _reduce([x], [base], red, "allreduce")[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
                raise NotImplementedError(f"the gradient of an allreduce with op={op.name} is "
                                          "not implemented")
            return _reduce([dy], [gname], red, "allreduce_grad")[0]

        return y, grad

    return fwd(tf.convert_to_tensor(tensor))


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "", compression: Any = None,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allreduce a list of tensors in one host call (negotiated and fused together)."""
    op = _api._resolve_op(op, average)
    red = Reduction(int(op), prescale_factor, postscale_factor, wire_dtype_of(compression),
                    process_set)
    xs = [tf.convert_to_tensor(t) for t in tensors]
    if not xs:
        return []
    names = [f"{name}.{i}" if name else "" for i in range(len(xs))]

    @tf.custom_gradient
    def fwd(*x: tf.Tensor) -> Any:
        ys = _reduce(list(x), names, red, "grouped_allreduce")

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return _reduce(list(dys), [f"{n}.grad" if n else "" for n in names], red,
                           "grouped_allreduce_grad")

        return ys, grad

    return list(fwd(*xs))


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along dimension 0 (sizes may differ); differentiable."""
    base = _name("allgather", name, process_set)
    x = tf.convert_to_tensor(tensor)
    if x.shape.rank == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; "
                         "reshape scalars to shape (1,)")

    def run(a: np.ndarray) -> list[np.ndarray]:
        return [_api.allgather(a, _resolve(base, "allgather", process_set), process_set)]

    def grad_fn(dy: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
        n = _resolve(f"{base}.grad" if base else "", "allgather_grad", process_set)
        summed = _api.allreduce(dy, None, n, ReduceOp.SUM, process_set=process_set)
        counts = _api.allgather(np.asarray([rows.shape[0]], np.int64), f"{n}.rows",
                                process_set)
        me = process_set.rank() if process_set.ranks is not None else _api.rank()
        off = int(counts[:me].sum())
        return [summed[off: off + rows.shape[0]]]

    @tf.custom_gradient
    def fwd(x: tf.Tensor) -> Any:
        y = host_call(run, [x], [x.dtype], [tf.TensorShape([None]).concatenate(x.shape[1:])],
                      "ronde_allgather")[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return host_call(grad_fn, [dy, x], [dy.dtype], [x.shape], "ronde_allgather_grad")[0]

        return y, grad

    return fwd(x)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return ``root_rank``'s tensor on every rank; differentiable."""
    base = _name("broadcast", name, process_set)
    root = int(root_rank)

    def run(a: np.ndarray) -> list[np.ndarray]:
        return [_api.broadcast(a, root, _resolve(base, "broadcast", process_set), process_set)]

    def grad_fn(dy: np.ndarray) -> list[np.ndarray]:
        n = _resolve(f"{base}.grad" if base else "", "broadcast_grad", process_set)
        summed = _api.allreduce(dy, None, n, ReduceOp.SUM, process_set=process_set)
        return [summed if _api.rank() == root else np.zeros_like(summed)]

    @tf.custom_gradient
    def fwd(x: tf.Tensor) -> Any:
        y = host_call(run, [x], [x.dtype], [x.shape], "ronde_broadcast")[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return host_call(grad_fn, [dy], [dy.dtype], [dy.shape], "ronde_broadcast_grad")[0]

        return y, grad

    return fwd(tf.convert_to_tensor(tensor))


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> tuple[tf.Tensor, tf.Tensor]:
    """Send block i of ``tensor`` to rank i; returns ``(output, received_splits)``.

    Without ``splits`` the first dimension is split evenly. Differentiable (the
    gradient is the reverse alltoall).
    """
    base = _name("alltoall", name, process_set)
    x = tf.convert_to_tensor(tensor)
    n = set_size(process_set)
    sp = tf.fill([n], tf.shape(x)[0] // n) if splits is None else \
        tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int64)
    sp = tf.cast(sp, tf.int64)

    def run(a: np.ndarray, s: np.ndarray, tag: str) -> list[np.ndarray]:
        out, got = _api.alltoall(a, [int(v) for v in s], _resolve(
            f"{base}{tag}" if base else "", "alltoall", process_set), process_set)
        return [out, np.asarray(got, np.int32)]

    shape = tf.TensorShape([None]).concatenate(x.shape[1:])

    @tf.custom_gradient
    def fwd(x: tf.Tensor) -> Any:
        y, received = host_call(lambda a, s: run(a, s, ""), [x, sp], [x.dtype, tf.int32],
                                [shape, [n]], "ronde_alltoall")

        def grad(dy: tf.Tensor, _unused: Any = None) -> tf.Tensor:
            g = host_call(lambda a, s: run(a, s, ".grad"), [dy, received], [dy.dtype, tf.int32],
                          [shape, [n]], "ronde_alltoall_grad")[0]
            return g

        return (y, received), grad

    y, received = fwd(x)
    return y, received


def reducescatter(tensor: Any, op: Any = ReduceOp.AVERAGE, name: str | None = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, compression: Any = None) -> tf.Tensor:
    """Reduce over ranks; rank r gets its block of dimension 0 (Sum or Average)."""
    resolved = _api._resolve_op(op, None)
    base = _name("reducescatter", name, process_set)
    x = tf.convert_to_tensor(tensor)
    scale = prescale_factor * postscale_factor
    if resolved == ReduceOp.AVERAGE:
        scale /= set_size(process_set)

    def run(a: np.ndarray) -> list[np.ndarray]:
        return [_api.reducescatter(a, resolved, _resolve(base, "reducescatter", process_set),
                                   process_set, prescale_factor, postscale_factor)]

    def grad_fn(dy: np.ndarray) -> list[np.ndarray]:
        n = _resolve(f"{base}.grad" if base else "", "reducescatter_grad", process_set)
        g = _api.allgather(dy, n, process_set)
        return [(g * scale).astype(g.dtype, copy=False) if scale != 1.0 else g]

    @tf.custom_gradient
    def fwd(x: tf.Tensor) -> Any:
        y = host_call(run, [x], [x.dtype], [tf.TensorShape([None]).concatenate(x.shape[1:])],
                      "ronde_reducescatter")[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return host_call(grad_fn, [dy], [dy.dtype], [x.shape], "ronde_reducescatter_grad")[0]

        return y, grad

    return fwd(x)


def join(device: str = "", process_set: ProcessSet = global_process_set) -> Any:
    """Signal this rank has no more data; returns the last rank to join (a tensor in graphs)."""
    if tf.executing_eagerly():
        return tf.constant(_api.join(process_set=process_set), tf.int32)
    return host_call(lambda: [np.asarray(_api.join(process_set=process_set), np.int32)], [],
                     [tf.int32],
                     [[]], "ronde_join")[0]


def barrier(process_set: ProcessSet = global_process_set) -> Any:
    """Wait until every rank of the set reaches the barrier (an op in graphs)."""
    if tf.executing_eagerly():
        _api.barrier(process_set)
        return None
    def run() -> list[np.ndarray]:
        _api.barrier(process_set)
        return [np.asarray(0, np.int32)]

    return host_call(run, [], [tf.int32], [[]], "ronde_barrier")[0]


def size_op(process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """The number of ranks of the set, as an int32 tensor."""
    return tf.constant(set_size(process_set), tf.int32)


def rank_op() -> tf.Tensor:
    """This process's rank, as an int32 tensor."""
    return tf.constant(_api.rank(), tf.int32)


def local_rank_op() -> tf.Tensor:
    """This process's local rank, as an int32 tensor."""
    return tf.constant(_api.local_rank(), tf.int32)
