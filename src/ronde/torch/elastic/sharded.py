"""A ``ShardedOptimizer`` inside ``TorchState``: resharded in memory at every resize, a lost
rank's slice rebuilt from its neighbour's copy; nothing read from disk.

At each ``commit()`` every rank snapshots its own pieces' state (the slices of Adam's
moments it owns, the step counts, the param groups' hyperparameters) and sends a copy to
rank ``r - 1``, which keeps it beside its own: each rank holds its slice and rank
``(r + 1) mod N``'s, one extra slice of memory, one point-to-point transfer of a slice
per commit (an ``alltoall`` where each rank sends one block).

After the job re-forms (a rank lost or removed, hosts added), ``sync()`` (every rank,
the new ones included) rebuilds the state at the new size:

1. every rank tells which commit-time rank it was (new workers: none);
2. for each commit-time rank ``q`` the *holder* of its slice is the survivor that was
   ``q`` (its own snapshot) or else the one that was ``q - 1`` (the neighbour copy); when
   both are gone, every rank raises ``RondeError`` naming them (load a
   ``save_sharded`` checkpoint instead);
3. the optimizer lays its shards out for the new rank and size (``relayout``);
4. one ``alltoall``: each holder sends every new rank the parts of the slices it holds
   that fall in that rank's new pieces (``torch.save`` of tensors, read back with
   ``weights_only=True``);
5. each rank puts what it received into its new pieces' state, checks that every element
   arrived, takes rank 0's hyperparameters, and commits again (a new snapshot and
   neighbour copy for the new layout).

A survivor's snapshot is the last commit: after a failure every survivor ``restore()``\\ s
to it, after a host change (``HostsUpdatedInterrupt`` at a commit) the state is that
commit. The result is the state a single job at the new size would hold after that
commit: the same values, split differently.
"""

from __future__ import annotations

from typing import Any

from ... import _api, _objects
from ..._errors import UnsupportedError
from ...frameworks import reshard
from ...process_sets import global_process_set
from ..sharded_io import TORCH, hyperparameters, snapshot
from .handler import StateHandler


class ShardedOptimizerHandler(StateHandler):
    """Saves, restores and reshards a ``ShardedOptimizer`` (module docstring)."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        if value.shard_layout.process_set is not global_process_set:
            raise UnsupportedError("ShardedOptimizer in an elastic TorchState must shard over "
                                   "the whole job (process_set=global_process_set): a process "
                                   "set's ranks change at a resize")
        self._own: list[reshard.Piece] = []
        self._hyper: list[dict[str, Any]] = []
        self._neighbour: list[reshard.Piece] = []
        self._rank = -1  # the rank at the last commit (-1: never committed in this job)
        self._size = 0
        self._snap()
        self._resized = False

    @property
    def sync_after_reset(self) -> bool:
        """After a reset the shards must be rebuilt even when nothing else syncs."""
        return True

    def _snap(self) -> None:
        self._own = snapshot(self.value, self.value.shard_layout.shard_pieces())
        self._hyper = hyperparameters(self.value)

    def save(self) -> None:
        """Snapshot this rank's pieces and swap copies with the neighbours (a collective:
        ``commit()`` is one)."""
        self._snap()
        self._rank, self._size = _api.rank(), _api.size()
        self._neighbour = reshard.swap_with_neighbour(self._own, TORCH,
                                                      "ronde.elastic.sharded.neighbour")

    def set_value(self, value: Any) -> None:
        self.value = value
        self._snap()  # no collective here: only commit() swaps copies

    def restore(self) -> None:
        """Back to this rank's last snapshot (the layout it was taken in is still the
        optimizer's: a reset has not happened yet)."""
        opt = self.value
        saved = {(n, a, b): st for n, a, b, st in self._own}
        for name, a, b, tensor, _ in opt.shard_layout.shard_pieces():
            st = saved.get((name, a, b))
            opt.state.pop(tensor, None)
            if st:
                opt.state[tensor] = {k: TORCH.copy(v) for k, v in st.items()}
        for group, hyper in zip(opt.param_groups, self._hyper):
            group.update(hyper)

    def reset(self) -> None:
        self._resized = True

    def sync(self) -> None:
        """Rebuild the state for the job as it is now (module docstring, steps 1-5)."""
        opt = self.value
        was, old_size, resized = reshard.committed_ranks(self._rank, self._size,
                                                         self._resized)
        if not old_size and not resized:
            # the job's first sync (nobody committed yet, the layout is current): keep
            # each rank's state, take rank 0's hyperparameters
            self._sync_hyper(_api.rank())
            return
        opt.relayout()
        merged = reshard.reshard(self._own, self._neighbour, was, old_size, opt.shard_layout.ranges_of,
                                 TORCH)
        for name, a, b, tensor, _ in opt.shard_layout.shard_pieces():
            if name in merged:
                opt.state[tensor] = merged[name]
        self._sync_hyper(_api.rank())
        self._resized = False
        self.save()

    def _sync_hyper(self, rank: int) -> None:
        """Rank 0's param groups' hyperparameters (lr, betas...) on every rank."""
        opt = self.value
        hyper = _objects.broadcast_object(hyperparameters(opt) if rank == 0 else None, 0,
                                          "ronde.elastic.sharded.hyper")
        for group, h in zip(opt.param_groups, hyper):
            group.update(h)
