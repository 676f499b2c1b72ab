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
import jax.numpy as jnp
import numpy as np

from .._errors import UnsupportedError
from ..elastic import (HorovodInternalError, HostsUpdatedInterrupt, HostUpdateResult,
                       ObjectState, State, run, run_fn)
from ..process_sets import global_process_set


def _is_tree_of_arrays(value: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, jax.Array) for leaf in leaves)


class JaxState(ObjectState):
    """Pytrees of arrays (broadcast leaf by leaf when syncing) and plain objects.

    A ``ShardedOptimizer``'s state given as one of them (``opt_state=tx.init(params)``,
    with the parameters as another) is resharded in memory at every resize, each rank's
    slice from itself or from the copy its neighbour keeps (:mod:`ronde.frameworks.
    reshard`, as ``TorchState`` does for torch's).
    """

    def __init__(self, **kwargs: Any) -> None:
        from .. import _state

        from .sharded import ShardedState

        self._trees = [k for k, v in kwargs.items() if _is_tree_of_arrays(v)]
        for k, v in kwargs.items():
            if k not in self._trees and any(isinstance(x, ShardedState) for x in
                                            jax.tree_util.tree_leaves(
                                                v, is_leaf=lambda y: isinstance(
                                                    y, ShardedState))):
                raise UnsupportedError(
                    f"JaxState: {k!r} holds a ShardedOptimizer state beside objects that "
                    "are not arrays; give the state as an argument of its own "
                    "(JaxState(params=params, opt_state=opt_state, ...)): each rank's "
                    "slices are its own and must not be broadcast from rank 0")
        self._generation = _state.require().generation
        self._shards: dict[str, _Shards] = {}
        super().__init__(**kwargs)

    @property
    def sync_after_reset(self) -> bool:
        """A sharded optimizer state is laid out again at every size (see the class)."""
        from .sharded import ShardedState

        return any(isinstance(getattr(self, k, None), ShardedState) for k in self._trees)

    def save(self) -> None:
        # arrays are immutable: the state holds references, only the containers copy
        self._saved_state = {k: (getattr(self, k) if k in self._trees
                                 else _copy(getattr(self, k))) for k in self._saved_state}
        from .sharded import ShardedState

        for k in self._trees:  # commit() is a collective: the neighbours swap copies
            if isinstance(self._saved_state[k], ShardedState):
                self._shards[k] = _Shards.commit(self, k)

    def restore(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, v if k in self._trees else _copy(v))

    def sync(self) -> None:
        from .. import _state
        from .sharded import ShardedState

        from ..frameworks import reshard

        now = _state.require().generation
        relaid = False
        for k in self._trees:
            value = self._saved_state[k]
            if isinstance(value, ShardedState):
                # every rank alike (a joining worker too): who was which rank at the last
                # commit; the same ranks at the same size keep their slices
                shards = self._shards.get(k, _Shards.empty())
                was, old_size, _ = reshard.committed_ranks(shards.rank, shards.size)
                same = old_size == len(was) and all(r == j for j, (r, _) in enumerate(was))
                if old_size and not same:
                    self._saved_state[k] = shards.rebuild(self, k, was, old_size)
                    relaid = True
                elif not old_size and not _laid_out_for(value, self, k):
                    # nobody committed yet and this rank's slices are another size's:
                    # fresh ones (what a rank that joins starts from)
                    self._saved_state[k] = shards.rebuild(self, k, was, 0)
                    relaid = True
            else:
                self._saved_state[k] = _broadcast_but_shards(value, k, self._generation)
        if relaid:  # a jitted update would run a trace of another place's slices
            reshard.forget_traces()
        self._generation = now
        plain = {k: v for k, v in self._saved_state.items() if k not in self._trees}
        if plain:
            plain = self._bcast_object(plain)
        self._saved_state.update(plain)
        self.restore()


