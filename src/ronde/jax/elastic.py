"""Elastic training with JAX: ``hvd.elastic.run`` and ``JaxState`` for pytrees.

Horovod has no JAX binding; this follows its elastic API. Parameters, optimizer state
(optax) and any other pytree given to :class:`JaxState` are kept across resets: JAX
arrays are immutable, so saving keeps references (no copy) and ``sync()`` broadcasts
each pytree from rank 0 and rebinds the attribute::

    state = hvd.elastic.JaxState(params=params, opt_state=opt_state, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.batch in range(state.batch, steps):
            grads = hvd.allreduce_gradients(grad_fn(state.params, batch))
            updates, state.opt_state = tx.update(grads, state.opt_state, state.params)
            state.params = optax.apply_updates(state.params, updates)
            if state.batch % 10 == 0:
                state.commit()
"""

from __future__ import annotations

from typing import Any

import jax

from ..elastic import (HorovodInternalError, HostsUpdatedInterrupt, HostUpdateResult,
                       ObjectState, State, run, run_fn)


def _is_tree_of_arrays(value: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, jax.Array) for leaf in leaves)


class JaxState(ObjectState):
    """Pytrees of arrays (broadcast leaf by leaf when syncing) and plain objects."""

    def __init__(self, **kwargs: Any) -> None:
        from .. import _state

        self._trees = [k for k, v in kwargs.items() if _is_tree_of_arrays(v)]
        self._generation = _state.require().generation
        super().__init__(**kwargs)

    def save(self) -> None:
        # arrays are immutable: the state holds references, only the containers copy
        self._saved_state = {k: (getattr(self, k) if k in self._trees
                                 else _copy(getattr(self, k))) for k in self._saved_state}

    def restore(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, v if k in self._trees else _copy(v))

    def sync(self) -> None:
        from .state import broadcast_tree

        for k in self._trees:
            self._saved_state[k] = _broadcast_but_shards(self._saved_state[k], k,
                                                         self._generation)
        plain = {k: v for k, v in self._saved_state.items() if k not in self._trees}
        if plain:
            plain = self._bcast_object(plain)
        self._saved_state.update(plain)
        self.restore()


def _broadcast_but_shards(tree: Any, key: str, generation: int) -> Any:
    """Rank 0's ``tree``, except the ``ShardedState`` parts in it: each rank's slice of an
    optimizer state is its own (rank 0's would replace it). After a reset (another
    generation than the state's) a ``ShardedState`` is refused: its slices follow no
    resize yet."""
    from .. import _state
    from .._errors import UnsupportedError
    from .sharded import ShardedState
    from .state import broadcast_tree

    def is_shards(x: Any) -> bool:
        return isinstance(x, ShardedState)

    parts, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_shards)
    if any(is_shards(x) for x in parts) and _state.require().generation != generation:
        raise UnsupportedError(
            f"JaxState: {key!r} holds a ShardedOptimizer state, and the job was re-formed "
            "(an elastic reset): JAX's shards follow no resize yet; save_sharded() before "
            "and load_sharded() after, or use DistributedOptimizer (ronde.torch's "
            "ShardedOptimizer reshards in memory)")
    plain = [x for x in parts if not is_shards(x)]
    synced = iter(broadcast_tree(plain, 0, f"ronde.elastic.{key}") if plain else [])
    return jax.tree_util.tree_unflatten(
        treedef, [x if is_shards(x) else next(synced) for x in parts])


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "JaxState",
           "ObjectState", "State", "run", "run_fn"]
