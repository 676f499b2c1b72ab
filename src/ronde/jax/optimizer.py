"""Optax transformations that average gradients over ranks before the inner update.

``DistributedOptimizer(tx)`` is an ``optax.GradientTransformation``: its ``update``
averages the gradient pytree over the ranks, then runs ``tx.update`` on the
result. It works eagerly and inside ``jax.jit`` (the reduction is a host callback,
see docs/jax.md)::

    tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

**Fusion.** The whole gradient pytree is reduced by one host call: the leaves are
flattened into one buffer per dtype (usually a single allreduce per step), through
:func:`ronde.frameworks.host_reduce.fused_allreduce`, which also applies the compression.

**Accumulation** (``backward_passes_per_step=N``, as in ``ronde.torch``): each
``update`` call is one backward pass. The first N-1 calls add the gradients to a
local accumulator (kept in the optimizer state) and return zero updates; the N-th
allreduces the accumulated sum and applies the inner update. The sum is not
rescaled unless ``average_aggregated_gradients=True`` (Horovod's TensorFlow
option), which divides it by N.

**Consistency.** ``init(params)`` (when called eagerly) compares the ranks' parameter
tables and raises ``TensorMismatchError`` naming the leaves that differ, instead of
letting an allreduce wait for a buffer of another size.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._ops import ReduceOp
from ..frameworks.compression import NUMPY_COMPRESSION as Compression
from ..frameworks.compression import Compresses
from ..frameworks.gradients import Reduction
from ..frameworks.host_reduce import fused_allreduce
from ..process_sets import ProcessSet, global_process_set
from . import _collectives as C
from ._arrays import any_traced, host_call, spec_of
from .state import check_same_tree, leaf_table

logger = logging.getLogger(__name__)

#: base name of the gradient buffers (``<name>.<dtype>``)
DEFAULT_NAME = "DistributedOptimizer.grads"


class DistributedState(NamedTuple):
    """The optimizer state of :func:`DistributedOptimizer`.

    Attributes:
        inner: the wrapped transformation's state.
        acc: the gradients accumulated in the current window (``()`` when N is 1).
        passes: backward passes accumulated in the current window (int32 scalar).
    """

    inner: Any
    acc: Any
    passes: Any


def reduce_gradients(grads: Any, name: str = DEFAULT_NAME, op: Any = ReduceOp.AVERAGE,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set,
                     compression: Compresses = Compression.none) -> Any:
    """Allreduce a gradient pytree as one buffer per dtype; eager or inside ``jit``.

    Not differentiable (it is meant for gradients). Every rank must pass a pytree
    of the same structure, shapes and dtypes.
    """
    return _reduce(grads, name, Reduction(int(C.resolve_op(op, None)), prescale_factor,
                                          postscale_factor, compression, process_set))


def _reduce(grads: Any, name: str, reduction: Reduction) -> Any:
    reduction = reduction.on_host()
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    if not leaves:
        return grads
    leaves = [jnp.asarray(x) for x in leaves]

    def fn(*arrays: Any) -> list[Any]:
        return fused_allreduce(arrays, name, reduction)

    out = host_call(fn, [spec_of(x) for x in leaves], leaves, likes=leaves)
    return jax.tree_util.tree_unflatten(treedef, list(out))


def allreduce_gradients(op: Any = ReduceOp.AVERAGE, compression: Compresses = Compression.none,
                        gradient_predivide_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set,
                        name: str = DEFAULT_NAME) -> optax.GradientTransformation:
    """A stateless optax transformation that averages the gradients over ranks.

    Chain it in front of any optimizer: ``optax.chain(hvd.allreduce_gradients(),
    optax.adam(1e-3))``. Arguments as for :func:`DistributedOptimizer`.
    """
    red = Reduction.configure(op, gradient_predivide_factor, compression, process_set,
                              on_host=True)  # fails now on a wrong argument

    def init(params: Any) -> optax.EmptyState:
        return optax.EmptyState()

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return _reduce(updates, name, red), state

    return optax.GradientTransformation(init, update)


def DistributedOptimizer(optimizer: optax.GradientTransformation,
                         compression: Compresses = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False,
                         process_set: ProcessSet = global_process_set,
                         name: str = DEFAULT_NAME) -> optax.GradientTransformation:
    """Wrap an optax transformation so that it sees gradients averaged over all ranks.

    Args:
        optimizer: the inner ``optax.GradientTransformation`` (e.g. ``optax.sgd(...)``).
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``.
        backward_passes_per_step: ``update`` calls accumulated locally before one
            allreduce and one inner update (see the module doc).
        op: ``Average`` (default) or ``Sum``; ``Adasum``: the delta optimizer (each
            rank's inner update of its own gradients, combined over the ranks with
            Adasum leaf by leaf; see docs/adasum.md; do not scale the learning rate).
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        average_aggregated_gradients: divide the accumulated sum by
            ``backward_passes_per_step`` before the allreduce.
        process_set: the ranks that average their gradients (default: all).
        name: base name of the gradient collectives (give two optimizers that may
            run at the same time different names).

    Returns:
        An ``optax.GradientTransformation`` whose state is a :class:`DistributedState`.

    Raises:
        ValueError: an unsupported op, a predivide factor with an op other than
            Average, or ``backward_passes_per_step < 1``.
    """
    resolved = C.resolve_op(op, None)
    if resolved == ReduceOp.ADASUM:
        return _adasum_optimizer(optimizer, compression, backward_passes_per_step,
                                 process_set, name)
    if resolved not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"DistributedOptimizer supports op=Average, Sum or Adasum, not "
                         f"{resolved.name}")
    red = Reduction.configure(resolved, gradient_predivide_factor, compression, process_set,
                              backward_passes_per_step, on_host=True)
    passes_per_step = red.passes_per_step

    def reduce(grads: Any) -> Any:
        return _reduce(grads, name, red)

    def init(params: Any) -> DistributedState:
        names, leaves, _ = leaf_table(params)
        if not any_traced(leaves):
            check_same_tree(names, leaves, "DistributedOptimizer",
                            f"{name}.parameters", process_set)
        acc = jax.tree_util.tree_map(jnp.zeros_like, params) if passes_per_step > 1 else ()
        return DistributedState(optimizer.init(params), acc, jnp.zeros((), jnp.int32))

    def update(grads: Any, state: DistributedState,
               params: Any = None) -> tuple[Any, DistributedState]:
        if passes_per_step == 1:
            updates, inner = optimizer.update(reduce(grads), state.inner, params)
            return updates, DistributedState(inner, state.acc, state.passes)
        updates, inner, acc, passes = windowed(
            lambda total: optimizer.update(reduce(total), state.inner, params), grads,
            state.inner, state.acc, state.passes, passes_per_step, average_aggregated_gradients)
        return updates, DistributedState(inner, acc, passes)

    return optax.GradientTransformation(init, update)


def windowed(apply: Any, grads: Any, inner: Any, acc: Any, passes: Any, passes_per_step: int,
             average: bool, zero_updates: Any = None) -> tuple[Any, Any, Any, Any]:
    """One backward pass of a ``backward_passes_per_step`` window: ``grads`` added to
    ``acc``; on the window's last pass, ``apply(total)`` (the reduction and the inner
    update: ``(updates, inner)``) and a new window, else zero updates (``zero_updates``,
    or zeros shaped as ``acc``). Eager, or both branches traced under ``jax.lax.cond``.
    Returns ``(updates, inner, acc, passes)``."""
    acc = jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), acc, grads)
    passes = passes + 1

    def last(_: Any) -> tuple[Any, Any, Any, Any]:
        total = jax.tree_util.tree_map(lambda a: a / passes_per_step, acc) if average else acc
        updates, new_inner = apply(total)
        return (updates, new_inner, jax.tree_util.tree_map(jnp.zeros_like, acc),
                jnp.zeros((), jnp.int32))

    def more(_: Any) -> tuple[Any, Any, Any, Any]:
        zeros = (jax.tree_util.tree_map(jnp.zeros_like, acc) if zero_updates is None
                 else zero_updates)
        return zeros, inner, acc, passes

    if not any_traced([passes]):  # eager: no need to trace both branches
        return last(None) if int(passes) >= passes_per_step else more(None)
    return jax.lax.cond(passes >= passes_per_step, last, more, None)


def _adasum_optimizer(optimizer: optax.GradientTransformation, compression: Compresses,
                      backward_passes_per_step: int, process_set: ProcessSet,
                      name: str) -> optax.GradientTransformation:
    """``DistributedOptimizer(tx, op=Adasum)``: optax's updates are the parameter
    deltas, so the delta optimizer is the inner update of the local gradients, then
    those combined with Adasum (leaf by leaf: ``fused_allreduce`` never fuses Adasum)."""
    if int(backward_passes_per_step) != 1:
        raise ValueError("DistributedOptimizer(op=Adasum) combines each step's parameter "
                         "deltas; it does not accumulate passes (backward_passes_per_step "
                         "must be 1)")
    red = Reduction.configure(ReduceOp.ADASUM, 1.0, compression, process_set, on_host=True)

    def init(params: Any) -> DistributedState:
        names, leaves, _ = leaf_table(params)
        if not any_traced(leaves):
            check_same_tree(names, leaves, "DistributedOptimizer", f"{name}.parameters",
                            process_set)
        return DistributedState(optimizer.init(params), (), jnp.zeros((), jnp.int32))

    def update(grads: Any, state: DistributedState,
               params: Any = None) -> tuple[Any, DistributedState]:
        updates, inner = optimizer.update(grads, state.inner, params)
        combined = _reduce(updates, f"{name}.adasum", red)
        return combined, DistributedState(inner, state.acc, state.passes)

    return optax.GradientTransformation(init, update)
