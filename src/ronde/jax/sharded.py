"""``ShardedOptimizer`` for JAX: an optax transformation whose state covers ``1/N`` of the
parameters on each rank (ZeRO stage 1; with ``stage=2`` the accumulated gradients too;
docs/sharding.md).

``update`` flattens the gradient pytree into one padded vector per dtype (``N * S``
elements, ``S = ceil(L / N)``), reduce-scatters it (Average: each rank gets the averaged
elements ``[r*S, (r+1)*S)``), runs the inner transformation on that slice and the same
slice of the parameters, and allgathers the updated slices back into an update pytree:
the traffic of one allreduce. Eager or inside ``jax.jit`` (host callbacks, as the
other collectives). The inner transformation must compute on the slice what it computes
on the whole: ``init`` proves it from the transformation's program (elementwise, every
parameter treated alike: :mod:`.slicewise`) and refuses what it cannot prove, naming the
operation (``optax.clip_by_global_norm``, ``lamb``, masks by shape...);
``ronde.jax.clip_by_global_norm`` is the global-norm clip that is right on slices.

Stage 2: JAX computes a step's gradients all at once (``jax.grad``), so there is no
backward pass to reduce-scatter from, and without accumulation stage 2 is stage 1. What
stage 2 shards is the accumulator of ``backward_passes_per_step``: stage 1 keeps a whole
gradient pytree in the state and reduces once per window; stage 2 reduce-scatters every
pass and adds this rank's slice (``1/N`` of the gradients kept, ``K`` reduce-scatters of
traffic per window instead of one: DeepSpeed's ZeRO-2 and torch's stage 2 do the same).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._errors import UnsupportedError
from .._ops import ReduceOp
from ..frameworks.compression import Compresses, wire_dtype_of
from ..frameworks.gradients import Reduction
from ..frameworks.shard_layout import ShardLayout, Span, by_kind, spans_by_kind
from ..process_sets import ProcessSet, global_process_set, shard_position
from . import _collectives as C
from ._arrays import any_traced
from .slicewise import on_slices, prove
from .optimizer import windowed
from .state import ShardedState, check_same_tree, leaf_table


class SliceSums(NamedTuple):
    """Stage 2's accumulator: per dtype group, the sum of this rank's reduce-scattered
    slices over the window's passes (``S`` elements each; the elastic reshard finds it by
    its name)."""

    slices: tuple


def _dtypes(leaves: list[Any]) -> list[Any]:
    """Each leaf's dtype, refusing what cannot be sharded."""
    out = []
    for i, x in enumerate(leaves):
        dt = jnp.result_type(x)
        if not jnp.issubdtype(dt, jnp.floating):
            raise UnsupportedError(f"ShardedOptimizer: leaf {i} is {dt}; only floating-point "
                                   "parameters can be sharded")
        out.append(dt)
    return out


def _groups(leaves: list[Any]) -> dict[Any, list[int]]:
    """Leaf indices by dtype, in first-seen order (one span each)."""
    return by_kind(_dtypes(leaves))


def layout_of(names: list[str], leaves: list[Any], rank: int, size: int,
              process_set: ProcessSet | None = None) -> ShardLayout:
    """The shard layout of parameter leaves (named by their paths): one span per dtype,
    in first-seen order, as ``init`` and ``update`` lay them out."""
    return ShardLayout(spans_by_kind(_dtypes(leaves), [int(jnp.size(x)) for x in leaves], size),
                       names, rank, size, process_set)


def slice_lengths(params: Any, size: int) -> list[int]:
    """Each dtype group's slice length ``S = ceil(L / size)`` for ``params`` (a pytree)."""
    leaves = jax.tree_util.tree_leaves(params)
    return [span.per for span in layout_of([""] * len(leaves), leaves, 0, size).spans]


def state_slice_lengths(state: "ShardedState") -> list[int | None]:
    """The slice length a ``ShardedState``'s inner states hold, per dtype group (None for
    a group whose inner state keeps no slice, e.g. plain SGD)."""
    out: list[int | None] = []
    for inner in state.inner:
        ones = [jnp.shape(x)[0] for x in jax.tree_util.tree_leaves(inner) if jnp.ndim(x) == 1]
        out.append(ones[0] if ones else None)
    return out


