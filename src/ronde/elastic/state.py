"""Elastic state: what survives a reset, committed in memory and synced from a survivor.

Where it sits: a training function decorated with ``@hvd.elastic.run`` receives a
:class:`State`. ``commit()`` saves it (in host memory) and checks for host changes;
on a lost peer every survivor ``restore()``\\ s the last commit; after the job has re-formed,
``sync()`` brings every rank (new ones included) to the state of the new rank 0, which
is always a survivor (the driver keeps the old host order). The framework states
(``ronde.torch.elastic.TorchState``, ``ronde.tensorflow.elastic.TensorFlowKerasState``,
``ronde.jax.elastic.JaxState``...) build on :class:`ObjectState`.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from . import notify


class State:
    """Horovod's elastic ``State``: commit / restore / sync and the reset callbacks.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (every rank calls it).
        get_rank: this process's current rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        from .._api import rank
        from .._objects import broadcast_object

        self._bcast_object = bcast_object or broadcast_object
        self._default_bcast = bcast_object is None or bcast_object is broadcast_object
        self._rank = get_rank or rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._last_updated = 0.0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after every reset (the job re-formed, before ``sync()``),
        e.g. to scale the learning rate by the new ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``elastic.run`` after the job re-formed: ``reset()``, then the
        registered callbacks, in order."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory, then check for host changes (which raises
        :class:`~ronde.HostsUpdatedInterrupt` on every rank at this same commit).

        A collective: every rank must commit at the same step. Committing copies the
        state; commit every few batches rather than every one when that cost shows.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`~ronde.HostsUpdatedInterrupt` on every rank when the launcher
        announced a change of hosts since the last check (decided collectively: rank 0's
        view is broadcast, so every rank raises at the same step)."""
        from .._errors import HostsUpdatedInterrupt

        stamp, update = notify.latest()  # what the launcher announced, as this rank saw it
        # notices from before this generation formed are in it already
        prev = max(self._last_updated, notify.baseline())
        if stamp <= prev:
            stamp, update = prev, 0
        # rank 0's view for everyone (a rank that joined since has its own ``prev``),
        # and whether any rank got SIGTERM
        if self._default_bcast:
            prev, stamp, update, leaving = _rank0_view_and_any_leaving(prev, stamp, update)
        else:
            prev, stamp, update = self._bcast_object((prev, stamp, update))
            leaving = notify.any_preempted()
        self._last_updated = stamp
        if leaving:  # a rank got SIGTERM: it leaves, the others re-form without it
            raise HostsUpdatedInterrupt(False)
        if stamp > prev:
            raise HostsUpdatedInterrupt(update == notify.REMOVED)

    # Horovod's private spellings, which its own elastic test scripts use
    @property
    def _last_updated_timestamp(self) -> float:
        return self._last_updated

    @_last_updated_timestamp.setter
    def _last_updated_timestamp(self, value: float) -> None:
        self._last_updated = value

    @property
    def _host_messages(self) -> "_Notices":
        """``.empty()``: no host change announced since the last one acted on."""
        return _Notices(self)

    def save(self) -> None:
        """Save the state in host memory (what ``restore()`` returns to)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Return to the last saved state, dropping what changed since."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's (a collective)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust to the new job after a reset, before ``sync()`` (default: nothing)."""


def _rank0_view_and_any_leaving(prev: float, stamp: float, update: int
                                ) -> tuple[float, float, int, bool]:
    """One max-allreduce: rank 0's (prev, stamp, update), every rank's SIGTERM flag
    (notice numbers are small non-negative integers: exact in float64)."""
    import numpy as np

    from .. import _api
    from ..collectives.ops import ReduceOp

    if not _api.is_initialized() or _api.size() == 1:
        return prev, stamp, update, notify.preempted()
    mine = [prev, stamp, update] if _api.rank() == 0 else [0.0, 0.0, 0.0]
    got = _api.allreduce(np.array(mine + [1.0 if notify.preempted() else 0.0]),
                         op=ReduceOp.MAX, name="ronde.elastic.check")
    return float(got[0]), float(got[1]), int(got[2]), bool(got[3])


class _Notices:
    def __init__(self, state: State) -> None:
        self._state = state

    def empty(self) -> bool:
        newest = notify.latest()[0]
        return newest <= max(self._state._last_updated, notify.baseline())


class ObjectState(State):
    """State of plain picklable Python objects, given as keyword arguments and exposed
    as attributes (``state.epoch``, ``state.batch``)."""

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))
