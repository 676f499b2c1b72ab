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
        self._save_model()
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        opt = self.optimizer
        if opt is not None and hasattr(opt, "built") and not opt.built:
            opt.build(self.model.trainable_variables)  # slots exist on every rank alike
        return list(self.model.variables) + _optimizer_variables(opt)

    def _save_model(self) -> None:
        self._saved_values = [np.array(to_numpy(v)) for v in self._variables()]

    def _load_model(self) -> None:
        for v, value in zip(self._variables(), self._saved_values):
            v.assign(value)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        from . import broadcast_variables
        from .sharded import check_same_layout, is_sharded

        variables = self._variables()
        if is_sharded(self.optimizer):
            # each rank's slice of the state is its own: only the model and the step
            # count come from rank 0 (and a resize is refused, naming the fix)
            check_same_layout(self.optimizer)
            variables = list(self.model.variables) + [self.optimizer.iterations]
        broadcast_variables(variables, root_rank=0)
        self._save_model()
        super().sync()


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
