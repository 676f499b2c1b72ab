"""What a ``ShardedOptimizer``'s inner transformation computes on this rank's slice.

``ronde.jax.ShardedOptimizer`` runs the inner optax transformation on one flat vector per
dtype: this rank's elements ``[r*S, (r+1)*S)`` of every parameter of that dtype laid end
to end. That equals what the transformation computes on the whole parameters only when

1. it is **elementwise**: no operation mixes elements of the gradients, the parameters or
   its state (a norm, a mean, a matrix product, a sort, a random draw per element would
   see the slice, not the whole: ``optax.clip_by_global_norm``, ``lamb``, ``adafactor``,
   ``muon``, ``apply_if_finite``, ``add_noise``...); and
2. it is **uniform**: every parameter goes through the same operations, and a flat vector
   too (a mask, ``multi_transform``'s labels, or any choice made from a parameter's shape
   or name would see a 1-D vector and no names: ``adamw(mask=lambda p: tree.map(lambda x:
   x.ndim > 1, p))`` would decay nothing).

:func:`prove` checks both from the transformation's own program: ``jax.make_jaxpr`` of its
``update`` on the user's parameter tree (abstract shapes: nothing allocated) and on a flat
vector. Every operation reached from the gradients, the parameters or a non-scalar state
leaf must be elementwise (a whitelist of primitives; scalars such as step counts and
schedules may do anything), and each parameter's operations (counted from its gradient and
from its value) must be those of the flat vector. A transformation it cannot prove is
refused at ``init``, naming the operation and where optax computes it; optax's adam,
adamw without mask, sgd, lion, rmsprop, adagrad... pass.

:func:`clip_by_global_norm` is the one whole-gradient transformation ronde computes right
on slices: inside a ``ShardedOptimizer`` (the context the optimizer sets around the inner
``update``) it allreduces the slices' squared norms (one number a step) and clips by the
global norm; anywhere else it is optax's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore

from .._errors import UnsupportedError
from .._ops import ReduceOp
from ..frameworks.compression import NUMPY_COMPRESSION as Compression
from ..process_sets import ProcessSet
from . import _collectives as C

#: primitives that compute each output element from the same element of their inputs
#: (scalars broadcast), or only re-shape an array
ELEMENTWISE = frozenset("""
    abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp conj complex
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic lt max min mul
    ne neg nextafter not or population_count pow real reduce_precision rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
    stop_gradient sub tan tanh xor optimization_barrier
    broadcast_in_dim reshape squeeze expand_dims
""".split())

#: elementwise primitives that only move an array (not counted in a parameter's operations:
#: a leaf of shape (3, 2) and a flat vector need different ones)
_SHAPING = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy",
                      "copy_p", "optimization_barrier"})

#: primitives whose every element depends on its position, not on an input element
_POSITIONAL = frozenset({"iota", "random_bits", "rng_bit_generator", "threefry2x32",
                         "rng_uniform", "random_wrap", "random_unwrap", "random_seed"})


class _Sharded(NamedTuple):
    """Where an inner transformation runs: a ``ShardedOptimizer``'s slices (the process
    set and the collective's name), or ``proving`` (:func:`prove`'s abstract traces)."""

    process_set: ProcessSet | None
    name: str
    proving: bool
    clips: list  # the clips seen (by the proof)


_CONTEXT: contextvars.ContextVar[_Sharded | None] = contextvars.ContextVar(
    "ronde_jax_sharded", default=None)


@contextlib.contextmanager
def on_slices(process_set: ProcessSet | None, name: str) -> Iterator[None]:
    """Run the inner transformation on this rank's slices (``ShardedOptimizer.update``):
    :func:`clip_by_global_norm` inside allreduces over ``process_set`` as ``name``."""
    token = _CONTEXT.set(_Sharded(process_set, name, False, []))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` that is right inside ``ronde.jax.ShardedOptimizer``:
    there each rank holds a slice of the gradients, and the norm is the square root of
    the slices' squared norms summed over the ranks (one allreduce of a number a step,
    named after the optimizer, so under ``jax.jit`` too); anywhere else (a plain optax
    chain, ``DistributedOptimizer``) it is optax's own.

    Use it first in the inner chain, as optax's:
    ``ShardedOptimizer(optax.chain(hvd.clip_by_global_norm(1.0), optax.adamw(1e-3)))``.
    With parameters of several dtypes a ``ShardedOptimizer`` steps each dtype on its own and
    refuses it (the norm would be per dtype)."""

    def init(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple:
        del params
        where = _CONTEXT.get()
        leaves = jax.tree_util.tree_leaves(updates)
        if where is None:  # whole gradients
            norm = optax.tree.norm(updates)
        elif where.proving:  # a number common to every element, as far as the proof goes
            where.clips.append(max_norm)
            norm = jnp.ones((), leaves[0].dtype if leaves else jnp.float32)
        else:
            square = sum(jnp.sum(jnp.square(x)) for x in leaves)
            if where.process_set is not None:
                square = C.allreduce_arrays([square], [f"{where.name}.clip_by_global_norm"],
                                            ReduceOp.SUM, 1.0, 1.0, where.process_set,
                                            Compression.none)[0]
            norm = jnp.sqrt(square)
        trigger = jnp.squeeze(norm < max_norm)

        def clip(t: Any) -> Any:  # optax's own formula
            return jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)

        return jax.tree_util.tree_map(clip, updates), state

    return optax.GradientTransformation(init, update)


