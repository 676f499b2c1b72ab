"""Elastic training with Keras: ``KerasState`` and the state callbacks.

Horovod's ``horovod.keras.elastic`` / ``horovod.tensorflow.keras.elastic`` API, on every
Keras 3 backend and on Keras 2 (``tf_keras``, :mod:`._choice`); the values move as numpy
arrays through ronde's collectives. The reset loop and host notices are ronde's shared
ones (:mod:`ronde.elastic`)::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, epochs=epochs - state.epoch, callbacks=callbacks)

Fixed here (horovod#2844): Keras calls ``on_epoch_end`` in the order the callbacks are
listed, and Horovod's examples list ``CommitStateCallback`` first, so its commit saved
the epoch (and batch) before ``UpdateEpochStateCallback`` advanced them; a reset at that
commit (hosts added) repeated the epoch. Here the commit applies the update callbacks of
its state first, whatever their order. ``state.batch`` counts the batches completed in
the epoch (Horovod stores the last batch's index, which repeats it after a reset).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..elastic import (HorovodInternalError, HostsUpdatedInterrupt, HostUpdateResult,
                       ObjectState, State, run, run_fn)
from ._bridge import to_numpy
from ._choice import keras_module

keras = keras_module()  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1 (TensorFlow's rule)


def _optimizer_variables(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    found = optimizer.variables
    return list(found() if callable(found) else found)


class KerasState(ObjectState):
    """State of a Keras model and its optimizer (the model's compiled one by default);
    other keyword arguments are plain objects, exposed as attributes.

    Args:
        model: a built Keras model (``model.build(input_shape)`` or called once).
        optimizer: its optimizer, when not compiled into the model.
        backend: accepted for Horovod's TensorFlow 1 signature; unused.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        if hasattr(model, "built") and not model.built:
            raise ValueError("the model must be built first: run model.build(input_shape) "
                             "or call it on a batch")
        self.model = model
        self.optimizer = optimizer or getattr(model, "optimizer", None)
        self._epoch_hooks: list[Any] = []
        #: a ShardedOptimizer's last commit: this rank's pieces, rank r + 1's, (rank, size)
        self._shards: tuple[list[Any], list[Any], int, int] = ([], [], -1, 0)
        self._save_model()
        super().__init__(**kwargs)

    @property
    def sync_after_reset(self) -> bool:
        """A sharded optimizer is laid out again at every size (see :meth:`sync`)."""
        from .sharded import is_sharded

        return is_sharded(self.optimizer)

    def _variables(self) -> list[Any]:
        opt = self.optimizer
        if opt is not None and hasattr(opt, "built") and not opt.built:
            opt.build(self.model.trainable_variables)  # slots exist on every rank alike
        return list(self.model.variables) + _optimizer_variables(opt)

    def _save_model(self) -> None:
        # each value with its variable: a sync that a lost peer cut short may have laid a
        # ShardedOptimizer's shards out again (new variables, other shapes); a restore
        # then fills the variables saved (the next sync's reshard fills the new ones)
        self._saved_values = [(v, np.array(to_numpy(v))) for v in self._variables()]

    def _load_model(self) -> None:
        for v, value in self._saved_values:
            v.assign(value)

    def save(self) -> None:
        self._save_model()
        self._commit_shards()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        from . import broadcast_variables
        from .sharded import _step_count, check_same_layout, is_sharded

        variables = self._variables()
        relaid = False
        if is_sharded(self.optimizer):
            # each rank's slice of the state is its own: only the model and the step
            # counts come from rank 0; at another size or place the slices move (reshard)
            relaid = self._reshard()
            check_same_layout(self.optimizer)
            variables = list(self.model.variables) + [
                self.optimizer.iterations, _step_count(self.optimizer.inner_optimizer)]
        broadcast_variables(variables, root_rank=0)
        self._save_model()
        if relaid:
            self._commit_shards()  # the new layout's neighbour copies
        super().sync()

    def _commit_shards(self) -> None:
        """At a commit with a ``ShardedOptimizer`` (a collective): keep this rank's slices
        of the state and, from rank ``r + 1``, a copy of its (:mod:`ronde.frameworks.
        reshard`), so that a lost rank's slice survives in memory."""
        from .. import _api
        from ..frameworks import reshard
        from .sharded import is_sharded
        from .sharded_io import _pieces, slices

        if not is_sharded(self.optimizer) or not self._global_shards():
            return
        own = slices(_pieces(self.optimizer, None)[0])
        neighbour = reshard.swap_with_neighbour(own, reshard.NUMPY,
                                                "ronde.elastic.keras.neighbour")
        self._shards = (own, neighbour, _api.rank(), _api.size())

    def _global_shards(self) -> bool:
        from ..process_sets import global_process_set

        return self.optimizer.process_set is global_process_set

    def _reshard(self) -> bool:
        """Every rank alike, after a reset: keep the slices where every rank is what it
        was at the last commit; else lay the shards out for the job as it is now and fill
        them from their holders (the rank itself, or the copy on the rank before it).
        True, on every rank alike, when the slices moved (the new layout's copies are
        then swapped: a collective)."""
        from .. import _api, _state
        from ..frameworks import reshard
        from .sharded_io import _pieces, fill

        opt = self.optimizer
        if not self._global_shards():
            return False  # a process set's shards: check_same_layout names the way out
        own, neighbour, rank, size = self._shards
        now = (_api.rank(), _api.size())
        # (every rank says whether its layout is another place's: all decide alike)
        laid = opt.shard_layout
        was, old_size, moved = reshard.committed_ranks(rank, size,
                                                       (laid.rank, laid.size) != now)
        same = old_size == len(was) and all(r == j for j, (r, _) in enumerate(was))
        if (same or not old_size) and not moved:
            laid.generation = _state.require().generation
            return False
        opt.relayout()
        self.model.train_function = None  # it traced the old shards: fit traces anew
        if not old_size:
            return False  # nobody committed: fresh (zero) state, as at the start
        merged = reshard.reshard(own, neighbour, was, old_size,
                                 opt.shard_layout.ranges_of, reshard.NUMPY,
                                 "ronde.elastic.keras.reshard")
        mine = _pieces(opt, None)[0]
        fill(mine, [merged.get(key, {}) for key, _, _, _ in mine], "elastic reshard")
        return True


#: Horovod's TensorFlow spelling of the same state
TensorFlowKerasState = KerasState


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at each epoch's end,
    after the state's batch/epoch callbacks have recorded where training is."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            for hook in _hooks(self.state):
                hook.on_train_batch_end(batch, logs)
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        for hook in _hooks(self.state):
            hook.on_epoch_end(epoch, logs)
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` = the batches completed in this epoch (0 at its end)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        _hooks(state).append(self)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` = the epochs completed, across resets (Keras counts each
    ``fit`` from 0; the state counts from the start of training)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = getattr(state, "epoch", 0)
        _hooks(state).append(self)

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


def _hooks(state: State) -> list[Any]:
    hooks = state.__dict__.get("_epoch_hooks")
    if hooks is None:
        hooks = state.__dict__["_epoch_hooks"] = []
    return hooks


__all__ = ["CommitStateCallback", "HorovodInternalError", "HostUpdateResult",
           "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
           "TensorFlowKerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "run", "run_fn"]
