"""What Hugging Face ``transformers.Trainer`` needs from ronde beyond a plain optimizer.

``Trainer`` saves ``optimizer.state_dict()`` on rank 0 only. A ``ShardedOptimizer``'s
state is 1/N on each rank, and gathering it is a collective, so ``state_dict()`` refuses
unless ``consolidate_state_dict()`` ran on every rank first (as torch's
``ZeroRedundancyOptimizer``; Lightning calls it itself). :class:`ConsolidateOptimizerState`
calls it on every rank at the step or epoch end whose ``control.should_save`` is set,
just before ``Trainer`` writes the checkpoint, with the whole state for every rank: in
the one-process-per-rank mode a ``ShardedOptimizer`` runs in (under DDP it is refused),
each rank's ``Trainer`` is its own rank 0 and saves. Each then saves the same whole
state (held on every rank until the next step), and ``load_state_dict`` on resume (every
rank, at any N) keeps each rank's part.

No import of ``transformers`` here: ``Trainer`` calls a callback's ``on_*`` methods by
name, and the ones this class has no use for do nothing.
"""

from __future__ import annotations

from typing import Any, Callable

from .sharded import is_sharded


class ConsolidateOptimizerState:
    """A ``transformers.Trainer`` callback: ``callbacks=[hvd.ConsolidateOptimizerState()]``
    (module docstring). Does nothing for an optimizer that is not sharded."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._before_save(control, kwargs.get("optimizer"))

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._before_save(control, kwargs.get("optimizer"))

    def _before_save(self, control: Any, optimizer: Any) -> None:
        if not getattr(control, "should_save", False):
            return
        while optimizer is not None and not is_sharded(optimizer):
            optimizer = getattr(optimizer, "optimizer", None)  # accelerate's wrapper
        if optimizer is not None:  # every rank's Trainer saves (each is its own rank 0)
            optimizer.consolidate_state_dict(None)

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("on_"):
            return _nothing
        raise AttributeError(name)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None
