"""Elastic training with TensorFlow: ``hvd.elastic.run``, ``TensorFlowKerasState``,
``TensorFlowState`` (Horovod's ``horovod.tensorflow.elastic``).

TensorFlow 2 eager (and ``tf.function``) only: TensorFlow 1 sessions are not supported.
Inside a ``tf.function`` a lost peer surfaces as a TensorFlow op error carrying ronde's
message; :func:`run` turns it back into ``PeerLostError`` so that the job re-forms.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import numpy as np
import tensorflow as tf

from ..elastic import (HorovodInternalError, HostsUpdatedInterrupt, HostUpdateResult,
                       ObjectState, State, run_fn)
from .._errors import PeerLostError
from ..keras.elastic import KerasState as TensorFlowKerasState

F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Decorator: run ``func(state, ...)`` elastically (see :mod:`ronde.elastic.loop`)."""

    @functools.wraps(func)
    def translated(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            if "PeerLostError" in str(exc.message):
                raise PeerLostError(str(exc.message)) from exc
            raise

    return run_fn(translated)  # type: ignore[return-value]


class TensorFlowState(ObjectState):
    """State of a list of ``tf.Variable`` (eager), plus plain keyword objects.

    Args:
        variables: the variables to keep (TensorFlow 2 has no global collection: pass
            them, e.g. ``model.variables + optimizer.variables``).
        session: accepted for Horovod's TensorFlow 1 signature; must be None.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError("TensorFlowState(session=...): TensorFlow 1 sessions are not "
                             "supported; run eagerly (TensorFlow 2)")
        if variables is None:
            raise ValueError("TensorFlowState needs the variables to keep (TensorFlow 2 "
                             "has no global variable collection)")
        self.variables = list(variables)
        self._save_model()
        super().__init__(**kwargs)

    def _save_model(self) -> None:
        self._values = [np.array(v.numpy()) for v in self.variables]

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        for v, value in zip(self.variables, self._values):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        from .functions import broadcast_variables

        broadcast_variables(self.variables, root_rank=0)
        self._save_model()
        super().sync()


__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TensorFlowKerasState", "TensorFlowState", "run", "run_fn"]
