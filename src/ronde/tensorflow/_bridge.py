"""Calling the numpy engine from TensorFlow, eagerly and inside ``tf.function``.

What runs where: eagerly, a collective converts its tensors with ``.numpy()``
(no copy for CPU tensors), calls :mod:`ronde._api` and wraps the result with
``tf.convert_to_tensor``. Inside a ``tf.function`` the same Python function
becomes a ``tf.numpy_function`` op (stateful, so TensorFlow's automatic control
dependencies run these ops in program order on every rank and never prune them);
it runs on the host when the graph executes, on a TensorFlow executor thread,
and blocks that thread until the collective is done. XLA cannot compile such an
op: a ``jit_compile=True`` function that calls a collective fails (see
:func:`in_xla_context`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

logger = logging.getLogger(__name__)


def in_xla_context() -> bool:
    """True while tracing a function that XLA will compile (``jit_compile=True``)."""
    if tf.executing_eagerly():
        return False
    try:  # a private helper; without it we cannot tell and assume no XLA
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))
    except (ImportError, AttributeError):
        return False


def check_not_xla(what: str) -> None:
    """Raise a clear error instead of XLA's when a collective is traced under XLA."""
    if in_xla_context():
        from .._errors import RondeError

        raise RondeError(
            f"{what} cannot run inside an XLA-compiled TensorFlow function: ronde's "
            "collectives are host calls (tf.numpy_function), which XLA cannot compile. "
            "Use @tf.function without jit_compile=True, or model.compile(..., "
            "jit_compile=False) (ronde's Keras callbacks switch it off for you)")


def dtype_name(dtype: tf.DType) -> str:
    """The numpy-style name of a TensorFlow dtype (``float32``, ``bfloat16``...)."""
    return "bfloat16" if dtype == tf.bfloat16 else str(np.dtype(dtype.as_numpy_dtype))


def host_call(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[Any],
              out_dtypes: Sequence[tf.DType], out_shapes: Sequence[Any],
              name: str = "ronde") -> list[tf.Tensor]:
    """Run ``fn(*numpy_inputs) -> numpy_outputs`` eagerly or as one graph op.

    Args:
        fn: a function of numpy arrays returning a sequence of numpy arrays.
        inputs: tensors (converted with ``tf.convert_to_tensor``).
        out_dtypes: the dtypes of the outputs.
        out_shapes: their static shapes (``None`` entries for unknown sizes).
        name: the op name inside a graph.
    """
    tensors = [tf.convert_to_tensor(t) for t in inputs]
    if tf.executing_eagerly():
        outs = fn(*[t.numpy() for t in tensors])
        return [tf.convert_to_tensor(np.asarray(o), dtype=d) for o, d in zip(outs, out_dtypes)]
    check_not_xla(name)

    def call(*arrays: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(o, dtype=d.as_numpy_dtype)
                for o, d in zip(fn(*arrays), out_dtypes)]

    outs = tf.numpy_function(call, tensors, list(out_dtypes), stateful=True,
                             name=name.replace("/", "_").replace(".", "_"))
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    result = []
    for o, shape in zip(outs, out_shapes):
        o.set_shape(shape)
        result.append(o)
    return result
