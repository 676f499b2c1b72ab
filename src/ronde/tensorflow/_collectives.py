"""Collectives on ``tf.Tensor``/``tf.Variable``, eager and in ``tf.function``, differentiable.

Every function hands numpy arrays to the one runtime implementation in
:mod:`ronde._api` through :func:`~ronde.tensorflow._bridge.host_call` (a
``tf.numpy_function`` in graphs). Gradients are registered with
``tf.custom_gradient``, with Horovod's rules: the gradient of an allreduce is the same
allreduce of the upstream gradient; of an allgather, this rank's rows of the *averaged*
gradient; of a broadcast, the averaged gradient on the root and zeros elsewhere; of an
alltoall, the reverse alltoall; of a reducescatter, the allgather of the upstream
gradient times the set size for Sum and times the scale factors. Signatures are
Horovod's ``horovod.tensorflow`` ones.

Unnamed collectives get their names when the op is *built*: inside a graph, the
graph's next unique name for the kind (every rank builds the same graph in the same
order, while the ops of one graph may run in any order on different ranks, so a name
drawn at run time could pair different tensors); eagerly, the next automatic name when
the call runs, which is at once.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from .. import _api
from .._api import set_size
from .._errors import UnsupportedError
from .._ops import ReduceOp
from ..frameworks.compression import Compresses
from ..frameworks.gradients import Reduction
from ..frameworks.host_reduce import GradientSpec, reduce_arrays
from ..process_sets import ProcessSet, global_process_set
from ._bridge import host_call

logger = logging.getLogger(__name__)


def _name(kind: str, name: str | None, ps: ProcessSet) -> str:
    """The given name; in a graph the graph's next unique name of ``kind``; eagerly ""
    (then :func:`_resolve` draws the automatic name when the call runs)."""
    if name is not None:
        return name
    if tf.executing_eagerly():
        return ""
    return tf.compat.v1.get_default_graph().unique_name(f"{kind}.noname")


def _resolve(name: str, kind: str, ps: ProcessSet) -> str:
    return _api.auto_name(kind, name or None, ps)


def _sparse(tensor: tf.IndexedSlices, op: ReduceOp, name: str | None, pre: float,
            post: float, ps: ProcessSet) -> tf.IndexedSlices:
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise NotImplementedError(f"allreduce of tf.IndexedSlices supports op=Sum or Average "
                                  f"only, not {op.name.capitalize()}; convert it with "
                                  "tf.convert_to_tensor for other ops")
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError("allreduce of tf.IndexedSlices does not take prescale_factor "
                                  "or postscale_factor (as in Horovod); scale the values")
    base = _name("allreduce", name, ps)
    # the values are gathered as they are and divided here, as Horovod does: an Average
    # of integer slices is TensorFlow's true division (float values)
    red = Reduction(int(ReduceOp.SUM), 1.0, 1.0, None, ps)

    def fn(values: np.ndarray, indices: np.ndarray) -> list[np.ndarray]:
        spec = GradientSpec(_resolve(base, "sparse_allreduce", ps), sparse=True)
        return reduce_arrays([values, indices], [spec], red)

    v, i = host_call(fn, [tensor.values, tensor.indices], [tensor.values.dtype,
                     tensor.indices.dtype], [tf.TensorShape([None]).concatenate(
                         tensor.values.shape[1:]), tf.TensorShape([None])],
                     "ronde_sparse_allreduce")
    if op == ReduceOp.AVERAGE:
        v = tf.math.truediv(v, set_size(ps))
    return tf.IndexedSlices(v, i, dense_shape=tensor.dense_shape)


def _reduce(tensors: Sequence[tf.Tensor], names: Sequence[str], red: Reduction,
            kind: str) -> list[tf.Tensor]:
    ps = red.process_set

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        auto = _api.auto_name(kind, None, ps) if not all(names) else ""
        specs = [GradientSpec(n or f"{auto}.{i}") for i, n in enumerate(names)]
        return reduce_arrays(list(arrays), specs, red)

    return host_call(fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors],
                     f"ronde_{kind}")


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Compresses | None = None, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over the ranks of ``process_set`` (default op: Average).

    ``tf.IndexedSlices`` are allgathered (values and indices) and scaled, as in
    Horovod. Differentiable for Sum and Average. ``device_*`` and
    ``ignore_name_scope`` are accepted for Horovod compatibility and ignored.
    """
    op = _api.resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse(tensor, op, name, prescale_factor, postscale_factor, process_set)
    op = _api.resolve_op(op, None, what="allreduce", allowed=_api.ALLREDUCE_OPS)
    red = Reduction(int(op), prescale_factor, postscale_factor, compression,
                    process_set).on_host()
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
                      device_dense: str = "", device_sparse: str = "",
                      compression: Compresses | None = None,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allreduce a list of tensors in one host call (negotiated and fused together)."""
    op = _api.resolve_op(op, average)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, compression=compression,
                          name=f"{name}.{i}" if name else None, process_set=process_set)
                for i, t in enumerate(tensors)]
    op = _api.resolve_op(op, None, what="grouped_allreduce", allowed=_api.ALLREDUCE_OPS)
    red = Reduction(int(op), prescale_factor, postscale_factor, compression,
                    process_set).on_host()
    xs = [tf.convert_to_tensor(t) for t in tensors]
    if not xs:
        return []
    base = _name("grouped_allreduce", name, process_set)
    names = [f"{base}.{i}" if base else "" for i in range(len(xs))]

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
        avg = _api.allreduce(dy, None, n, ReduceOp.AVERAGE, process_set=process_set)
        counts = _api.allgather(np.asarray([rows.shape[0]], np.int64), f"{n}.rows",
                                process_set)
        off = int(counts[:_api.set_rank(process_set)].sum())
        return [avg[off: off + rows.shape[0]]]

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
        avg = _api.allreduce(dy, None, n, ReduceOp.AVERAGE, process_set=process_set)
        return [avg if _api.rank() == root else np.zeros_like(avg)]

    @tf.custom_gradient
    def fwd(x: tf.Tensor) -> Any:
        y = host_call(run, [x], [x.dtype], [x.shape], "ronde_broadcast")[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return host_call(grad_fn, [dy], [dy.dtype], [dy.shape], "ronde_broadcast_grad")[0]

        return y, grad

    return fwd(tf.convert_to_tensor(tensor))


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send block i of ``tensor`` to rank i.

    Returns ``(output, received_splits)`` when ``splits`` is given, else the output alone
    (as Horovod does); without ``splits`` the first dimension is split evenly.
    Differentiable (the gradient is the reverse alltoall).
    """
    given = splits is not None
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
    return (y, received) if given else y


