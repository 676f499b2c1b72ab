"""The running job: the :class:`~ronde._runtime.Runtime` that ``init()`` built, or None.

One place every layer reads it from (the numpy API, the build facts, the bindings'
device paths, the benchmarks), so none of them imports another to find it.
:mod:`ronde._api` is the only writer (``init``/``shutdown``, under its lock).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._errors import NotInitializedError

if TYPE_CHECKING:
    from ._runtime import Runtime

_current: "Runtime | None" = None


def current() -> "Runtime | None":
    """The running job's runtime, or None outside ``init()``/``shutdown()``."""
    return _current


def require() -> "Runtime":
    """The running job's runtime.

    Raises:
        NotInitializedError: ``init()`` has not been called (or ``shutdown()`` has).
    """
    rt = _current
    if rt is None:
        raise NotInitializedError("ronde has not been initialised; call ronde.init() first")
    return rt


def set_current(rt: "Runtime | None") -> "Runtime | None":
    """Install ``rt`` (None: none); return the one it replaces."""
    global _current
    old, _current = _current, rt
    return old
