"""Keras 2 spellings that Horovod's TensorFlow code relies on, for the alias only.

Installed by :mod:`ronde.compat` when a ``horovod.tensorflow``/``horovod.keras``
module is first imported through the alias, never by ``import ronde``:

- ``variable.ref()``: TF2 code keys dicts by ``var.ref()``; a Keras 3 variable has no
  ``ref`` (and compares element-wise, so it cannot be a key itself). Here it returns
  a :class:`Ref`, hashable and equal by the variable's identity, whose ``deref()``
  gives the variable back, as ``tf.Variable.ref()`` does.
"""

from __future__ import annotations

from typing import Any


class Ref:
    """A hashable handle on one variable (``tf.Variable.ref()``'s contract)."""

    __slots__ = ("_var",)

    def __init__(self, var: Any) -> None:
        self._var = var

    def deref(self) -> Any:
        """The variable this refers to."""
        return self._var

    def __hash__(self) -> int:
        return id(self._var)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other._var is self._var

    def __repr__(self) -> str:
        return f"<Ref to {getattr(self._var, 'path', self._var)!r}>"


def install() -> None:
    """Add the spellings to the installed Keras 3 (idempotent; no-op without Keras, and
    under ``TF_USE_LEGACY_KERAS=1``, where ``tf.keras`` is Keras 2 and has them)."""
    from ..keras._choice import legacy_requested

    if legacy_requested():
        return
    try:
        import keras
    except ImportError:  # pragma: no cover - depends on the environment
        return
    variable = getattr(keras, "Variable", None)
    if variable is not None and not hasattr(variable, "ref"):
        variable.ref = lambda self: Ref(self)  # type: ignore[attr-defined]
