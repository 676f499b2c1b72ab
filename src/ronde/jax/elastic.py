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
        self._trees = [k for k, v in kwargs.items() if _is_tree_of_arrays(v)]
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
            self._saved_state[k] = broadcast_tree(self._saved_state[k], 0,
                                                  f"ronde.elastic.{k}")
        plain = {k: v for k, v in self._saved_state.items() if k not in self._trees}
        if plain:
            plain = self._bcast_object(plain)
        self._saved_state.update(plain)
        self.restore()


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "JaxState",
           "ObjectState", "State", "run", "run_fn"]
