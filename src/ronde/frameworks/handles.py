"""Handles whose result is converted to a framework's tensors (framework-neutral).

A binding's ``*_async`` call submits one or more runtime requests (numpy in, numpy
out) and returns a :class:`ConvertingHandle`: it mirrors the runtime's
:class:`~ronde.core.requests.Handle` (``poll``, ``wait``, ``exception``,
``add_done_callback``) and converts the numpy result to the framework's type once,
on the first ``wait()``. :func:`group` makes several runtime handles look like one
(grouped allreduce, a pytree of arrays). ``ronde.torch``'s ``TorchHandle`` is a
:class:`ConvertingHandle` too.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..core.requests import GroupOfHandles

__all__ = ["ConvertingHandle", "GroupOfHandles", "group"]


def group(inners: Sequence[Any]) -> GroupOfHandles:
    """One handle over ``inners`` (see :class:`GroupOfHandles`)."""
    return GroupOfHandles(inners)


class ConvertingHandle:
    """The handle of an async collective of a framework binding.

    Args:
        inner: a runtime handle (or :class:`GroupOfHandles`).
        convert: turns the runtime result (numpy) into the framework's result.
        name: the collective's name, for ``repr`` and errors.
        kind: how the handle prints (``JaxHandle``, ``MXNetHandle``).
    """

    __slots__ = ("_inner", "_convert", "_done", "_value", "name", "kind")

    def __init__(self, inner: Any, convert: Callable[[Any], Any], name: str | None = None,
                 kind: str = "Handle") -> None:
        self._inner = inner
        self._convert = convert
        self._done = False
        self._value: Any = None
        self.name: str = name if name is not None else getattr(inner, "name", "")
        self.kind = kind

    def poll(self) -> bool:
        """True once the collective finished (successfully or not)."""
        return bool(self._inner.poll())

    done = poll

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished; return the converted result or raise the collective's error."""
        if not self._done:
            raw = self._inner.wait(timeout)
            self._value = self._convert(raw)
            self._done = True
        return self._value

    def exception(self) -> BaseException | None:
        """Wait, then return the error or None."""
        return self._inner.exception()

    def add_done_callback(self, fn: Callable[["ConvertingHandle"], None]) -> None:
        """Call ``fn(self)`` once finished (from an engine thread; keep it short)."""
        self._inner.add_done_callback(lambda _h: fn(self))

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name!r} {'done' if self.poll() else 'pending'}>"
