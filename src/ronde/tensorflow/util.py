"""Horovod's ``horovod.tensorflow.util`` helpers, which scripts and test suites import."""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (outside any ``tf.function`` trace)."""
    return bool(tf.executing_eagerly())


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` as one ``tf.function``."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """Memoise ``f`` on its (hashable) arguments and on eager vs graph mode."""
    cache: dict[Any, Any] = {}

    @functools.wraps(f)
    def wrapper(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(variables: Any) -> Any:
    """Variables (nested lists) as hashable references (tuples of ``v.ref()``)."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs: Any) -> Any:
    """The inverse of :func:`vars_to_refs`."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
