"""``broadcast_variables`` and the object collectives for TensorFlow.

``broadcast_variables`` sends every variable of a list from the root in one host
call (eagerly, or as one op inside ``tf.function``) and assigns the results. It
takes ``tf.Variable`` and Keras 3 variables alike, so both
``hvd.broadcast_variables(model.variables, 0)`` and
``hvd.broadcast_variables(opt.variables, 0)`` work.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from .. import _api, _objects
from ..process_sets import ProcessSet, global_process_set
from ._bridge import host_call

logger = logging.getLogger(__name__)


def _value(v: Any) -> tf.Tensor:
    return tf.convert_to_tensor(v)  # tf.Variable and keras.Variable (TF backend) alike


def broadcast_arrays(arrays: Sequence[np.ndarray], root_rank: int, prefix: str,
                     process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Broadcast numpy arrays from ``root_rank``: all submitted, then all awaited."""
    hs = [_api.broadcast_async(np.ascontiguousarray(a), root_rank, f"{prefix}.{i}", process_set)
          for i, a in enumerate(arrays)]
    return [np.asarray(h.wait()).reshape(np.shape(a)) for h, a in zip(hs, arrays)]


def broadcast_variables(variables: Any, root_rank: int = 0,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = True, name: str | None = None) -> Any:
    """Overwrite ``variables`` with the root rank's values (eager or in ``tf.function``).

    Args:
        variables: a list of ``tf.Variable``/Keras variables (or a callable returning
            one, such as a Keras 2 style ``opt.variables``).
        root_rank: the rank whose values everyone takes.
        process_set: the ranks taking part.
        inplace: accepted for Horovod compatibility (variables are always assigned).
        name: prefix of the collective names (default: by position).

    Returns:
        None eagerly; the group of assign ops in a graph.
    """
    if callable(variables) and not isinstance(variables, (list, tuple)):
        variables = variables()
    variables = list(variables)
    if not variables:
        return None
    prefix = name or f"broadcast_variables.{len(variables)}"
    values = [_value(v) for v in variables]
    out = host_call(lambda *a: broadcast_arrays(a, root_rank, prefix, process_set), values,
                    [t.dtype for t in values], [t.shape for t in values],
                    "ronde_broadcast_variables")
    ops = [v.assign(o) for v, o in zip(variables, out)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[o for o in ops if o is not None])


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Broadcast a picklable object from ``root_rank`` (eager only)."""
    return _objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather a picklable object from every rank, in rank order (eager only)."""
    return _objects.allgather_object(obj, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's helper: a function that broadcasts its argument from ``root_rank``."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1's spelling: broadcast ``tf.compat.v1.global_variables()`` from ``root_rank``.

    Only inside a TF1-style graph (as in Horovod); eagerly it raises ``RuntimeError``:
    use ``broadcast_variables(model.variables, root_rank)`` or the Keras callback.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution "
                           "(TensorFlow 2 has no global variable collection); use "
                           "hvd.broadcast_variables(model.variables, root_rank) or "
                           "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
