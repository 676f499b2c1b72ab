"""Backend tensors <-> the host, for Keras 3 on the TensorFlow, JAX and torch backends.

The Keras binding does one thing per backend: run a numpy function over a list
of backend tensors and get backend tensors back, whether the step is traced or
eager. What runs where:

* ``tensorflow``: ``tf.numpy_function`` inside ``tf.function`` (the default
  ``model.fit`` path), a direct call eagerly (:mod:`ronde.tensorflow._bridge`).
* ``jax``: ``jax.pure_callback`` inside ``jax.jit`` (Keras' default on JAX, XLA
  included: the callback leaves the compiled program for the host and comes
  back); the same call works on concrete arrays.
* ``torch``: eager (Keras' default on torch); tensors cross through numpy
  without copies on CPU (:mod:`ronde.torch._tensors`).
* ``numpy``: a direct call.

With Keras 2 (``tf_keras``, chosen by TensorFlow's rule: :mod:`._choice`) the backend
is always TensorFlow.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np

from ._choice import keras_module, uses_tf_keras

logger = logging.getLogger(__name__)

HostFn = Callable[..., Sequence[np.ndarray]]


def backend_name() -> str:
    """The active Keras backend (``tensorflow``, ``jax``, ``torch``, ``numpy``)."""
    return str(keras_module().backend.backend())


def host_map(fn: HostFn, tensors: Sequence[Any], name: str = "ronde",
             outs: Sequence[tuple[tuple[int, ...], str]] | None = None) -> list[Any]:
    """Run ``fn(*numpy arrays)`` over backend tensors; outputs of ``outs``' (shape, dtype)
    each, by default the inputs' shapes and dtypes."""
    backend = backend_name()
    if not tensors:
        return []
    if backend == "tensorflow":
        import tensorflow as tf

        from ..tensorflow._bridge import host_call

        ts = [tf.convert_to_tensor(t) for t in tensors]
        if outs is None:
            return host_call(fn, ts, [t.dtype for t in ts], [t.shape for t in ts], name)
        return host_call(fn, ts, [tf.as_dtype(d) for _, d in outs],
                         [tf.TensorShape(s) for s, _ in outs], name)
    if backend == "jax":
        import jax

        specs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tensors] if outs is None \
            else [jax.ShapeDtypeStruct(s, d) for s, d in outs]

        def call(*arrays: Any) -> list[np.ndarray]:
            res = fn(*[np.asarray(a) for a in arrays])
            return [np.asarray(o, dtype=s.dtype).reshape(s.shape) for o, s in zip(res, specs)]

        return list(jax.pure_callback(call, specs, *tensors))
    if backend == "torch":
        import torch

        from ..torch._collectives import from_numpy
        from ..torch._tensors import numpy_view

        staged = [t.detach().cpu().contiguous() for t in tensors]
        res = fn(*[numpy_view(t) for t in staged])
        devices = [t.device for t in tensors] if outs is None else [tensors[0].device] * len(res)
        with torch.no_grad():
            return [from_numpy(np.ascontiguousarray(o)).to(d) for o, d in zip(res, devices)]
    return [np.asarray(o) for o in fn(*[np.asarray(t) for t in tensors])]


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy of a backend tensor or Keras variable (eager only)."""
    if uses_tf_keras():
        import tensorflow as tf

        return np.asarray(tf.convert_to_tensor(tensor).numpy())
    return np.asarray(keras_module().ops.convert_to_numpy(tensor))


def to_tensor(value: Any) -> Any:
    """A backend tensor holding ``value`` (a numpy array or number)."""
    if uses_tf_keras():
        import tensorflow as tf

        return tf.convert_to_tensor(value)
    return keras_module().ops.convert_to_tensor(value)


def sync_jax_state(model: Any) -> None:
    """On JAX, write ``fit``'s in-flight state back to the Keras variables (else no-op)."""
    if backend_name() == "jax" and hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


def mark_variables_changed(model: Any) -> None:
    """On JAX, make ``fit`` re-read the variables a callback assigned (else no-op)."""
    if backend_name() == "jax" and hasattr(model, "_jax_state_synced"):
        model._jax_state_synced = True
