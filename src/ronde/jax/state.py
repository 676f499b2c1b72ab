"""Broadcasting parameters and optimizer state (pytrees) from one rank.

JAX arrays are immutable, so unlike ``ronde.torch`` these functions *return* the
root's pytree instead of overwriting in place::

    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = hvd.broadcast_optimizer_state(opt_state, root_rank=0)

Every rank must pass a pytree of the same structure, shapes and dtypes (its values
are ignored off the root), except for what holds one rank's own part: in a
``ShardedOptimizer``'s state (a ``ShardedState`` anywhere in the tree), each rank's
slices of the inner state and its accumulated gradients are kept, and only the
replicated scalars (step counts, the window's passes) come from the root. Before any data moves the ranks compare their leaf
tables (one ``allgather_object``) so that a differing model fails at once on every
rank with a ``TensorMismatchError`` naming the leaves that differ. Leaf ``p`` (a
``jax.tree_util.keystr`` path) is broadcast as ``<prefix>.<p>``; all leaves are
submitted before any is awaited. These run eagerly (not inside ``jit``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _api
from ..frameworks.naming import require_same_parameters
from ..process_sets import ProcessSet, global_process_set
from ._arrays import any_traced, to_device, to_host

logger = logging.getLogger(__name__)


def leaf_table(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Leaf names (key paths), leaves and treedef of a pytree."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [jax.tree_util.keystr(path) or "<root>" for path, _ in with_path]
    return names, [leaf for _, leaf in with_path], treedef


def check_same_tree(names: list[str], leaves: list[Any], what: str, name: str,
                    process_set: ProcessSet) -> None:
    """Raise ``TensorMismatchError`` on every rank if the ranks' leaf tables differ.

    Args:
        names: leaf names (key paths).
        leaves: the leaves (anything with ``dtype`` and ``shape``, or array-likes).
        what: the caller, for the message.
        name: the name of the ``allgather_object`` collective.
        process_set: the ranks that compare.
    """
    require_same_parameters(
        ((n, np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype, np.shape(x))
         for n, x in zip(names, leaves)), name, process_set,
        f"{what}: the pytrees differ across ranks",
        "every rank must pass a pytree of the same structure, shapes and dtypes")


class ShardedState(NamedTuple):
    """The state of :func:`ShardedOptimizer`: one inner state per dtype of the
    parameters, over this rank's slice of them; the gradients accumulated in the
    current window (``()`` without accumulation) and the passes in it."""

    inner: tuple
    acc: Any = ()
    passes: Any = 0


def rank_local_leaves(tree: Any) -> list[bool]:
    """Per leaf of ``tree`` (``jax.tree_util.tree_leaves`` order), whether it holds this
    rank's own part of a ``ShardedState`` in it: the inner states' slices (every leaf
    that is not a scalar) and the accumulated gradients. A broadcast leaves them alone;
    the scalars (step counts, the window's passes) are the same on every rank."""
    def mark(x: Any) -> Any:
        if not isinstance(x, ShardedState):
            return jax.tree_util.tree_map(lambda _: False, x)
        return ShardedState(jax.tree_util.tree_map(lambda a: bool(jnp.ndim(a)), x.inner),
                            jax.tree_util.tree_map(lambda _: True, x.acc),
                            jax.tree_util.tree_map(lambda _: False, x.passes))

    marks = jax.tree_util.tree_map(mark, tree, is_leaf=lambda x: isinstance(x, ShardedState))
    return jax.tree_util.tree_leaves(marks)


def broadcast_tree(tree: Any, root_rank: int = 0, prefix: str = "broadcast_tree",
                   process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s pytree on every rank (see the module doc)."""
    names, leaves, treedef = leaf_table(tree)
    if any_traced(leaves):
        raise TypeError(f"{prefix}: cannot run inside jax.jit; call it eagerly (usually once, "
                        "before training), or use ronde.jax.broadcast inside jit")
    check_same_tree(names, leaves, prefix, f"{prefix}.structure", process_set)
    local = rank_local_leaves(tree)
    sent = [i for i, own in enumerate(local) if not own]
    handles = [_api.broadcast_async(to_host(leaves[i], f"{prefix} {names[i]}"), root_rank,
                                    f"{prefix}.{names[i]}", process_set) for i in sent]
    out = list(leaves)
    for i, h in zip(sent, handles):
        x = leaves[i]
        out[i] = to_device(np.asarray(h.wait()), x if isinstance(x, jax.Array) else None)
    return jax.tree_util.tree_unflatten(treedef, out)


def broadcast_parameters(params: Any, root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> Any:
    """Return the root's parameters (a pytree of arrays) on every rank.

    Args:
        params: the parameter pytree (same structure, shapes and dtypes everywhere).
        root_rank: the rank whose values everyone gets.
        process_set: the ranks taking part (default: all).

    Returns:
        A pytree of new ``jax.Array`` leaves holding the root's values.

    Raises:
        TensorMismatchError: the ranks' pytrees differ (on every rank).
    """
    return broadcast_tree(params, root_rank, "broadcast_parameters", process_set)


def broadcast_optimizer_state(opt_state: Any, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> Any:
    """Return the root's optax state (any pytree of arrays) on every rank; a
    ``ShardedOptimizer``'s slices stay each rank's own (the module doc)."""
    return broadcast_tree(opt_state, root_rank, "broadcast_optimizer_state", process_set)


def broadcast_variables(variables: Any, root_rank: int = 0,
                        process_set: ProcessSet = global_process_set) -> Any:
    """Alias of :func:`broadcast_parameters` (Horovod's TensorFlow spelling)."""
    return broadcast_tree(variables, root_rank, "broadcast_variables", process_set)


def save_checkpoint(tree: Any, path: str | os.PathLike[str], root_rank: int = 0) -> bool:
    """Save a pytree (parameters, an optax state, a step count...) on ``root_rank``,
    atomically (see ronde/checkpoint.py), as a pickle of its leaves fetched to numpy
    (``jax.device_get``). No collective. Returns True where it wrote.

    The file is a pickle: reading it back (``pickle.load``) runs whatever code the file
    names, so read only a file this job wrote, from a folder no other user can write
    (the file's mode follows the umask, as ``open()``'s would). Then
    ``jax.numpy.asarray`` or :func:`broadcast_parameters` puts the leaves on the
    devices. For a checkpoint read with no pickle, keep the state in arrays:
    :func:`ronde.jax.save_sharded` writes numpy files read with
    ``allow_pickle=False``, at any world size."""
    import pickle

    from ..checkpoint import atomic_save, on_root

    if not on_root(root_rank):
        return False
    host = jax.device_get(tree)
    atomic_save(path, lambda fh: pickle.dump(host, fh, protocol=pickle.HIGHEST_PROTOCOL))
    return True
