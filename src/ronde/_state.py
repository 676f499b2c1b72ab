"""The running job: the :class:`~ronde._runtime.Runtime` that ``init()`` built, or None.

One place every layer reads it from (the numpy API, the build facts, the bindings'
device paths, the benchmarks), so none of them imports another to find it.
:mod:`ronde._api` is the only writer (``init``/``shutdown``, under its lock).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ._errors import NotInitializedError

if TYPE_CHECKING:
    from ._runtime import Runtime

_current: "Runtime | None" = None
#: a thread's own runtime (``ronde.testing.run_threads``: threads as ranks, one runtime
#: each), which it sees instead of the process's
_thread = threading.local()


def current() -> "Runtime | None":
    """The running job's runtime (this thread's own, if it has one), or None outside
    ``init()``/``shutdown()``."""
    return getattr(_thread, "rt", None) or _current


def require() -> "Runtime":
    """The running job's runtime.

    Raises:
        NotInitializedError: ``init()`` has not been called (or ``shutdown()`` has).
    """
    rt = getattr(_thread, "rt", None) or _current
    if rt is None:
        raise NotInitializedError("ronde has not been initialised; call ronde.init() first")
    return rt


def set_current(rt: "Runtime | None") -> "Runtime | None":
    """Install ``rt`` (None: none); return the one it replaces."""
    global _current
    old, _current = _current, rt
    return old


def set_thread_runtime(rt: "Runtime | None") -> None:
    """Give the calling thread its own runtime (None: back to the process's). For
    threads-as-ranks tests only: ``init()`` and ``shutdown()`` in such a thread leave its
    runtime alone (the harness made it and stops it)."""
    _thread.rt = rt


def thread_runtime() -> "Runtime | None":
    """The calling thread's own runtime, if it has one."""
    return getattr(_thread, "rt", None)


def launcher() -> str:
    """What started this process, as ``init()`` found it: ``ronderun``, ``torchrun``,
    ``openmpi``, ``mpich``, ``slurm``, or ``single`` (no launcher: a plain ``python``)."""
    return str(require().wenv.source)