class _Walk:
    """One pass over a jaxpr: which variables derive from which colored inputs (a
    parameter's gradient, its value, a state leaf), the operations each color reaches, the
    first operation that is not elementwise."""

    def __init__(self) -> None:
        self.ops: dict[Any, Counter] = {}
        self.fault: tuple[str, list] | None = None
        self.calls: list = []  # the equations whose sub-jaxpr is being walked

    def run(self, jaxpr: Any, colors: list[frozenset]) -> list[frozenset]:
        env: dict[Any, frozenset] = dict(zip(jaxpr.invars, colors))

        def read(v: Any) -> frozenset:
            return frozenset() if isinstance(v, jcore.Literal) else env.get(v, frozenset())

        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn: Any, ins: list[frozenset]) -> list[frozenset]:
        name = eqn.primitive.name
        touched = frozenset().union(*ins)
        n_out = len(eqn.outvars)
        if name == "cond":  # branches on an index: the same colors, through every branch
            if ins[0]:
                return self.refuse(f"a branch on the values ({name})", eqn, touched, n_out)
            outs = [frozenset()] * n_out
            self.calls.append(eqn)
            for branch in eqn.params["branches"]:
                got = self.run(branch.jaxpr, ins[1:])
                outs = [a | b for a, b in zip(outs, got)]
            self.calls.pop()
            return outs
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if len(subs) == 1 and len(subs[0].invars) == len(ins) and name not in (
                "while", "scan"):  # jit, custom_jvp_call, custom_vjp_call, remat...
            self.calls.append(eqn)
            try:
                return self.run(subs[0], ins)
            finally:
                self.calls.pop()
        if not touched:
            if name in _POSITIONAL and any(getattr(v.aval, "shape", ()) for v in eqn.outvars):
                return self.refuse(f"values by position ({name})", eqn, touched, n_out)
            return [frozenset()] * n_out  # scalars, schedules, constants: anything goes
        if subs or name not in ELEMENTWISE:
            return self.refuse(name, eqn, touched, n_out)
        if name not in _SHAPING:
            for c in touched:
                self.ops.setdefault(c, Counter())[name] += 1
        return [touched] * n_out

    def refuse(self, what: str, eqn: Any, touched: frozenset, n_out: int) -> list[frozenset]:
        if self.fault is None:
            self.fault = (what, [*self.calls, eqn])
        return [touched] * n_out


def _where(eqns: list) -> str:
    """The optax transformation (and line) that made the last of ``eqns`` (it, then the
    calls it sits in, innermost first), from their tracebacks."""
    try:
        from jax._src import source_info_util

        frames = [f for eqn in reversed(eqns)
                  for f in source_info_util.user_frames(eqn.source_info.traceback)]
    except Exception:  # noqa: BLE001 - a private API: only the message loses its place
        return "the inner transformation"
    for f in frames:  # the innermost optax factory: clip_by_global_norm.<locals>.update_fn
        outer = f.function_name.split(".<locals>")[0]
        if "<locals>" in f.function_name and outer not in (
                "chain", "named_chain", "with_extra_args_support", "_trace", "prove"):
            return f"{outer} ({f.file_name.rsplit('/', 1)[-1]}:{f.start_line})"
    return "the inner transformation"


