"""Keras 3 callbacks for data-parallel training (Horovod's, on every Keras backend).

* :class:`BroadcastGlobalVariablesCallback`: every rank starts from the root's
  weights (at ``on_train_begin``) and optimizer state (after the first batch,
  once the optimizer has built its variables); what holds one rank's own part (a
  ``ShardedOptimizer``'s slices, gradient accumulators) is left alone.
* :class:`MetricAverageCallback`: epoch metrics averaged over the ranks; put it
  before callbacks that read metrics (checkpoints, ``ReduceLROnPlateau``).
* :class:`LearningRateScheduleCallback` / :class:`LearningRateWarmupCallback`:
  Horovod's schedule ``lr = initial_lr * multiplier(epoch)`` and its gradual
  warmup from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.
* :class:`BestModelCheckpoint`: ``keras.callbacks.ModelCheckpoint`` with
  ``save_best_only=True`` that writes on rank 0 only.

Each switches off ``jit_compile`` on the TensorFlow backend when the model uses a
``DistributedOptimizer`` (XLA cannot compile ronde's host call), with one log line.
On JAX, callbacks that assign variables during ``fit`` sync JAX's in-flight state
first, so their changes are not lost. They subclass the callbacks of the Keras that
``tf.keras`` is (:mod:`._choice`): Keras 3, or ``tf_keras`` under
``TF_USE_LEGACY_KERAS=1``; on Keras 2 optimizers whose momentum is a variable
(``tf_keras.optimizers.legacy``), the learning-rate callbacks apply Horovod's momentum
correction.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import numpy as np

from .. import _api
from ..process_sets import ProcessSet, global_process_set
from ._bridge import backend_name, mark_variables_changed, sync_jax_state, to_numpy
from ._choice import keras_module, uses_tf_keras
from .optimizer import is_distributed
from .saving import write_atomically
from .sharded import replicated

logger = logging.getLogger(__name__)
keras = keras_module()


def switch_off_xla(model: Any) -> None:
    """Turn off ``jit_compile`` of a TF-backend model whose optimizer is distributed."""
    if backend_name() != "tensorflow" or not is_distributed(getattr(model, "optimizer", None)):
        return
    if getattr(model, "jit_compile", False):
        logger.info("ronde: model.jit_compile switched off: XLA cannot compile ronde's host "
                    "allreduce on the TensorFlow backend (compile with jit_compile=False to "
                    "silence this)")
        model.jit_compile = False
        model.make_train_function(force=True)


def broadcast_model(model: Any, root_rank: int, optimizer: bool,
                    process_set: ProcessSet = global_process_set,
                    local_variables: Any = None) -> None:
    """Assign the root's model (and optimizer) variables on every rank (eager), except
    ``local_variables`` (which keep each rank's own values)."""
    sync_jax_state(model)
    keep = {id(v) for v in local_variables or ()}
    variables = [v for v in model.variables if id(v) not in keep]
    if optimizer and getattr(model, "optimizer", None) is not None:
        # Gradient accumulators hold this rank's partial window, a ShardedOptimizer's
        # shards and slots this rank's slice: never overwrite them.
        local = {id(v) for v in getattr(model.optimizer, "_accumulated_gradients", None) or ()}
        variables += [v for v in replicated(optimizer_variables(model.optimizer))
                      if id(v) not in local and id(v) not in keep]
    values = _broadcast_arrays([to_numpy(v) for v in variables], root_rank,
                              f"broadcast_model.{len(variables)}", process_set)
    for v, value in zip(variables, values):
        v.assign(value)
    mark_variables_changed(model)


def optimizer_variables(optimizer: Any) -> list[Any]:
    """An optimizer's variables: Keras 3's and ``tf_keras``' property, or Keras 2's
    legacy method ``variables()``."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


def _broadcast_arrays(arrays: list[np.ndarray], root_rank: int, prefix: str,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    hs = [_api.broadcast_async(np.ascontiguousarray(a), root_rank, f"{prefix}.{i}", process_set)
          for i, a in enumerate(arrays)]
    return [np.asarray(h.wait()).reshape(np.shape(a)) for h, a in zip(hs, arrays)]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from the root rank's weights and optimizer state.

    A ``ShardedOptimizer``'s shards and slots hold each rank's own slice and are not
    sent (its step counts and learning rate are); nor are gradient accumulators.

    Args:
        root_rank: the rank whose variables everyone takes.
        device: ignored (Horovod compatibility).
        local_variables: variables that keep each rank's own values (not broadcast), as
            in Horovod.
        process_set: the ranks taking part.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        self.root_rank = int(root_rank)
        self.process_set = process_set
        self.local_variables = list(local_variables or ())
        self.broadcast_done = False

    def on_train_begin(self, logs: Any = None) -> None:
        switch_off_xla(self.model)
        if not self.broadcast_done:
            broadcast_model(self.model, self.root_rank, optimizer=True,
                            process_set=self.process_set, local_variables=self.local_variables)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.broadcast_done:
            return
        # The optimizer builds its variables in the first step: send them now too.
        broadcast_model(self.model, self.root_rank, optimizer=True, process_set=self.process_set,
                        local_variables=self.local_variables)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace the epoch's metrics in ``logs`` by their mean over the ranks.

    Args:
        device: ignored (Horovod compatibility).
        process_set: the ranks taking part.
    """

    def __init__(self, device: str = "", process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        self.process_set = process_set

    def on_train_begin(self, logs: Any = None) -> None:
        switch_off_xla(self.model)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and k != "learning_rate")
        if not keys:
            return
        values = np.asarray([float(logs[k]) for k in keys], np.float64)
        mean = _api.allreduce(values, name=f"MetricAverageCallback.{len(keys)}",
                              process_set=self.process_set)
        for k, v in zip(keys, mean.tolist()):
            logs[k] = v


def momentum_is_variable(optimizer: Any) -> bool:
    """True for a Keras 2 legacy optimizer with momentum (``OptimizerV2`` keeps it in a
    variable that the compiled step reads, so changing it between batches takes effect)."""
    tf_keras = sys.modules.get("tf_keras")
    legacy = getattr(getattr(tf_keras, "optimizers", None), "legacy", None)
    return bool(legacy is not None and isinstance(optimizer, legacy.Optimizer)
                and "momentum" in optimizer.get_config())


def get_lr(optimizer: Any) -> float:
    """The optimizer's current learning rate as a float."""
    return float(to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` for epochs in ``[start_epoch, end_epoch)``.

    Args:
        initial_lr: the learning rate the multiplier scales (usually base lr * size).
        multiplier: a number, or a function of the (possibly fractional) epoch.
        start_epoch: first epoch the schedule applies to.
        end_epoch: epoch it stops applying at (None: never).
        staircase: adjust once per epoch (True) or every batch with a fractional
            epoch ``epoch + batch / steps_per_epoch`` (False).
        momentum_correction: Horovod's correction: for the batch after an LR change,
            momentum is scaled by ``new_lr / old_lr``. Applied where momentum is a
            variable (Keras 2's ``tf_keras.optimizers.legacy``); Keras 3 and current
            ``tf_keras`` optimizers compile momentum in as a constant, so there it is
            not applied (logged once).
        steps_per_epoch: batches per epoch (default: from ``fit``'s parameters).
        verbose: print changes on rank 0.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda _e, m=multiplier: m)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0
        self._correct_momentum = False
        self._restore_momentum: float | None = None

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        lr = self.initial_lr * float(self.multiplier(epoch))
        sync_jax_state(self.model)
        opt = self.model.optimizer
        if self._correct_momentum:
            old_lr = get_lr(opt)
            momentum = (self._restore_momentum if self._restore_momentum is not None
                        else float(to_numpy(opt.momentum)))
            if old_lr and momentum:
                self._restore_momentum = momentum
                opt.momentum = momentum * lr / old_lr
        opt.learning_rate = lr
        mark_variables_changed(self.model)

    def on_train_begin(self, logs: Any = None) -> None:
        switch_off_xla(self.model)
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError(f"{type(self).__name__}: could not tell the number of batches "
                             "per epoch; pass steps_per_epoch=")
        opt = self.model.optimizer
        self._correct_momentum = bool(self.momentum_correction and momentum_is_variable(opt))
        if (self.momentum_correction and not self._correct_momentum
                and getattr(opt, "momentum", None)):
            logger.info("%s: momentum correction is not applied to %s (its momentum is a "
                        "constant of the compiled step; Keras 2's tf_keras.optimizers.legacy "
                        "optimizers get it)", type(self).__name__, type(opt).__name__)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch
        if self._active(epoch) and self.staircase:
            self._set(epoch)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self._active(self.current_epoch) and not self.staircase:
            self._set(self.current_epoch + float(batch) / float(self.steps_per_epoch or 1))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum = self._restore_momentum
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the LR from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    Horovod's curve (Goyal et al.): at fractional epoch ``e`` (batch b of epoch k
    gives ``e = k + (b + 1) / steps_per_epoch``) the rate is
    ``initial_lr / size * (e * (size - 1) / warmup_epochs + 1)``, updated every batch,
    reaching ``initial_lr`` at the end of the last warmup epoch.

    Args:
        initial_lr: the target learning rate (usually base lr * size).
        warmup_epochs: epochs the warmup lasts.
        momentum_correction: see :class:`LearningRateScheduleCallback`.
        steps_per_epoch: batches per epoch (default: from ``fit``'s parameters).
        verbose: print the end of the warmup on rank 0.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        self.warmup_epochs: int = warmup_epochs

        def multiplier(epoch: float) -> float:
            epoch += 1.0 / float(self.steps_per_epoch or 1)  # round numbers at epoch ends
            n = _api.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and _api.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the best model so far (by ``monitor``), on rank 0 only.

    Args:
        filepath: where to save (``.keras`` or ``.weights.h5``).
        monitor: the metric to watch (add ``MetricAverageCallback`` before this one
            so every rank agrees on it).
        verbose: verbosity of ``ModelCheckpoint``.
        mode: ``auto``, ``min`` or ``max``.
        save_freq: ``"epoch"`` or a number of batches.
        **kwargs: other ``ModelCheckpoint`` arguments.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0,
                 mode: str = "auto", save_freq: Any = "epoch", **kwargs: Any) -> None:
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         mode=mode, save_freq=save_freq, **kwargs)

    def _save_model(self, *args: Any, **kwargs: Any) -> Any:
        if _api.rank() != 0:
            return None
        attr = "model" if uses_tf_keras() else "_model"  # tf_keras: a plain attribute
        model = getattr(self, attr)
        setattr(self, attr, _AtomicSaves(model))  # whole files only (ronde/checkpoint.py)
        try:
            return super()._save_model(*args, **kwargs)
        finally:
            setattr(self, attr, model)


class _AtomicSaves:
    """A model whose ``save``/``save_weights`` write atomically (``ModelCheckpoint``
    calls them with the final path)."""

    def __init__(self, model: Any) -> None:
        self._wrapped = model

    def save(self, filepath: str, *args: Any, **kwargs: Any) -> None:
        write_atomically(filepath, lambda path: self._wrapped.save(path, *args, **kwargs))

    def save_weights(self, filepath: str, *args: Any, **kwargs: Any) -> None:
        write_atomically(filepath,
                         lambda path: self._wrapped.save_weights(path, *args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)
