"""The elastic reset loop behind every binding's ``hvd.elastic.run``.

Where it sits: the decorated training function runs inside :func:`run_fn`. When a peer
is lost, every survivor's pending collective raises
:class:`~ronde.HorovodInternalError` (a :class:`~ronde.PeerLostError` naming the lost
rank); the loop restores the last commit, re-forms the job (``shutdown()`` then
``init()`` in this process: the launcher hands out the new ranks, survivors first, in
their old order), runs the state's reset callbacks and syncs the state from the new
rank 0, then calls the function again. A :class:`~ronde.HostsUpdatedInterrupt` (hosts
added or removed, raised at the same ``commit()`` on every rank) re-forms the job the
same way, keeping the uncommitted progress.

Fixed here, where Horovod goes wrong: whether to sync after a reset is decided by every
rank together (a max-allreduce of "I need it"), so ranks that came back for different
reasons, and ranks that just joined, never disagree on it (horovod#3494: survivors below
``--min-np`` that recovered deadlocked in ``sync``). Errors that a reset cannot cure
(mismatched shapes, a duplicate name, a rank that returned early) are not retried: they
end the job with their own message.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Callable, TypeVar

from .._errors import (HorovodInternalError, HostsUpdatedInterrupt, PeerLostError, RondeError,
                       WorkerRemovedError)
from .state import State

log = logging.getLogger("ronde")

F = TypeVar("F", bound=Callable[..., Any])


def as_ronde_error(exc: BaseException) -> RondeError | None:
    """``exc`` as the ronde error behind it, or None: a framework may wrap ronde's error
    in its own (TensorFlow turns an exception inside a graph's Python op into an
    ``UnknownError`` whose message names it; JAX one inside a host callback into a
    ``ValueError`` whose text is the traceback), or chain it."""
    seen = exc
    while seen is not None:
        if isinstance(seen, RondeError):
            return seen
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    if _raised_last(text) == "PeerLostError" and (
            type(exc).__module__.startswith(("tensorflow", "jax"))
            or "CpuCallback error" in text):
        # (JAX's host callbacks raise a ValueError with the traceback as its text)
        return PeerLostError(text)
    return None


#: an exception's line in a traceback's text: ``[module.]Name: message`` (or ``Name``
#: alone), possibly behind TensorFlow's ``{{function_node ...}}`` prefix or another
#: error's ``...: `` (older jaxlib: ``INTERNAL: ... CpuCallback error: PeerLostError: ...``)
_RAISED = re.compile(r"(?:^|\}\} |: )(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception))(?::|$)")


def _raised_last(text: str) -> str | None:
    """The class name of the last exception a traceback's text shows (the one raised:
    a ``PeerLostError`` met while handling, or in a message, is not), or None."""
    last = None
    for line in text.splitlines():
        found = _RAISED.search(line)
        if found and not line[:1].isspace():
            last = found.group(1)
    return last


def resettable(exc: BaseException) -> bool:
    """Whether re-forming the job can cure ``exc``: a lost peer, or Horovod's plain
    ``HorovodInternalError`` (what a script raises to ask for a reset). Its subclasses
    that name a bug (a mismatch, a duplicate name, a shutdown) are not."""
    return isinstance(exc, PeerLostError) or type(exc) is HorovodInternalError


def reset() -> None:
    """Re-form the job: shut ronde down here and initialise again (the launcher's
    elastic rendezvous hands out the new rank and size), then add again the process
    sets the job had, as the same objects, where their ranks still exist (horovod#4021:
    they were lost). A rank that joins adds its own at ``init(process_sets=...)``, in
    the order the script gives; survivors add theirs in the order they had them."""
    from .. import _api, process_sets

    kept = list(dict.fromkeys(_carried + process_sets.added()))
    _carried[:] = kept  # a set that spans the whole job for a while is kept for later
    _api.shutdown()
    _api.init()
    size = _api.size()
    for ps in kept:
        ranks = ps.ranks or []
        if ranks == list(range(size)):
            ps.as_global(ranks, _api.rank())  # the whole job now: the global set
        elif ranks and ranks[-1] < size:
            _api.add_process_set(ps)
        else:
            log.warning("ronde elastic: process set %s dropped: the job now has %d ranks",
                        ranks, size)


#: process sets this worker carries across resets (see :func:`reset`)
_carried: list[Any] = []


def run_fn(func: F, reset: Callable[[], None] | None = None) -> F:
    """``func(state, *args, **kwargs)`` run elastically (see the module docstring);
    ``reset`` re-forms the job (default: this module's :func:`reset`)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        from . import notify
        from .. import _api

        notify.latest()  # start watching for host changes now
        notify.watch_preemption()
        limit = _reset_limit()
        resets = 0
        need_sync = True
        while True:
            try:
                if _agree_on_sync(need_sync):
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                if notify.preempted():
                    _leave()
                need_sync = not exc.skip_sync
                why = "hosts changed"
            except Exception as raised:
                exc = as_ronde_error(raised)
                if exc is None or not resettable(exc):
                    raise
                state.restore()
                need_sync = True
                why = f"{type(exc).__name__}: {exc}"
            resets += 1
            if limit is not None and resets > limit:
                raise RondeError(f"elastic: {resets} resets exceed the reset limit of {limit} "
                                 "(--reset-limit / RONDE_RESET_LIMIT); the last was: "
                                 f"{why}") from None
            log.warning("ronde elastic: rank %d resets (%s)", _api.rank(), why)
            try:
                (reset or _reset_default)()
            except WorkerRemovedError as exc:
                log.warning("ronde elastic: %s; this worker ends", exc)
                raise SystemExit(0) from None
            state.on_reset()
            need_sync = need_sync or bool(getattr(state, "sync_after_reset", False))

    return wrapper  # type: ignore[return-value]


def _leave() -> None:
    """This rank was asked to stop (SIGTERM) and every rank has seen it at this commit:
    tell the launcher (a removal, not a failure), shut down, exit with code 0."""
    from .. import _api
    from . import notify

    log.warning("ronde elastic: rank %d leaves the job (SIGTERM), its state committed",
                _api.rank())
    notify.tell_leaving()
    _api.shutdown()
    raise SystemExit(0)


def _reset_default() -> None:
    reset()  # looked up at call time (tests replace it)


def _agree_on_sync(mine: bool) -> bool:
    """Every rank's vote, max-reduced: sync if any rank needs it (a new rank always
    does: its first call comes here with ``need_sync`` true)."""
    import numpy as np

    from .. import _api
    from ..collectives.ops import ReduceOp

    if _api.size() == 1:
        return mine
    got = _api.allreduce(np.array([1 if mine else 0], np.int32), op=ReduceOp.MAX,
                         name="ronde.elastic.sync_vote")
    return bool(got[0])


def _reset_limit() -> int | None:
    from .._config import load

    return load().reset_limit or None