def reducescatter(tensor: Any, device_dense: str = "", compression: Compresses | None = None,
                  op: Any = ReduceOp.AVERAGE, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  name: str | None = None) -> tf.Tensor:
    """Reduce over ranks; rank r gets its block of dimension 0 (Sum or Average)."""
    if not isinstance(device_dense, str):  # an op given second, as ronde used to take it
        op, device_dense = device_dense, ""
    resolved = _api.resolve_op(op, None, what="reducescatter", allowed=_api.REDUCESCATTER_OPS)
    base = _name("reducescatter", name, process_set)
    x = tf.convert_to_tensor(tensor)
    if x.shape.rank == 0:
        raise UnsupportedError("reducescatter needs a tensor with at least one dimension; "
                               "reshape scalars to shape (1,)")
    # Horovod's rule for the gradient: the set size for Sum (none for Average), the scales
    scale = prescale_factor * postscale_factor * (set_size(process_set)
                                                  if resolved == ReduceOp.SUM else 1)

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


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather every tensor of the list (``<name>.<i>`` each); differentiable."""
    base = _name("grouped_allgather", name, process_set)
    if not base:
        base = _resolve("", "grouped_allgather", process_set)
    return [allgather(t, f"{base}.{i}", process_set=process_set) for i, t in enumerate(tensors)]


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Compresses | None = None, op: Any = ReduceOp.AVERAGE,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: str | None = None) -> list[tf.Tensor]:
    """Reducescatter every tensor of the list (``<name>.<i>`` each); differentiable."""
    base = _name("grouped_reducescatter", name, process_set)
    if not base:
        base = _resolve("", "grouped_reducescatter", process_set)
    return [reducescatter(t, compression=compression, op=op, process_set=process_set,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          name=f"{base}.{i}") for i, t in enumerate(tensors)]


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Overwrite each variable with the root rank's value, in place; returns the values."""
    from .functions import broadcast_variables

    variables = list(variables)
    base = _name("broadcast_", name, process_set)
    if not base:
        base = _resolve("", "broadcast_", process_set)
    op = broadcast_variables(variables, root_rank, process_set, name=base)
    if tf.executing_eagerly() or op is None:
        return [tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies([op]):
        return [tf.identity(tf.convert_to_tensor(v)) for v in variables]


def _set_of(process_set: ProcessSet) -> ProcessSet:
    """Horovod's ``process_set_id`` arguments (an int) or a ProcessSet, as a ProcessSet."""
    if isinstance(process_set, ProcessSet):
        return process_set
    from ..process_sets import registered

    ps = registered(int(process_set))
    if ps is None:
        raise ValueError(f"process set id {process_set} is not registered")
    return ps


def size_op(process_set_id: Any = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks of the set (an id, or a ProcessSet), as an int32 tensor."""
    return tf.constant(set_size(_set_of(process_set_id)), tf.int32)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this host, as an int32 tensor."""
    return tf.constant(_api.local_size(), tf.int32)


def process_set_included_op(process_set_id: Any = 0, name: str | None = None) -> tf.Tensor:
    """1 when this process is a member of the set, else 0 (an int32 tensor)."""
    ps = _set_of(process_set_id)
    return tf.constant(1 if ps.included() or ps.ranks is None else 0, tf.int32)


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, as an int32 tensor."""
    return tf.constant(_api.rank(), tf.int32)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's local rank, as an int32 tensor."""
    return tf.constant(_api.local_rank(), tf.int32)