def _flat(leaves: list[Any], ids: list[int], size: int) -> tuple[Any, int, int]:
    """The leaves ``ids`` as one vector padded to a multiple of ``size``: (vector,
    unpadded length, per-rank slice length)."""
    span = Span(ids, [int(jnp.size(leaves[i])) for i in ids], size)
    flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in ids])
    return jnp.pad(flat, (0, span.padded - span.length)), span.length, span.per


def ShardedOptimizer(optimizer: optax.GradientTransformation,
                     process_set: ProcessSet = global_process_set,
                     name: str = "ShardedOptimizer", backward_passes_per_step: int = 1,
                     average_aggregated_gradients: bool = False,
                     compression: Compresses | None = None, stage: int = 1,
                     elementwise: bool | None = None) -> optax.GradientTransformation:
    """Wrap an elementwise optax transformation: gradients averaged over the ranks, the
    inner state and update computed on this rank's ``1/N`` of the parameters.

    Args:
        optimizer: the inner transformation (``optax.adam(1e-3)``...), elementwise.
        process_set: the ranks that shard (default: all); every member must call
            ``init`` and ``update`` with pytrees of the same structure, shapes, dtypes.
        name: base name of the collectives (give two optimizers that may run at the
            same time different names).
        backward_passes_per_step: ``update`` calls accumulated locally (in a gradient
            pytree in the state) before one reduce-scatter and one inner update; the
            others return zero updates, as ``DistributedOptimizer``'s.
        average_aggregated_gradients: divide the accumulated sum by the passes.
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``: the
            reduce-scatter's wire dtype (the gradients are cast before it and back
            after; the allgather of the updates stays in the parameters' dtype).
        stage: 1 (the inner state sharded) or 2 (also the accumulated gradients of
            ``backward_passes_per_step``: a reduce-scatter every pass, this rank's slice
            summed; the same as stage 1 without accumulation; module docstring).
        elementwise: None (default): ``init`` proves that the inner transformation
            computes on a flat slice what it computes on the whole parameters
            (:mod:`.slicewise`) and refuses it otherwise; True skips the proof (you vouch
            for it); False refuses.

    ``update`` needs ``params`` when the inner transformation does (``adamw``).

    Raises:
        UnsupportedError: at ``init``, an inner transformation that is not elementwise
            (``optax.clip_by_global_norm``: use ``ronde.jax.clip_by_global_norm``) or that
            treats parameters differently (a mask, labels, a choice by shape or name).
    """
    def init(params: Any) -> ShardedState:
        names, leaves, _ = leaf_table(params)
        r, n = shard_position(process_set)
        if n > 1 and not any_traced(leaves) and os.environ.get("RONDE_ELASTIC") != "1":
            # not in an elastic job: a worker that joins makes its state while the others
            # are elsewhere (the reshard at the next sync compares the layouts instead)
            check_same_tree(names, leaves, "ShardedOptimizer", f"{name}.parameters",
                            process_set)
        if elementwise is None:
            prove(optimizer, params, [(dt, span.members, span.per) for dt, span in zip(
                _groups(leaves), layout_of(names, leaves, r, n).spans)])
        states, sums = [], []
        for ids in _groups(leaves).values():
            flat, _, per = _flat(leaves, ids, n)
            states.append(optimizer.init(flat[r * per:(r + 1) * per]))
            if stage == 2:  # the accumulator of a window: this rank's slice
                sums.append(jnp.zeros(per, flat.dtype))
        acc: Any = ()
        if passes_per_step > 1 and stage == 2:
            acc = SliceSums(tuple(sums))
        elif passes_per_step > 1:
            acc = jax.tree_util.tree_map(jnp.zeros_like, params)
        return ShardedState(tuple(states), acc, jnp.zeros((), jnp.int32))

    def update(grads: Any, state: ShardedState, params: Any = None) -> tuple[Any, ShardedState]:
        if passes_per_step == 1:
            updates, inner = step(scatter(grads), state.inner, grads, params)
            return updates, ShardedState(inner, state.acc, state.passes)
        if stage == 2:  # this pass's slices into the window's sums; the step at its end
            updates, inner, sums, passes = windowed(
                lambda total: step(total, state.inner, grads, params), scatter(grads),
                state.inner, state.acc.slices, state.passes, passes_per_step,
                average_aggregated_gradients,
                zero_updates=jax.tree_util.tree_map(jnp.zeros_like, grads))
            return updates, ShardedState(inner, SliceSums(tuple(sums)), passes)
        updates, inner, acc, passes = windowed(
            lambda total: step(scatter(total), state.inner, grads, params), grads,
            state.inner, state.acc, state.passes, passes_per_step,
            average_aggregated_gradients)
        return updates, ShardedState(inner, acc, passes)

    def scatter(grads: Any) -> tuple:
        """The gradients averaged over the ranks, this rank's slice of each dtype group
        (the reduce-scatter of a padded flat vector)."""
        g_leaves = jax.tree_util.tree_leaves(grads)
        n = shard_position(process_set)[1]
        mine = []
        for k, (dt, ids) in enumerate(_groups(g_leaves).items()):
            flat = _flat(g_leaves, ids, n)[0]
            tag = f"{name}.{k}.{jnp.dtype(dt).name}"
            if n == 1:
                mine.append(flat)
            elif wire is None:
                mine.append(C.reducescatter_array(flat, ReduceOp.AVERAGE, f"{tag}.grads",
                                                  process_set, 1.0, 1.0))
            else:  # an fp16 Average travels as a Sum of predivided inputs (every binding's rule)
                op, pre, post = red.wire_op(wire_name)
                mine.append(C.reducescatter_array(flat.astype(wire), ReduceOp(op),
                                                  f"{tag}.grads", process_set, pre,
                                                  post).astype(flat.dtype))
        return tuple(mine)

    def step(slices: tuple, inners: tuple, like: Any, params: Any) -> tuple[Any, tuple]:
        """The inner update on this rank's slices, allgathered into an update pytree
        shaped as ``like`` (the gradients)."""
        g_leaves, treedef = jax.tree_util.tree_flatten(like)
        p_leaves = jax.tree_util.tree_flatten(params)[0] if params is not None else None
        r, n = shard_position(process_set)
        out: list[Any] = [None] * len(g_leaves)
        states = []
        for k, ((dt, ids), mine, inner) in enumerate(zip(_groups(g_leaves).items(), slices,
                                                         inners)):
            per = int(mine.shape[0])
            p_mine = None
            if p_leaves is not None:
                p_mine = _flat(p_leaves, ids, n)[0][r * per:(r + 1) * per]
            tag = f"{name}.{k}.{jnp.dtype(dt).name}"
            with on_slices(process_set if n > 1 else None, tag):  # (clip_by_global_norm)
                upd, new_inner = optimizer.update(mine, inner, p_mine)
            full = upd if n == 1 else C.allgather_array(upd, f"{tag}.updates", process_set)
            at = 0
            for i in ids:
                size = g_leaves[i].size
                out[i] = full[at:at + size].reshape(jnp.shape(g_leaves[i]))
                at += size
            states.append(new_inner)
        return jax.tree_util.tree_unflatten(treedef, out), tuple(states)

    if stage not in (1, 2):
        raise ValueError(f"ShardedOptimizer: stage={stage!r}; 1 (the optimizer's state "
                         "sharded) or 2 (the accumulated gradients too)")
    if elementwise is False:
        raise UnsupportedError("ShardedOptimizer: the inner transformation was declared not "
                               "elementwise; use DistributedOptimizer")

    red = Reduction.configure(ReduceOp.AVERAGE, 1.0, compression, process_set,
                              backward_passes_per_step, on_host=True)
    passes_per_step = red.passes_per_step
    wire_name = wire_dtype_of(compression)
    wire = None if wire_name is None else jnp.dtype(wire_name)
    return optax.GradientTransformation(init, update)
