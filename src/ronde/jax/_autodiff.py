"""The public, differentiable collectives on JAX arrays and pytrees of them.

Each wraps a host collective of :mod:`ronde.jax._collectives` in ``jax.custom_vjp``
whose backward pass is itself a collective, so ``jax.grad`` of a loss computed from
a collective's output gives every rank the gradient with respect to its own input:

* allreduce (Sum/Average): the cotangent is allreduced with the same op and scale
  factors. Min/Max: the summed cotangent goes to the selected elements (all tied
  ones). Product has no gradient here.
* allgather: the cotangent is summed over ranks and each rank keeps its own rows.
* broadcast: the cotangent is summed over ranks and delivered to the root; the other
  ranks get zeros (their values were not used).

Backward collectives are named ``<name>.grad``. Integer leaves are reduced without a
gradient. ``alltoall`` and ``reducescatter`` are not differentiable (yet).

A pytree with several leaves is reduced as a group: leaf ``i`` is the collective
``<name>.<i>``; all leaves are submitted before any is awaited, so the engine
negotiates them in one round and fuses the small ones.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..frameworks.compression import Compresses
from .. import _api
from .._ops import ReduceOp
from ..frameworks.compression import NUMPY_COMPRESSION
from ..process_sets import ProcessSet, global_process_set
from . import _collectives as C
from ._arrays import as_jax_input, host_call, spec_of, to_host

logger = logging.getLogger(__name__)

#: ``ronde.jax.Compression``: casts happen on the host, right before the wire
Compression = NUMPY_COMPRESSION


def _differentiable(x: Any) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def _reduce_leaves(xs: Sequence[Any], names: Sequence[str], op: ReduceOp, pre: float,
                   post: float, ps: ProcessSet, compression: Compresses) -> list[Any]:
    """Allreduce float leaves through a custom VJP and the others directly."""
    xs = [as_jax_input(x, "allreduce") for x in xs]
    diff = [i for i, x in enumerate(xs) if _differentiable(x)]
    other = [i for i, x in enumerate(xs) if not _differentiable(x)]
    out: list[Any] = [None] * len(xs)
    if other:
        got = C.allreduce_arrays([xs[i] for i in other], [names[i] for i in other], op, pre,
                                 post, ps, compression)
        for i, g in zip(other, got):
            out[i] = g
    if not diff:
        return out
    fwd_names = [names[i] for i in diff]
    grad_names = [f"{n}.grad" for n in fwd_names]

    @jax.custom_vjp
    def reduce(leaves: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(C.allreduce_arrays(leaves, fwd_names, op, pre, post, ps, compression))

    def fwd(leaves: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
        outs = reduce(leaves)
        return outs, ((leaves, outs) if op in (ReduceOp.MIN, ReduceOp.MAX) else None)

    def bwd(res: Any, cts: tuple[Any, ...]) -> tuple[tuple[Any, ...]]:
        if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            return (tuple(C.allreduce_arrays(cts, grad_names, op, pre, post, ps, compression)),)
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            if pre != 1.0 or post != 1.0:
                raise NotImplementedError("the gradient of a Min/Max allreduce with scale "
                                          "factors is not implemented")
            leaves, outs = res
            summed = C.allreduce_arrays(cts, grad_names, ReduceOp.SUM, 1.0, 1.0, ps,
                                        Compression.none)
            return (tuple(g * (x == o).astype(g.dtype)
                          for g, x, o in zip(summed, leaves, outs)),)
        raise NotImplementedError(f"the gradient of an allreduce with op={op.name} is not "
                                  "implemented; use Sum or Average")

    reduce.defvjp(fwd, bwd)
    for i, r in zip(diff, reduce(tuple(xs[i] for i in diff))):
        out[i] = r
    return out


def _leaf_names(kind: str, name: str | None, n: int, single: bool,
                process_set: ProcessSet) -> list[str]:
    if single:
        return [C.collective_name(kind, name, process_set)]
    base = C.collective_name(f"grouped_{kind}", name, process_set)
    return [f"{base}.{i}" for i in range(n)]


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: Compresses = Compression.none, op: Any = None,
              prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce an array, or every leaf of a pytree, over the ranks of the process set.

    Works eagerly and inside ``jax.jit``; differentiable (see the module doc).

    Args:
        tensor: a ``jax.Array`` (or array-like) or a pytree of them; same shapes and
            dtypes on every rank.
        average: deprecated; ``True`` means ``op=Average``, ``False`` ``op=Sum``.
        name: the collective's name (a pytree's leaf ``i`` is ``<name>.<i>``); inside
            ``jit`` give one, see docs/jax.md.
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``: floats are
            cast on the host for the wire and back.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiplies each input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part (default: all).

    Returns:
        The reduced array or pytree (new arrays; the input is unchanged).
    """
    resolved = C.resolve_op(op, average)
    leaves, treedef = jax.tree_util.tree_flatten(tensor)
    if not leaves:
        return tensor
    single = jax.tree_util.treedef_is_leaf(treedef)
    names = _leaf_names("allreduce", name, len(leaves), single, process_set)
    out = _reduce_leaves(leaves, names, resolved, prescale_factor, postscale_factor,
                         process_set, compression)
    return jax.tree_util.tree_unflatten(treedef, out)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      name: str | None = None, compression: Compresses = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Allreduce a list of arrays together (tensor ``i`` is ``<name>.<i>``); differentiable."""
    base = C.collective_name("grouped_allreduce", name, process_set)
    xs = list(tensors)
    return _reduce_leaves(xs, [f"{base}.{i}" for i in range(len(xs))],
                          C.resolve_op(op, average), prescale_factor, postscale_factor,
                          process_set, compression)


def _gather_one(x: Any, name: str, ps: ProcessSet) -> Any:
    x = as_jax_input(x, "allgather")
    if not _differentiable(x):
        return C.allgather_array(x, name, ps)

    @jax.custom_vjp
    def gather(v: Any) -> Any:
        return C.allgather_array(v, name, ps)

    def fwd(v: Any) -> tuple[Any, None]:
        return gather(v), None

    def bwd(_res: None, ct: Any) -> tuple[Any]:
        rows = x.shape[0]
        index, _ = C.set_rank_and_size(ps)

        def back(g: np.ndarray) -> list[np.ndarray]:
            sizes = _api.allgather(np.array([rows], np.int64), f"{name}.grad.rows", ps)
            summed = _api.allreduce(to_host(g, "allgather"), None, f"{name}.grad",
                                    ReduceOp.SUM, process_set=ps)
            start = int(sizes[:index].sum())
            return [summed[start:start + rows]]

        return (host_call(back, [spec_of(x)], [ct])[0],)

    gather.defvjp(fwd, bwd)
    return gather(x)


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's array (or each pytree leaf) along the first dimension.

    The first dimension may differ between ranks eagerly; inside ``jax.jit`` the
    output shape is fixed at trace time, so every rank must pass the same first
    dimension there. Differentiable.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tensor)
    single = jax.tree_util.treedef_is_leaf(treedef)
    names = _leaf_names("allgather", name, len(leaves), single, process_set)
    return jax.tree_util.tree_unflatten(
        treedef, [_gather_one(x, n, process_set) for x, n in zip(leaves, names)])


def _broadcast_one(x: Any, root_rank: int, name: str, ps: ProcessSet) -> Any:
    x = as_jax_input(x, "broadcast")
    if not _differentiable(x):
        return C.broadcast_array(x, root_rank, name, ps)

    @jax.custom_vjp
    def bcast(v: Any) -> Any:
        return C.broadcast_array(v, root_rank, name, ps)

    def fwd(v: Any) -> tuple[Any, None]:
        return bcast(v), None

    def bwd(_res: None, ct: Any) -> tuple[Any]:
        def back(g: np.ndarray) -> list[np.ndarray]:
            summed = _api.allreduce(to_host(g, "broadcast"), None, f"{name}.grad",
                                    ReduceOp.SUM, process_set=ps)
            return [summed if _api.rank() == root_rank else np.zeros_like(summed)]

        return (host_call(back, [spec_of(ct)], [ct])[0],)

    bcast.defvjp(fwd, bwd)
    return bcast(x)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """The root's array (or pytree) on every rank; eager or inside ``jit``; differentiable."""
    leaves, treedef = jax.tree_util.tree_flatten(tensor)
    single = jax.tree_util.treedef_is_leaf(treedef)
    names = _leaf_names("broadcast", name, len(leaves), single, process_set)
    return jax.tree_util.tree_unflatten(
        treedef, [_broadcast_one(x, root_rank, n, process_set) for x, n in zip(leaves, names)])


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send block ``i`` of the first dimension to rank ``i`` (Horovod's alltoall).

    Without ``splits`` the first dimension is cut into equal blocks and the result
    is one array (also inside ``jit``); with ``splits`` (eager only) the result is
    ``(output, received_splits)``. Not differentiable.
    """
    return C.alltoall_array(tensor, splits, C.collective_name("alltoall", name, process_set),
                            process_set)


def reducescatter(tensor: Any, op: Any = ReduceOp.AVERAGE, name: str | None = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce over ranks; rank ``r`` of the set gets its block of the first dimension.

    Earlier ranks take one extra row when the first dimension does not divide (as
    Horovod). ``op``: Average (default) or Sum. Eager or inside ``jit``; not
    differentiable.
    """
    resolved = C.resolve_op(op, None)
    if resolved not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError("reducescatter supports op=Sum or op=Average only")
    return C.reducescatter_array(tensor, resolved,
                                 C.collective_name("reducescatter", name, process_set),
                                 process_set, prescale_factor, postscale_factor)
