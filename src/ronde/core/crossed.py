"""Crossed collectives: every rank waits for a collective that another never submitted.

Where it sits in the engine cycle: each rank's control thread asks its
:class:`WaitWatch` every 0.25 s whether the rank is only *waiting*: a thread sleeps on a
collective's handle, nothing was submitted or completed for ``RONDE_DEADLOCK_TIME``, and
the process used almost no CPU meanwhile (a thread still computing may yet submit what
the others wait for). Then the rank says so once in its next round frame (``RoundMessage.waiting``: the
negotiator's progress count it saw). Every rank's :class:`~.negotiation.Negotiator` applies
:func:`responses` to each round: once every rank is waiting (or shut down) while
collectives are pending, none of them can ever complete, and the same pending entries fail
on every rank with :class:`~ronde.DeadlockError`, instead of the job waiting for the stall
inspector's far longer limits. Nothing of this runs, and no round is sent, while the
ranks make progress.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .protocol import RoundMessage
from .requests import KIND_NAMES, Kind
from .responses import Response

if TYPE_CHECKING:
    from .negotiation import Negotiator, _Entry
    from .requests import Waiters


class WaitWatch:
    """One rank's view: since when it has only been waiting, and at what CPU time."""

    def __init__(self, limit_s: float, waiters: Waiters) -> None:
        self.limit_s = limit_s
        #: the engine's waiters: the rank counts as waiting only while one sleeps
        self._waiters = waiters
        #: (since, process CPU time then, negotiator progress then), or None
        self._mark: tuple[float, float, int] | None = None

    def check(self, now: float, pending: bool, quiet_since: float,
              progress: int) -> int | None:
        """The progress count to report as waiting, or None (not waiting, or not yet).

        Args:
            now: ``time.monotonic()``.
            pending: the rank has collectives in flight (and no failure).
            quiet_since: when this rank last submitted anything.
            progress: the negotiator's count of rounds that produced a response.
        """
        if self.limit_s <= 0:
            return None
        mark = self._mark
        if not pending or self._waiters.sleeping <= 0:
            self._mark = None
            return None
        if mark is None or mark[2] != progress or quiet_since > mark[0]:
            self._mark = (now, time.process_time(), progress)
            return None
        elapsed = now - mark[0]
        if elapsed < self.limit_s:
            return None
        busy_cpu = time.process_time() - mark[1]
        self._mark = (now, time.process_time(), progress)
        return progress if busy_cpu < 0.2 * elapsed else None


def ps_request_name(action: str, key: tuple[int, ...]) -> str:
    """The name a rank's add/remove_process_set request waits under (see _api)."""
    return f"process_set.add.{list(key)}" if action == "add" else f"process_set.{action}.{key[0]}"


def responses(neg: "Negotiator", messages: list[RoundMessage],
              out: list[Response]) -> list[Response]:
    """Crossed collectives: fail pending entries once every rank is only waiting.

    A rank's ``waiting`` (it has slept on a handle for ``RONDE_DEADLOCK_TIME`` with nothing
    submitted or completed and its CPU idle) holds until a round produces any
    response or the rank announces something; it counts only if it was sent knowing
    every response so far (its value is the ``progress`` count it saw). When every
    rank is waiting or has shut down, twice in a row with no response between (each
    rank reports again a ``RONDE_DEADLOCK_TIME`` after its first report, and does not
    if it started computing meanwhile), none of the pending collectives can ever be
    completed: their missing ranks are all blocked elsewhere. Every rank sees the
    same frames and fails the same entries: those that are not barriers first (a
    rank that went on to a barrier, as a test's ``tearDown`` does, is where the
    others should arrive once their collective failed), the barriers only when
    nothing else is left.
    """
    if neg.waiting:
        for rank, msg in enumerate(messages):
            if msg.moves():
                neg.waiting.discard(rank)
    if out:
        neg.progress += 1
        neg.waiting.clear()
        neg.waiting_armed = False
        return []
    for rank, msg in enumerate(messages):
        if msg.waiting is not None and msg.waiting == neg.progress and not msg.moves():
            neg.waiting.add(rank)
    if not (neg.entries or neg.ps_votes) \
            or len(neg.waiting | neg.shutdown) < neg.size:
        return []
    if not neg.waiting_armed:
        # the first time every rank said so: ask each for a second report (a rank whose
        # thread started computing meanwhile, or whose wait ended, does not send it)
        neg.waiting_armed = True
        neg.waiting.clear()
        return []
    entries = sorted(neg.entries.values(), key=lambda e: e.order)

    def kind_of(e: "_Entry") -> Kind:
        return next(iter(e.metas.values())).kind

    # (what, name, ranks that submitted it, ranks that did not)
    pending: list[tuple[str, str, list[int], list[int], bool]] = []
    for e in entries:
        members = neg.process_sets.get(next(iter(e.metas.values())).ps_id, [])
        pending.append((KIND_NAMES[kind_of(e)], e.name, sorted(e.metas),
                        [r for r in members if r not in e.metas],
                        kind_of(e) != Kind.BARRIER))
    for (action, key), voters in neg.ps_votes.items():
        pending.append((f"{action}_process_set", ps_request_name(action, key),
                        sorted(voters), [r for r in range(neg.size) if r not in voters],
                        True))
    waits: dict[int, list[str]] = {}
    for what, name, ready, _, _ in pending:
        for r in ready:
            waits.setdefault(r, []).append(f"{what} {name!r}")
    where = "; ".join(f"rank {r} waits in {', '.join(w[:3])}"
                      + (f" (+{len(w) - 3} more)" if len(w) > 3 else "")
                      for r, w in sorted(waits.items()))
    victims = [p for p in pending if p[4]] or pending
    failed = []
    for what, name, ready, missing, _ in victims:
        absent = ", ".join(map(str, missing))
        message = (f"{what} {name!r} can never complete: rank(s) {absent} did not "
                   f"submit it, and every rank is waiting ({where}); the ranks have fallen "
                   "out of step (an exception, an early return or another branch on some "
                   "rank). Every rank must call the same collectives in the same order "
                   "(join() for uneven data); RONDE_DEADLOCK_TIME sets how long ranks wait "
                   "before this error")
        entry = neg.entries.get(name)
        if entry is not None:
            failed.append(neg.fail_entry(entry, message, "deadlock"))
        else:
            for key in [k for k in neg.ps_votes if ps_request_name(*k) == name]:
                del neg.ps_votes[key]
            failed.append(Response(Kind.BARRIER, 0, [name], [{}], error=message,
                                   error_type="deadlock"))
    neg.progress += 1
    neg.waiting.clear()
    neg.waiting_armed = False
    return failed

