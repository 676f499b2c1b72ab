"""Requests and handles: what a collective call puts into the engine.

A framework binding (or the numpy facade) turns each call into a
:class:`Request`: the tensor's bytes as a contiguous numpy array plus its
metadata. The metadata travels to every rank during negotiation (as a short JSON
list, see :meth:`Request.meta`), so that ranks can check they agree before any
data moves. The caller gets a :class:`Handle` back at once.
"""

from __future__ import annotations

import enum
import functools
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .._errors import RondeError

if TYPE_CHECKING:
    from .engine import Engine


class Kind(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6


KIND_NAMES = {k: k.name.lower() for k in Kind}

#: Allocates the output of a request once its shape is known: ``(shape, dtype) -> array``.
Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]


@functools.lru_cache(maxsize=128)
def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a dtype (cached: ``str(dtype)`` costs microseconds per call)."""
    return str(np.dtype(dtype))


@functools.lru_cache(maxsize=64)
def resolve_dtype(name: str) -> np.dtype:
    """Turn a dtype name from the wire back into a numpy dtype (bfloat16 via ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes  # optional; only reached when a peer sent bfloat16

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def describe(dtype: str, shape: Sequence[int]) -> str:
    return f"{dtype}[{', '.join(map(str, shape))}]"


class Waiters:
    """Threads blocked on the handles of one engine, and that engine, which they may
    drive (each :class:`Handle` is given its engine's: with threads as ranks in one
    process, as in tests, a handle drives its own rank's engine, never another's).

    A thread that waits first *drives* for up to ``RONDE_SPIN_TIME``: it runs the
    engine's next round and executes the agreed collectives itself
    (``Engine.progress``), polling between tries with the CPU and the GIL yielded,
    and only then sleeps on the handle's event while the engine's threads finish
    the work. A synchronous collective then costs no thread wake-ups at all. It does
    not poll while the executor thread is moving data (queued before it waited):
    that would take CPU and the GIL from the thread it is waiting for.
    """

    def __init__(self) -> None:
        self.engine: Engine | None = None
        #: threads of this process asleep on a handle right now (the engine's check for
        #: crossed collectives reads it: a rank counts as waiting only while one is)
        self.sleeping = 0

    def waiting(self) -> bool:
        """Whether a thread waits on a handle now (driving the engine, or asleep):
        shared-memory waits poll only then (``transport/shm/counters.py``)."""
        eng = self.engine
        return self.sleeping > 0 or (eng is not None and eng.spinners > 0)

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    def detach(self, engine: Engine) -> None:
        if self.engine is engine:
            self.engine = None

    def drive(self, handle: "Handle") -> bool:
        """Drive the engine until ``handle`` is done or the spin time passes; True if done."""
        eng = self.engine
        if eng is None:
            return False
        spin_s = eng.exchange.spin_s
        eng.spinner_enter()
        try:
            end = time.monotonic() + spin_s
            while not handle._done:
                if eng.progress():
                    end = time.monotonic() + spin_s
                    continue
                if not eng.executor.idle():
                    # the executor thread is moving data: spinning beside it would take
                    # CPU (and the GIL) from it; sleep until it completes the handle
                    break
                if time.monotonic() > end:
                    break
                os.sched_yield()  # releases the GIL too
        finally:
            eng.spinner_leave()
        return handle._done


#: guards every handle's completion against a waiter creating its event meanwhile
_DONE_LOCK = threading.Lock()


class Handle:
    """The pending result of an asynchronous collective.

    ``poll()`` says whether it finished; ``wait()`` blocks until it did and returns
    the result (or raises the error every rank saw). The event a thread sleeps on is
    made only when one has to sleep: most waits end while the caller drives.
    """

    __slots__ = ("_done", "_event", "_result", "_error", "name", "_callbacks", "_waiters")

    def __init__(self, name: str, waiters: Waiters | None = None) -> None:
        self.name = name
        #: the engine's waiters: a wait drives that engine first (None: it only sleeps)
        self._waiters = waiters
        self._done = False
        self._event: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Handle"], None]] | None = None

    def poll(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._done

    def _sleep(self, timeout: float | None) -> bool:
        with _DONE_LOCK:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
            waiters = self._waiters
            if waiters is not None:
                waiters.sleeping += 1
        try:
            return event.wait(timeout)
        finally:
            if waiters is not None:
                with _DONE_LOCK:
                    waiters.sleeping -= 1

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished; return the result or raise its error."""
        if not self._done:
            waiters = self._waiters
            if not ((waiters is not None and waiters.drive(self)) or self._sleep(timeout)):
                raise TimeoutError(
                    f"collective {self.name!r} did not finish within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        self._sleep(None)
        return self._error

    def _finish(self) -> None:
        with _DONE_LOCK:
            self._done = True
            event, callbacks, self._callbacks = self._event, self._callbacks, None
        if event is not None:
            event.set()
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a callback must not kill the engine
                import logging

                logging.getLogger(__name__).exception("done-callback of %r failed", self.name)

    def _set_result(self, value: Any) -> None:
        self._result = value
        self._finish()

    def _set_error(self, error: BaseException) -> None:
        with _DONE_LOCK:
            if self._done or self._error is not None:
                return
            self._error = error
        self._finish()

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(handle)`` when finished (from the engine thread; keep it short)."""
        with _DONE_LOCK:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def __repr__(self) -> str:
        return f"<Handle {self.name!r} {'done' if self.poll() else 'pending'}>"


class GroupOfHandles:
    """Several runtime handles as one; ``wait()`` returns the list of results."""

    def __init__(self, inners: Sequence[Any]) -> None:
        self.inners = list(inners)

    def poll(self) -> bool:
        """True once every handle finished."""
        return all(h.poll() for h in self.inners)

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Wait for every handle; the list of their results, in order."""
        return [h.wait(timeout) for h in self.inners]

    def exception(self) -> BaseException | None:
        """Wait, then return the first error or None."""
        for h in self.inners:
            exc = h.exception()
            if exc is not None:
                return exc
        return None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(self)`` once, when the last handle finished."""
        remaining = [len(self.inners)]
        lock = threading.Lock()

        def one(_h: Any) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                fn(self)

        if not self.inners:
            fn(self)
        for h in self.inners:
            h.add_done_callback(one)


class Request:
    """One collective call on one rank, as the engine sees it."""

    __slots__ = ("kind", "name", "array", "out", "alloc", "op", "root", "prescale",
                 "postscale", "splits", "ps_id", "handle", "finish", "dtype", "shape",
                 "t_submit", "t_announce", "device")

    def __init__(
        self,
        kind: Kind,
        name: str,
        array: np.ndarray | None,
        *,
        ps_id: int = 0,
        op: int = 0,
        root: int = -1,
        prescale: float = 1.0,
        postscale: float = 1.0,
        splits: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        alloc: Allocator | None = None,
        finish: Callable[["Request", Any], Any] | None = None,
        device: Any = None,
        device_meta: tuple[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.kind = kind
        self.name = name
        self.array = array
        self.out = out
        self.alloc = alloc
        self.op = int(op)
        self.root = root
        self.prescale = float(prescale)
        self.postscale = float(postscale)
        self.splits = None if splits is None else [int(s) for s in splits]
        self.ps_id = ps_id
        self.t_submit = self.t_announce = 0.0  # timeline stamps (microseconds)
        #: turns the engine's raw result into what the caller gets back
        self.finish = finish
        #: a framework tensor that stays on its accelerator (see DeviceBackend); then
        #: ``array`` is None and ``device_meta`` gives its (dtype name, shape)
        self.device = device
        if array is not None:
            self.dtype = dtype_name(array.dtype)
            self.shape = array.shape  # a tuple of Python ints already
        elif device_meta is not None:
            self.dtype, self.shape = device_meta[0], tuple(int(d) for d in device_meta[1])
        else:
            self.dtype, self.shape = "uint8", (0,)

    def meta(self) -> list[Any]:
        """The metadata every rank must agree on (plus per-rank sizes), for the wire."""
        return [int(self.kind), self.ps_id, self.dtype, list(self.shape), self.op, self.root,
                self.prescale, self.postscale, self.splits, 1 if self.device is not None else 0]

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if self.alloc is not None:
            return self.alloc(shape, dtype)
        return np.empty(shape, dtype=dtype)

    def complete(self, value: Any) -> None:
        if self.finish is not None:
            try:
                value = self.finish(self, value)
            except BaseException as exc:  # noqa: BLE001 - report to the caller
                self.handle._set_error(exc)
                return
        self.handle._set_result(value)

    def fail(self, error: BaseException) -> None:
        self.handle._set_error(error)


#: dtypes that may appear on the wire (anything else is refused before use)
WIRE_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                         "uint64", "float16", "float32", "float64", "bfloat16", "complex64",
                         "complex128"})


def fail_all(reqs: Sequence["Request | None"], exc: BaseException, what: str) -> None:
    """Fail every request of ``reqs`` (None: this rank is not a member) with ``exc``; an
    error that is not ronde's becomes a ``RondeError`` naming ``what`` and the request."""
    for req in reqs:
        if req is not None:
            req.fail(exc if isinstance(exc, RondeError) else RondeError(
                f"{what} {req.name!r} failed: {exc!r}"))


def _int(value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{value} is below {minimum}")
    if abs(value) > 2**62:
        raise ValueError(f"{value} is out of range")
    return value


class Meta:
    """Decoded metadata of one rank's request (see :meth:`Request.meta`)."""

    __slots__ = ("kind", "ps_id", "dtype", "shape", "op", "root", "prescale", "postscale",
                 "splits", "device")

    def __init__(self, raw: Sequence[Any]) -> None:
        from .._errors import ProtocolError

        if not isinstance(raw, (list, tuple)) or len(raw) != 10:
            raise ProtocolError("malformed request metadata from a peer")
        kind, ps_id, dtype, shape, op, root, pre, post, splits, device = raw
        try:
            self.kind = Kind(_int(kind))
            self.ps_id = _int(ps_id)
            if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
                raise ValueError(f"dtype {dtype!r}")
            self.dtype = dtype
            if not isinstance(shape, list) or len(shape) > 32:
                raise ValueError("shape")
            self.shape = tuple(_int(d, 0) for d in shape)
            self.op = _int(op)
            self.root = _int(root, -1)
            self.prescale = float(pre)
            self.postscale = float(post)
            if splits is not None and not isinstance(splits, list):
                raise ValueError("splits")
            self.splits = None if splits is None else tuple(_int(s, 0) for s in splits)
            self.device = _int(device, 0)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ProtocolError(f"malformed request metadata from a peer ({exc})") from None

    def key(self) -> tuple[Any, ...]:
        return (self.kind, self.ps_id, self.dtype, self.shape, self.op, self.root,
                self.prescale, self.postscale, self.splits, self.device)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * resolve_dtype(self.dtype).itemsize

    def describe(self) -> str:
        return describe(self.dtype, self.shape)