class _Shards:
    """One ``ShardedState``'s commit: this rank's pieces, the copy of rank ``r + 1``'s,
    the rank and size they were laid out at, and which tree holds the parameters."""

    def __init__(self, own: list[Any], neighbour: list[Any], rank: int, size: int,
                 params_key: str | None) -> None:
        self.own, self.neighbour = own, neighbour
        self.rank, self.size, self.params_key = rank, size, params_key

    @staticmethod
    def empty() -> "_Shards":
        return _Shards([], [], -1, 0, None)

    @staticmethod
    def commit(state: "JaxState", key: str, params_key: str | None = None) -> "_Shards":
        from ..frameworks import reshard
        from .. import _api
        from .sharded_io import _layout, _paths

        opt_state = state._saved_state[key]
        params_key = params_key or _params_for(state, key)
        pieces, scalars, _, _ = _layout(state._saved_state[params_key], opt_state,
                                        global_process_set)
        leaves = _paths(opt_state)[1]
        own = [(n, a, b, {**{sp: np.asarray(leaves[j]).reshape(-1)[at:at + b - a]
                             for sp, (j, at, _) in slots.items()},
                          **{f"scalar{p}": np.asarray(v) for p, v in scalars.items()}})
               for n, a, b, slots in pieces]
        neighbour = reshard.swap_with_neighbour(own, reshard.NUMPY,
                                                f"ronde.elastic.{key}.neighbour")
        return _Shards(own, neighbour, _api.rank(), _api.size(), params_key)

    def rebuild(self, state: "JaxState", key: str, was: list[tuple[int, int]],
                old_size: int) -> Any:
        """The ``ShardedState`` at the current size, from every holder (a collective
        when ``old_size``; else, nobody having committed, fresh slices, no collective)."""
        from ..frameworks import reshard
        from .. import _api
        from .sharded import slice_lengths
        from .sharded_io import _layout, _paths

        params_key = self.params_key or _params_for(state, key)
        params = state._saved_state[params_key]
        old = state._saved_state[key]
        # the template: the same structure, each slot of ceil(L / N) elements, zeros
        size = _api.size()
        pers = slice_lengths(params, size)
        s_paths, s_leaves, s_def = _paths(old)
        fresh = []
        for p, x in zip(s_paths, s_leaves):
            k = int(p[len(".inner["):p.index("]")]) if p.startswith(".inner[") else -1
            if k >= 0 and np.ndim(x) == 1:
                fresh.append(np.zeros(pers[k], dtype=np.asarray(x).dtype))
            elif p.startswith(".acc.slices["):  # stage 2's sums: a slice at the new size
                k = int(p[len(".acc.slices["):p.index("]")])
                fresh.append(np.zeros(pers[k], dtype=np.asarray(x).dtype))
            elif p.startswith(".acc"):
                fresh.append(np.zeros_like(np.asarray(x)))
            elif p == ".passes":
                fresh.append(np.zeros_like(np.asarray(x)))
            else:
                fresh.append(np.asarray(x))
        template = jax.tree_util.tree_unflatten(s_def, fresh)

        def ranges_of(t: int) -> dict[str, tuple[int, int]]:
            return {n: (a, b) for n, a, b, _ in
                    _layout(params, template, global_process_set, (t, size))[0]}

        merged = reshard.reshard(self.own, self.neighbour, was, old_size, ranges_of,
                                 reshard.NUMPY, f"ronde.elastic.{key}.reshard") \
            if old_size else {}
        pieces, _, _, _ = _layout(params, template, global_process_set)
        values = [np.array(x) for x in fresh]
        scalar_at = {p[p.index("]") + 1:]: j for j, p in enumerate(s_paths)
                     if p.startswith(".inner[") and np.ndim(values[j]) == 0}
        for n, a, b, slots in pieces:
            got = merged.get(n)
            if not got:
                continue
            for sp, (j, at, _) in slots.items():
                values[j].reshape(-1)[at:at + b - a] = got[sp]
            for name, v in got.items():
                if name.startswith("scalar") and name[len("scalar"):] in scalar_at:
                    j = scalar_at[name[len("scalar"):]]
                    values[j] = np.asarray(v, dtype=values[j].dtype)
        out = [jnp.asarray(v, dtype=jnp.result_type(x)) for v, x in zip(values, s_leaves)]
        new = jax.tree_util.tree_unflatten(s_def, out)
        state._saved_state[key] = new
        if old_size:  # the new layout's copies (every rank is here)
            state._shards[key] = _Shards.commit(state, key, params_key)
        return new


def _fits(lengths: list[int | None], params: Any, size: int) -> bool:
    """Whether a sharded state's slice lengths are those of ``params`` at ``size``."""
    from .sharded import slice_lengths

    try:
        wanted = slice_lengths(params, size)
    except UnsupportedError:  # not floating-point parameters
        return False
    return len(wanted) == len(lengths) and all(n is None or n == w
                                               for n, w in zip(lengths, wanted))


def _laid_out_for(value: Any, state: "JaxState", key: str) -> bool:
    """Whether a ``ShardedState``'s slices are the current job size's."""
    from .. import _api
    from .sharded import state_slice_lengths

    params = state._saved_state.get(_params_for(state, key, check=False) or "")
    return params is None or _fits(state_slice_lengths(value), params, _api.size())


def _params_for(state: "JaxState", key: str, check: bool = True) -> str | None:
    """The tree of ``state`` holding the parameters ``state.<key>`` (a ShardedState) was
    made for: dtype groups of the same number, each of a length that gives the
    state's slices at the job's size (a state being committed is laid out at it)."""
    from .. import _api
    from .sharded import ShardedState, state_slice_lengths

    lengths = state_slice_lengths(state._saved_state[key])
    for k in state._trees:
        tree = state._saved_state.get(k)
        if k != key and tree is not None and not isinstance(tree, ShardedState) \
                and _fits(lengths, tree, _api.size()):
            return k
    if not check:
        return None
    raise UnsupportedError(f"JaxState: {key!r} holds a ShardedOptimizer state, and no other "
                           "tree of the state holds the parameters it was made for: pass "
                           "them too (JaxState(params=params, opt_state=opt_state, ...)) so "
                           "that a resize can lay the slices out again")


def _broadcast_but_shards(tree: Any, key: str, generation: int) -> Any:
    """Rank 0's ``tree``, except each rank's slices of a ``ShardedState`` in it
    (``broadcast_tree`` keeps them). After a reset (another generation than the state's)
    a ``ShardedState`` is refused: its slices follow no resize yet."""
    from .. import _state
    from .._errors import UnsupportedError
    from .sharded import ShardedState
    from .state import broadcast_tree

    def is_shards(x: Any) -> bool:
        return isinstance(x, ShardedState)

    parts = jax.tree_util.tree_leaves(tree, is_leaf=is_shards)
    if any(is_shards(x) for x in parts) and _state.require().generation != generation:
        raise UnsupportedError(
            f"JaxState: {key!r} holds a ShardedOptimizer state, and the job was re-formed "
            "(an elastic reset): JAX's shards follow no resize yet; save_sharded() before "
            "and load_sharded() after, or use DistributedOptimizer (ronde.torch's "
            "ShardedOptimizer reshards in memory)")
    return broadcast_tree(tree, 0, f"ronde.elastic.{key}")


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "JaxState",
           "ObjectState", "State", "run", "run_fn"]
