"""Checkpoints of ``ronde.jax.ShardedOptimizer`` state that load at any world size, with
no conversion: the files of :mod:`ronde.frameworks.sharded_files`, pieces keyed by the
parameters' leaf paths.

``save_sharded(dir, params, opt_state)`` (every rank calls it) writes this rank's pieces
of the inner state (a range [a, b) of one parameter leaf's flat elements, with each slot
of the inner transformation over it: ``[0].mu``, ``[0].nu``...), rank 0
``params.<id>.npz`` (the parameters, by leaf path) and ``meta.json`` last, with the
scalars (``[0].count``): one step, whole or not at all (``<id>`` new at every save).
``load_sharded(dir, params, opt_state)`` returns ``(params, opt_state)`` read back into
the structures given (a fresh ``tx.init(params)``): for a ``ShardedState`` this rank's
slices at the current size, for a plain optax state the whole state (the export); a plain
state's save loads into a sharded one too. Accumulated gradients of an unfinished window
are not saved (save at a step's end).

``gather_sharded(params, opt_state, optimizer, root=0)`` is the export in a running job:
the whole state of the inner transformation ``optimizer`` (the one given to
``ShardedOptimizer``) on rank ``root``, shaped as ``optimizer.init(params)`` would make
it, None on the other ranks; nothing is held twice
(:func:`ronde.frameworks.sharded_files.gather`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import RondeError
from ..frameworks import sharded_files
from ..process_sets import ProcessSet, global_process_set, shard_position
from .sharded import ShardedState, layout_of

FORMAT = "ronde.jax.sharded/2"
#: the parameters' file of a step (``{id}``: the step's id); ``params.npz`` in format 1
PARAMS = "params.{id}.npz"


def _paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(p) for p, _ in with_path], [x for _, x in with_path], treedef


def _layout(params: Any, opt_state: Any, process_set: ProcessSet,
            rank_size: tuple[int, int] | None = None) -> tuple[
        list[tuple[str, int, int, dict[str, tuple[int, int, int]]]], dict[str, Any], int, int]:
    """This rank's pieces (or those of ``rank_size``'s rank at that size): (param path, a,
    b, {slot: (state leaf index, offset, -)}), the state's scalars by path, and (rank,
    size) of the layout."""
    names, leaves, _ = _paths(params)
    s_paths, s_leaves, _ = _paths(opt_state)
    scalars: dict[str, Any] = {}
    pieces: list[tuple[str, int, int, dict[str, tuple[int, int, int]]]] = []
    if isinstance(opt_state, ShardedState):
        rank, size = rank_size or shard_position(process_set)
        layout = layout_of(names, leaves, rank, size, process_set)
        slots = []
        for k in range(len(layout.spans)):
            prefix = f".inner[{k}]"
            slots.append({p[len(prefix):]: j for j, p in enumerate(s_paths)
                          if p.startswith(prefix) and np.ndim(s_leaves[j]) == 1})
            for j, p in enumerate(s_paths):
                if p.startswith(prefix) and np.ndim(s_leaves[j]) == 0:
                    scalars.setdefault(p[len(prefix):], s_leaves[j])
        for pc in layout.pieces_of(rank):
            pieces.append((pc.name, pc.a, pc.b,
                           {sp: (j, pc.at, 0) for sp, j in slots[pc.span].items()}))
        return pieces, scalars, rank, size
    by_name = {n: i for i, n in enumerate(names)}
    slots_of: dict[str, dict[str, tuple[int, int, int]]] = {n: {} for n in names}
    for j, p in enumerate(s_paths):
        match = [n for n in names if p.endswith(n) and
                 np.shape(s_leaves[j]) == np.shape(leaves[by_name[n]])]
        if match:
            n = max(match, key=len)
            slots_of[n][p[:len(p) - len(n)]] = (j, 0, 0)
        elif np.ndim(s_leaves[j]) == 0:
            scalars.setdefault(p, s_leaves[j])
    for n, i in by_name.items():
        pieces.append((n, 0, int(np.size(leaves[i])), slots_of[n]))
    return pieces, scalars, 0, 1


def save_sharded(directory: str | os.PathLike[str], params: Any, opt_state: Any,
                 process_set: ProcessSet = global_process_set) -> None:
    """Write this rank's part of ``opt_state`` (a ``ShardedState``, or a plain optax
    state) and, on rank 0, ``params`` to ``directory``. Every rank must call it."""
    pieces, scalars, rank, size = _layout(params, opt_state, process_set)
    s_leaves = _paths(opt_state)[1]
    arrays = [(n, a, b, {sp: np.asarray(s_leaves[j]).reshape(-1)[at:at + b - a]
                         for sp, (j, at, _) in slots.items()}) for n, a, b, slots in pieces]
    names, leaves, _ = _paths(params)

    def write_params(fh: Any) -> None:
        np.savez(fh, **{f"p{i}": np.asarray(x) for i, x in enumerate(leaves)})

    sharded_files.save(directory, arrays,
                       {"scalars": {p: np.asarray(v).item() for p, v in scalars.items()},
                        "params": names},
                       FORMAT, rank, size, process_set, (PARAMS, {"write": write_params}))


def load_sharded(directory: str | os.PathLike[str], params: Any, opt_state: Any,
                 process_set: ProcessSet = global_process_set) -> tuple[Any, Any]:
    """``(params, opt_state)`` from a folder :func:`save_sharded` wrote, at any world
    size: ``params`` and ``opt_state`` give the structures (``tx.init(params)``)."""
    directory, meta = sharded_files.read_meta(directory, FORMAT, "params.npz")
    names, leaves, treedef = _paths(params)
    if meta["params"] != names:
        raise RondeError(f"{directory}: saved for parameters {meta['params']}, these are "
                         f"{names}")
    with sharded_files.open_model(directory, meta) as fh, \
            np.load(fh, allow_pickle=False) as saved:
        new_params = jax.tree_util.tree_unflatten(
            treedef, [jnp.asarray(saved[f"p{i}"], dtype=jnp.result_type(x))
                      for i, x in enumerate(leaves)])
    pieces, scalars, _, _ = _layout(params, opt_state, process_set)
    got = sharded_files.load(directory, meta, [(n, a, b) for n, a, b, _ in pieces])
    s_paths, s_leaves, s_def = _paths(opt_state)
    values = [np.array(x) for x in s_leaves]
    for (n, a, b, slots), arrays in zip(pieces, got):
        for sp, (j, at, _) in slots.items():
            if not arrays:
                continue
            if sp not in arrays:
                raise RondeError(f"{directory}: slot {sp!r} of {n!r} was not saved (saved: "
                                 f"{sorted(arrays)}); another transformation?")
            values[j].reshape(-1)[at:at + b - a] = arrays[sp]
    saved_scalars = meta["scalars"]
    prefix_of = {}
    if isinstance(opt_state, ShardedState):
        for j, p in enumerate(s_paths):
            if p.startswith(".inner[") and np.ndim(values[j]) == 0:
                prefix_of[j] = p[p.index("]") + 1:]
    else:
        prefix_of = {j: p for j, p in enumerate(s_paths) if np.ndim(values[j]) == 0
                     and p in scalars}
    for j, p in prefix_of.items():
        if p in saved_scalars:
            values[j] = np.asarray(saved_scalars[p], dtype=values[j].dtype)
    out = [jnp.asarray(v, dtype=jnp.result_type(x)) for v, x in zip(values, s_leaves)]
    return new_params, jax.tree_util.tree_unflatten(s_def, out)


def gather_sharded(params: Any, opt_state: Any, optimizer: Any, root: int = 0,
                   process_set: ProcessSet = global_process_set) -> Any:
    """The whole state of a ``ShardedOptimizer``, in a running job, as the plain inner
    transformation ``optimizer`` keeps it (``optimizer.init(params)``'s structure, every
    slot over whole parameters, the step count), on rank ``root`` of ``process_set``;
    None on the others. Every member calls it. Continue in one process with
    ``optimizer.update(grads, state, params)``, or save it as any optax state.

    Each rank sends only its own slices, each slot of each parameter in one alltoall
    that only ``root`` receives; no rank allocates the whole state but ``root``, once.
    Accumulated gradients of an unfinished ``backward_passes_per_step`` window are not
    part of it (gather at a step's end).
    """
    if not isinstance(opt_state, ShardedState):
        raise TypeError("gather_sharded() takes a ShardedOptimizer's state (a ShardedState); "
                        "a plain optax state is whole on every rank already")
    pieces, scalars, _, _ = _layout(params, opt_state, process_set)
    s_leaves = _paths(opt_state)[1]
    mine = [(n, a, b, {sp: np.asarray(s_leaves[j]).reshape(-1)[at:at + b - a]
                       for sp, (j, at, _) in slots.items()}) for n, a, b, slots in pieces]
    names, leaves, _ = _paths(params)
    lengths = {n: int(np.size(x)) for n, x in zip(names, leaves)}
    got = sharded_files.gather(mine, lengths, root, "ronde.jax.gather_sharded", process_set)
    if got is None:
        return None
    like = jax.eval_shape(optimizer.init, params)
    targets, _, _, _ = _layout(params, like, process_set)
    l_paths, l_leaves, l_def = _paths(like)
    values: list[Any] = [None] * len(l_leaves)
    for n, _, _, slots in targets:
        for sp, (j, _, _) in slots.items():
            if sp in got.get(n, {}):
                values[j] = got[n][sp].reshape(l_leaves[j].shape)
    for j, p in enumerate(l_paths):
        if values[j] is None and p in scalars:  # the count, as the slices' paths name it
            values[j] = np.asarray(scalars[p])
        if values[j] is None:
            raise RondeError(f"gather_sharded: {p} of {optimizer!r}'s state is not in the "
                             "sharded state (another transformation than the one wrapped?)")
    return jax.tree_util.tree_unflatten(
        l_def, [jnp.asarray(v, dtype=x.dtype) for v, x in zip(values, l_leaves)])
