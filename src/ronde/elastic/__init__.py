"""Elastic training: the job survives ranks leaving and joining (Horovod's elastic API).

::

    import ronde.torch as hvd

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, state.batch): ...
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    train(state)

launched with ``ronderun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh
python train.py`` (or a fixed ``-H`` list with ``--min-np``). See docs/elastic.md.
This package is the framework-neutral part: :class:`State`, :class:`ObjectState`, the
reset loop (:func:`run`), the exactly-once sampler bookkeeping, the host notices; each
binding's ``elastic`` module adds its framework's states.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from .._errors import HorovodInternalError, HostsUpdatedInterrupt, WorkerRemovedError
from .loop import run_fn
from .notify import HostUpdateResult
from .state import ObjectState, State

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "ObjectState",
           "State", "WorkerRemovedError", "run", "run_fn"]


def run(func: F) -> F:
    """Decorator: run ``func(state, ...)`` elastically (see :mod:`ronde.elastic.loop`).

    The function must not start with a collective of its own before touching the state
    (new ranks sync first); commit the state every few batches.
    """
    return run_fn(func)
