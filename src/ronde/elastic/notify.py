"""Host-change notices from the launcher, as a worker sees them.

Where it sits: in an elastic job (``ronderun --min-np/--max-np/--host-discovery-script``)
the launcher's driver announces every change of the host set with a timestamp and what
changed (:data:`ADDED`, :data:`REMOVED`, both). Each worker polls the launcher's
rendezvous service for the latest notice from a daemon thread, about once a second
(``RONDE_ELASTIC_POLL``), so that ``State.commit()`` costs no round trip: it reads
:func:`latest` and agrees with the other ranks on rank 0's view
(``State.check_host_updates``).
"""

from __future__ import annotations

import enum
import os
import threading
import time

NO_UPDATE, REMOVED, ADDED, MIXED = 0, 1, 2, 3


class HostUpdateResult(enum.IntFlag):
    """What changed in the host set (Horovod's names)."""

    no_update = NO_UPDATE
    removed = REMOVED
    added = ADDED
    mixed = MIXED


_lock = threading.Lock()
_latest: tuple[float, int] = (0.0, NO_UPDATE)
_poller: threading.Thread | None = None


def latest() -> tuple[float, int]:
    """The newest notice seen: ``(timestamp, update bits)``; ``(0, 0)`` if none."""
    _ensure_polling()
    with _lock:
        return _latest


def baseline() -> float:
    """The newest notice the running generation already reflects (the launcher formed
    it after that one: it and older ones need no reset); 0 outside elastic jobs."""
    from .. import _state

    rt = _state.current()
    return rt.wenv.notice if rt is not None else 0.0


def record(timestamp: float, update: int) -> None:
    """Take a notice (the poller, or a test)."""
    global _latest
    with _lock:
        if timestamp > _latest[0]:
            _latest = (timestamp, int(update))


_preempted = False


def preempted() -> bool:
    """This worker got SIGTERM (and leaves at the next commit)."""
    return _preempted


def watch_preemption() -> None:
    """In an elastic worker's main thread: the first SIGTERM asks this rank to leave at
    its next ``commit()`` (the other ranks see it there and re-form without it); a
    second one ends the process at once."""
    import signal

    if os.environ.get("RONDE_ELASTIC") != "1" \
            or threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum: int, frame: object) -> None:
        global _preempted
        if _preempted:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        _preempted = True

    signal.signal(signal.SIGTERM, on_term)


def any_preempted() -> bool:
    """Collective in an elastic job: whether any rank got SIGTERM (a max-allreduce);
    False at once outside elastic jobs."""
    if os.environ.get("RONDE_ELASTIC") != "1":
        return False
    import numpy as np

    from .. import _api
    from ..collectives.ops import ReduceOp

    if not _api.is_initialized() or _api.size() == 1:
        return _preempted
    got = _api.allreduce(np.array([1 if _preempted else 0], np.int32), op=ReduceOp.MAX,
                         name="ronde.elastic.leaving")
    return bool(got[0])


def tell_leaving() -> None:
    """Tell the launcher this worker leaves by itself (best effort)."""
    from ..runner import env as worker_env
    from ..runner.rendezvous import query

    wenv = worker_env.detect()
    if wenv.rendezvous and wenv.secret:
        query(wenv.rendezvous, wenv.secret, {"what": "leave", "host": wenv.host,
                                             "slot": wenv.slot})


def _ensure_polling() -> None:
    global _poller
    if _poller is not None or os.environ.get("RONDE_ELASTIC") != "1":
        return
    from ..runner import env as worker_env

    wenv = worker_env.detect()
    if not (wenv.rendezvous and wenv.secret):
        return
    with _lock:
        if _poller is not None:
            return
        _poller = threading.Thread(target=_poll, args=(wenv.rendezvous, wenv.secret),
                                   name="ronde-elastic-notices", daemon=True)
        _poller.start()


def _poll(address: tuple[str, int], secret: bytes) -> None:
    from ..runner.rendezvous import query

    from .._config import load

    period = load().elastic_poll_s
    while True:
        reply = query(address, secret, {"what": "hosts"})
        if reply is not None and isinstance(reply.get("timestamp"), (int, float)):
            record(float(reply["timestamp"]), int(reply.get("update") or 0))
        time.sleep(period)
