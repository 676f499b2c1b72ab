"""JAX arrays <-> the numpy arrays the engine reads and writes, eagerly or from ``jax.jit``.

Every collective of :mod:`ronde.jax` is a *host function* on numpy arrays, run by
:func:`host_call` in one of two ways:

* **eagerly** (the inputs are concrete arrays): the inputs become numpy arrays
  (``np.asarray``: no copy for a CPU array, after waiting for it to be computed),
  the host function runs in the calling thread, and its results are put back on
  the input's devices (``jax.device_put``);
* **under a trace** (``jax.jit``, ``jax.grad``, ``lax.scan``/``cond`` ...): the host
  function becomes an ``io_callback(..., ordered=True)``. XLA calls it from its own
  thread when the compiled program reaches it, with numpy copies of the inputs;
  ``ordered=True`` keeps the program order of the callbacks and stops XLA from
  dropping one whose result is unused (which would leave the other ranks waiting).

Output shapes must be known at trace time: see :func:`ronde.jax.allgather`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.experimental import io_callback

from .._api import as_array

logger = logging.getLogger(__name__)

#: a host function: numpy inputs -> numpy outputs (a tuple, one per output spec)
HostFn = Callable[..., Sequence[np.ndarray]]


def is_traced(x: Any) -> bool:
    """True when ``x`` is a JAX tracer (inside ``jit``, ``grad``, ``vmap`` ...)."""
    return isinstance(x, jax.core.Tracer)


def any_traced(xs: Sequence[Any]) -> bool:
    """True when any of ``xs`` is a JAX tracer."""
    return any(is_traced(x) for x in xs)


def as_jax_input(x: Any, what: str) -> Any:
    """``x`` itself if it is a JAX array or tracer, else ``jnp.asarray(x)``.

    Raises:
        TypeError: object or otherwise unsupported dtypes.
    """
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    arr = np.asarray(x)
    if arr.dtype == object:
        raise TypeError(f"{what}: cannot send {type(x).__name__} objects; pass a jax.Array "
                        "(use broadcast_object/allgather_object for Python objects)")
    return jax.numpy.asarray(arr)


def to_host(x: Any, what: str) -> np.ndarray:
    """A C-contiguous numpy array with the values of a concrete JAX array."""
    return as_array(np.asarray(x), what)


def spec_of(x: Any, shape: Sequence[int] | None = None) -> jax.ShapeDtypeStruct:
    """The result spec of a callback output like ``x`` (optionally of another shape)."""
    return jax.ShapeDtypeStruct(tuple(x.shape) if shape is None else tuple(shape), x.dtype)


def to_device(arr: np.ndarray, like: Any) -> jax.Array:
    """Put a numpy result on ``like``'s devices (the default device if shapes differ)."""
    if isinstance(like, jax.Array) and tuple(like.shape) == tuple(arr.shape):
        try:
            return jax.device_put(arr, like.sharding)
        except (ValueError, TypeError):  # shardings that cannot take a host array
            pass
    return jax.device_put(arr)


def host_call(fn: HostFn, specs: Sequence[jax.ShapeDtypeStruct], inputs: Sequence[Any],
              likes: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """Run a host function on ``inputs`` eagerly or as an ordered ``io_callback``.

    Args:
        fn: takes one numpy array per input, returns one numpy array per spec.
        specs: shape and dtype of each output (needed under a trace).
        inputs: JAX arrays or tracers.
        likes: per output, the input whose devices the eager result goes to.

    Returns:
        A tuple of JAX arrays (or tracers), one per spec.
    """
    if any_traced(inputs):
        def checked(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
            outs = tuple(fn(*arrays))
            for out, spec in zip(outs, specs):
                if tuple(out.shape) != tuple(spec.shape):
                    raise ValueError(f"a ronde collective inside jax.jit produced shape "
                                     f"{tuple(out.shape)}, but {tuple(spec.shape)} was "
                                     "assumed at trace time; call it outside jit")
            return tuple(np.asarray(o, dtype=s.dtype) for o, s in zip(outs, specs))

        return tuple(io_callback(checked, tuple(specs), *inputs, ordered=True))
    outs = fn(*[np.asarray(x) for x in inputs])
    likes = likes if likes is not None else [None] * len(specs)
    return tuple(to_device(np.asarray(o), like) for o, like in zip(outs, likes))
