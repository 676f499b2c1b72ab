"""``Trainer.fit`` under elastic ``ronderun``: :func:`elastic_fit`.

A Lightning fit cannot change its world size while it runs (its samplers, loops and
wrapped optimizers are built for one), so the unit that survives a membership change is
the fit itself, as Horovod's elastic ``run`` makes the training function the unit::

    import lightning.pytorch as pl
    from ronde.lightning import elastic_fit

    def make_trainer():
        return pl.Trainer(strategy="ronde", accelerator="cpu", devices=1, max_epochs=10)

    elastic_fit(make_trainer, model, train_dataloaders=loader)

    # ronderun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py

How it goes:

* **Commit.** At the start of training and at the end of every training epoch, every
  rank takes Lightning's own checkpoint of the run (``dump_checkpoint``: the module's
  weights, the optimizers' and schedulers' states, the loops' progress, the callbacks'
  states) into host memory (:class:`LightningState`, an elastic ``State``), then checks
  for host changes, as ``state.commit()`` does in a plain elastic loop. Nothing is
  written to disk.
* **A lost rank.** Every survivor's pending collective fails; Lightning tears the fit
  down (the strategy's teardown takes its optimizer hooks off the model); the elastic
  loop re-forms the job, the survivors go back to the last commit, and every rank,
  new ones included, takes rank 0's commit (rank 0 is always a survivor).
* **Hosts added or removed** (discovery): the job re-forms at the next commit, on every
  rank at the same epoch end.
* **Resume.** ``make_trainer()`` builds a new ``Trainer`` for the new world, and its
  ``fit`` starts from the commit (``ckpt_path=COMMITTED``, loaded from memory through
  ``RondeStrategy.load_checkpoint``): the next epoch after the last one completed,
  sharded over the new ranks by Lightning's distributed sampler.

What this means for the data: an epoch interrupted by a lost rank is run again whole,
from the weights of its start, by the re-formed job; so every sample counts once per
epoch in the weights (the same rule as a plain elastic loop that commits per epoch).
Committing only at epoch ends keeps that exact when the size changes: a mid-epoch
resume at another size would deal the epoch's samples differently.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl

from .. import torch as hvd
from ..elastic import ObjectState, run
from .strategy import COMMITTED, RondeStrategy

__all__ = ["LightningState", "elastic_fit"]


class LightningState(ObjectState):
    """The elastic state of a Lightning fit: ``checkpoint``, the last committed Lightning
    checkpoint (a dict; None before the first commit) and ``fits``, how many fits
    started (1 + the resets seen on this rank's side of the job)."""

    def __init__(self) -> None:
        super().__init__(checkpoint=None)
        self.fits = 0

    def commit_from(self, trainer: pl.Trainer) -> None:
        """Take the trainer's checkpoint (every rank, the same step) and commit it."""
        self.checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        self.commit()


class _Commit(pl.Callback):
    """Commits ``state`` when training starts (the first time) and at every training
    epoch's end."""

    def __init__(self, state: LightningState) -> None:
        self.state = state

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.state.checkpoint is None:  # the weights broadcast from rank 0, not trained
            self.state.commit_from(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state.commit_from(trainer)


def elastic_fit(make_trainer: Callable[[], pl.Trainer], model: pl.LightningModule,
                *fit_args: Any, state: LightningState | None = None,
                **fit_kwargs: Any) -> LightningState:
    """``make_trainer().fit(model, *fit_args, **fit_kwargs)`` as an elastic job (see the
    module docstring); returns the state (its ``checkpoint`` is the last commit).

    Args:
        make_trainer: builds a ``Trainer`` on ``RondeStrategy`` (``strategy="ronde"``);
            called for the first fit and again after every reset.
        model: the ``LightningModule``; the same object is trained on after a reset.
        state: a :class:`LightningState` to keep (default: a new one).
        fit_args, fit_kwargs: what ``Trainer.fit`` takes after the model
            (``train_dataloaders``, ``val_dataloaders``, ``datamodule``); not
            ``ckpt_path``, which the commits decide.

    Raises:
        ValueError: the trainer is not on ``RondeStrategy``, or ``ckpt_path`` was given.
    """
    if "ckpt_path" in fit_kwargs:
        raise ValueError("elastic_fit: ckpt_path is decided by the commits (load a file "
                         "checkpoint into the model before calling elastic_fit instead)")
    hvd.init()
    state = state if state is not None else LightningState()
    run(_fit)(state, make_trainer, model, fit_args, fit_kwargs)
    return state


def _fit(state: LightningState, make_trainer: Callable[[], pl.Trainer],
         model: pl.LightningModule, fit_args: tuple[Any, ...],
         fit_kwargs: dict[str, Any]) -> None:
    trainer = make_trainer()
    strategy = trainer.strategy
    if not isinstance(strategy, RondeStrategy):
        raise ValueError(f"elastic_fit: the trainer's strategy is {type(strategy).__name__}; "
                         "build it with strategy='ronde' (RondeStrategy)")
    trainer.callbacks.append(_Commit(state))
    strategy.resume_from(state.checkpoint)
    state.fits += 1
    trainer.fit(model, *fit_args, **fit_kwargs,
                ckpt_path=COMMITTED if state.checkpoint is not None else None)
