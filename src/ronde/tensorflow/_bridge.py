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

from .._errors import HorovodInternalError

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


_TF_ERRORS: dict[type, type] = {}
#: the graph collection holding the last ronde op built in a TF1-style graph
_CHAIN = "ronde_host_ops"


def _chained(graph: Any) -> list[Any] | None:
    """The list holding a session graph's last ronde op, or None where no chain is kept:
    in a ``tf.function`` (it orders stateful ops itself) and inside TF1 control flow (a
    while_loop/cond frame may not depend on an op outside it)."""
    if getattr(graph, "building_function", False):
        return None
    try:
        if graph._get_control_flow_context() is not None:  # a private helper of TF1 graphs
            return None
    except AttributeError:
        pass
    return graph.get_collection_ref(_CHAIN)


def as_tf_error(exc: BaseException) -> BaseException:
    """An error of a collective as TensorFlow reports one, as Horovod's TF ops do: a failed
    collective (:class:`~ronde.HorovodInternalError`) is also a
    ``tf.errors.FailedPreconditionError``, bad arguments (``ValueError``, ``TypeError``)
    also a ``tf.errors.InvalidArgumentError``. The result is an instance of both its own
    class and the TensorFlow one, so ``except tf.errors.OpError`` and ``except
    ronde.TensorMismatchError`` (or ``ValueError``) both work.

    Eagerly only: inside a graph, TensorFlow turns an exception of a Python op into an
    ``InvalidArgumentError`` (ValueError, TypeError) or an ``UnknownError`` (the others),
    whose message is ronde's (docs/compat.md).
    """
    if isinstance(exc, tf.errors.OpError):
        return exc
    cls = type(exc)
    mixed = _TF_ERRORS.get(cls)
    if mixed is None:
        tf_cls, code = ((tf.errors.FailedPreconditionError, tf.errors.FAILED_PRECONDITION)
                        if isinstance(exc, HorovodInternalError) else
                        (tf.errors.InvalidArgumentError, tf.errors.INVALID_ARGUMENT))

        def init(self: Any, message: str) -> None:
            # OpError's own __init__ chains to the other base's with other arguments:
            # set what OpError reads instead
            BaseException.__init__(self, message)
            self._node_def, self._op, self._message = None, None, message
            self._error_code = code
            self._experimental_payloads = {}

        mixed = type(cls.__name__, (tf_cls, cls),
                     {"__init__": init, "__module__": cls.__module__,
                      "__str__": lambda self: self.message,
                      # pickled (multiprocessing, Ray) as the plain ronde/Python error
                      "__reduce__": lambda self, c=cls: (c, (self.message,))})
        _TF_ERRORS[cls] = mixed
    new = mixed(str(exc))
    if hasattr(exc, "rank"):
        new.rank = exc.rank
    return new


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
        try:
            outs = fn(*[t.numpy() for t in tensors])
        except (HorovodInternalError, ValueError, TypeError) as exc:
            raise as_tf_error(exc) from exc
        return [tf.convert_to_tensor(np.asarray(o), dtype=d) for o, d in zip(outs, out_dtypes)]
    check_not_xla(name)

    def call(*arrays: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(o, dtype=d.as_numpy_dtype)
                for o, d in zip(fn(*arrays), out_dtypes)]

    graph = tf.compat.v1.get_default_graph()
    # in a TF1-style graph (run by a session), every rank runs ronde's ops in the order
    # they were built: each one blocks an executor thread until it completes, and the
    # ranks' threads taking different ops first would wait for each other for ever.
    # tf.function orders stateful ops so by itself. (A session fetching one ronde op then
    # also runs those built before it in the graph: docs/tensorflow.md.)
    chain = _chained(graph)
    deps = chain[-1:] if chain is not None else []
    with tf.control_dependencies(deps):
        outs = tf.numpy_function(call, tensors, list(out_dtypes), stateful=True,
                                 name=name.replace("/", "_").replace(".", "_"))
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    if outs and chain is not None:
        chain[:] = [outs[0].op]
    result = []
    for o, shape in zip(outs, out_shapes):
        o.set_shape(shape)
        result.append(o)
    return result