def _trace(optimizer: optax.GradientTransformation, tree: Any) -> tuple[_Walk, list, list]:
    """Walk ``optimizer.update(tree, init(tree), tree)`` traced abstractly; (the walk,
    the gradient colors, the parameter colors)."""
    state = jax.eval_shape(optimizer.init, tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    s_leaves, s_def = jax.tree_util.tree_flatten(state)

    def fn(g: list, s: list, p: list) -> Any:
        return optimizer.update(jax.tree_util.tree_unflatten(treedef, g),
                                jax.tree_util.tree_unflatten(s_def, s),
                                jax.tree_util.tree_unflatten(treedef, p))

    closed = jax.make_jaxpr(fn)(leaves, s_leaves, leaves)
    g = [frozenset({("g", i)}) for i in range(len(leaves))]
    p = [frozenset({("p", i)}) for i in range(len(leaves))]
    s = [frozenset({("s", i)}) if jnp.ndim(x) else frozenset() for i, x in enumerate(s_leaves)]
    walk = _Walk()
    walk.run(closed.jaxpr, g + s + p)
    return walk, g, p


def prove(optimizer: optax.GradientTransformation, params: Any,
          groups: list[tuple[Any, list[int], int]]) -> None:
    """Raise ``UnsupportedError`` unless ``optimizer`` computes on a flat slice what it
    computes on ``params`` (module docstring). ``groups``: per dtype, (dtype, the leaf
    indices of ``params`` in it, the slice length)."""
    names = [jax.tree_util.keystr(p) or "<root>"
             for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    shaped = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                                   jnp.result_type(x)), params)
    seen = _Sharded(None, "", True, [])
    token = _CONTEXT.set(seen)
    try:
        whole, g, p = _trace(optimizer, shaped)
        _refuse_fault(whole)
        if seen.clips and len(groups) > 1:
            raise UnsupportedError(
                "ShardedOptimizer: ronde.jax.clip_by_global_norm with parameters of "
                f"{len(groups)} dtypes ({', '.join(str(jnp.dtype(d)) for d, _, _ in groups)}): "
                "each dtype steps on its own, so the norm would be each dtype's; cast the "
                "parameters to one dtype, or use DistributedOptimizer")
        for dtype, ids, per in groups:
            try:
                flat, fg, fp = _trace(optimizer, jax.ShapeDtypeStruct((per,), dtype))
            except Exception as exc:  # noqa: BLE001 - named in the refusal
                raise UnsupportedError(
                    "ShardedOptimizer: the inner transformation works on your parameter "
                    "tree but not on a flat vector of one dtype (what each rank steps on): "
                    f"{type(exc).__name__}: {exc}. A mask or labels given as a tree "
                    "(optax.masked, adamw(mask=...), multi_transform) cannot apply to "
                    "slices that mix parameters; " + _MASK_FIX) from exc
            _refuse_fault(flat)
            want = (flat.ops.get(("g", 0), Counter()), flat.ops.get(("p", 0), Counter()))
            for i in ids:
                got = (whole.ops.get(("g", i), Counter()), whole.ops.get(("p", i), Counter()))
                if got != want:
                    raise UnsupportedError(
                        f"ShardedOptimizer: the inner transformation treats parameter "
                        f"{names[i]} (shape {tuple(jnp.shape(jax.tree_util.tree_leaves(params)[i]))}) "
                        "otherwise than a flat vector of its elements (what each rank steps "
                        f"on): {_diff(got, want)}. A mask (optax.masked, adamw(mask=...)), "
                        "labels (multi_transform) or a choice by a parameter's shape or name "
                        "would see a 1-D slice mixing parameters; " + _MASK_FIX)
    finally:
        _CONTEXT.reset(token)


_MASK_FIX = ("put the choice outside the ShardedOptimizer, one per kind of parameter: "
             "optax.multi_transform({'decay': hvd.ShardedOptimizer(optax.adamw(lr, "
             "weight_decay=wd), name='decay'), 'plain': hvd.ShardedOptimizer(optax.adam(lr), "
             "name='plain')}, labels) with labels computed on your parameters "
             "(jax.tree.map(lambda x: 'decay' if x.ndim > 1 else 'plain', params)); or use "
             "DistributedOptimizer; or pass elementwise=True if every parameter is treated "
             "alike")


def _diff(got: tuple, want: tuple) -> str:
    parts = []
    for what, a, b in (("its gradient", got[0], want[0]), ("its value", got[1], want[1])):
        more, fewer = a - b, b - a
        if more or fewer:
            parts.append(f"{what} goes through "
                         + ", ".join([f"{k} x{v} more" for k, v in sorted(more.items())]
                                     + [f"{k} x{v} fewer" for k, v in sorted(fewer.items())]))
    return "; ".join(parts) or "other operations"


def _refuse_fault(walk: _Walk) -> None:
    if walk.fault is None:
        return
    what, eqns = walk.fault
    where = _where(eqns)
    fix = ("use ronde.jax.clip_by_global_norm(max_norm) in its place (the norm over every "
           "rank's slice: one allreduce of a number a step)"
           if "clip_by_global_norm" in where else
           "use DistributedOptimizer for it, or pass elementwise=True if you know the result "
           "does not depend on how the parameters are split")
    raise UnsupportedError(
        f"ShardedOptimizer: the inner transformation is not elementwise: {where} computes "
        f"{what} over the gradients, parameters or state, and each rank holds a slice of "
        f"them, so it would compute it on the slice; {fix}")
