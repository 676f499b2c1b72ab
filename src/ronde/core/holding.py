"""Holding a round back until it is worth the wake-ups (``RONDE_ROUND_HOLD``).

Where it sits in the engine cycle: before the control thread (or a waiting caller)
starts a negotiation round for this rank's new announcements, ``Engine._hold`` asks
:class:`RoundHold` whether to wait instead.

Why: ranks reach a gradient bucket milliseconds apart (4 ranks on 2 cores: 1-5 ms).
Each one's announcement used to start a round that every rank had to join, up to N
rounds a bucket of which only the last completed it, and every round wakes every rank's
control thread (measured: 5.7 rounds a step for a 2-bucket transformer at np=4, 2.0
held). Now a round starts only when it may complete a collective that it carries: every
member of the collective's process set announced it in an earlier round (the
negotiator's table, the same on every rank) or *wants* this round:

* between ranks of one host, a rank that wants the next round stores its number in its
  mailbox's ``WANT`` word (``transport/mailbox.py``), fences, and reads its peers'; of
  two ranks wanting it at once, the Dekker handshake makes at least one see the other,
  so the last member to want it starts it;
* through a coordinator (``coordinator.py``), a member's frame is its "want" (once sent,
  a member cannot add to it): the coordinator looks at the frames buffered for the next
  round (left there for the round) and starts it (sends its *go* to the others) once a
  collective in them, or in its own announcements, has every member covered.

Per collective, not per job: two ranks of a process set reach their collective while a
third rank, outside it, wants nothing, and their round starts.

The one case the hold's deadline is for, through a coordinator: a member is committed to
its frame, so when one of its threads sits in the round while another thread of the same
rank holds what the others wait for, nothing of the frames covers a collective until
the hold runs out (``RONDE_ROUND_HOLD``).

Nothing is delayed by it: what is held cannot complete before the rank that does not
want the round yet announces. Never held: anything but announcements to send (joins,
process sets, aborts, stacks, shutdown), a peer's socket closed or its frame not a
round's, a joined or shut-down rank, a name not in the response cache yet (a round of
new names), peers across hosts without a coordinator, a round a peer started already;
and at most ``RONDE_ROUND_HOLD`` ms a round whatever happens, so that a mistake here
costs time, never progress.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import RondeError
from . import protocol
from .requests import Request

if TYPE_CHECKING:
    from .exchange import Exchange
    from .negotiation import Negotiator


class RoundHold:
    """One engine's decision to hold its next round (see the module docstring)."""

    def __init__(self, hold_s: float, negotiator: "Negotiator", exchange: "Exchange",
                 rank: int, size: int) -> None:
        self.hold_s = hold_s
        self.rank = rank
        self.negotiator = negotiator
        self.exchange = exchange
        self.size = size
        #: the round held (its number) and until when at most
        self.round = 0
        self.until = 0.0
        #: the round :meth:`decide` held through the mailboxes (see :meth:`settled`)
        self._decided = 0
        self._wanted = 0  #: the round this rank's ``WANT`` word holds
        #: the coordinator: what each member's frame of round ``_seen_round`` announces
        self._seen_round = 0
        self._seen: dict[int, frozenset[tuple[str, int]] | None] = {}

    def holding(self, next_round: int, now: float) -> bool:
        """Whether ``next_round`` is being held now (the control thread then sleeps
        until :attr:`until`, a peer starts it, or a submission arrives)."""
        return self.round == next_round and now < self.until

    def may_hold(self, next_round: int, started: bool, now: float) -> bool:
        """Whether this rank's place and the clock allow holding ``next_round``: same-host
        mailboxes for every peer (and no peer started it), or this rank coordinates; and
        its ``RONDE_ROUND_HOLD`` not spent."""
        if not self.hold_s:
            return False
        ex = self.exchange
        mb = ex.mailboxes
        if mb is not None:
            if started or len(mb.peers) != self.size - 1:
                return False
        elif not ex.coordinates():
            return False
        if self.round != next_round:
            self.round, self.until = next_round, now + self.hold_s
            return True
        return now < self.until

    def settled(self, next_round: int) -> bool:
        """Whether :meth:`decide` held ``next_round`` through the mailboxes already: it
        need not look again until this rank submits more, since a peer that wants the
        round later sees this rank's ``WANT`` and starts it itself (the coordinator's
        answer changes with each member frame that arrives: it looks again each time)."""
        return self._decided == next_round

    def want(self, next_round: int) -> None:
        """Say through the mailboxes that this rank wants ``next_round`` without starting
        it (a submission its caller drives soon: ``Engine.waited_by``): a peer that wants
        it too starts it then."""
        mb = self.exchange.mailboxes
        if self.hold_s and mb is not None and len(mb.peers) == self.size - 1:
            mb.want(next_round)
            self._wanted = next_round

    def decide(self, reqs: list[Request], next_round: int) -> bool:
        """Whether to hold ``next_round``, whose announcements of this rank are ``reqs``
        (:meth:`may_hold` said yes; nothing else is to be sent)."""
        neg, ex = self.negotiator, self.exchange
        if neg.shutdown or any(neg.joined.values()):
            return False
        mb = ex.mailboxes
        if mb is not None:  # my announcements, the peers' WANT words
            ready = mb.wanting(next_round) if self._wanted == next_round \
                else mb.want(next_round)
            self._wanted = next_round
            ready.add(self.rank)
            if neg.any_covered([(r.name, r.ps_id) for r in reqs], ready):
                return False
            self._decided = next_round
            return True
        # the coordinator: what its members sent already, each frame read once a round
        # (it looks again at every frame that arrives: at np=8 it decoded each about
        # three times, a third of its control thread's calls)
        if self._seen_round != next_round:
            self._seen_round, self._seen = next_round, {}
        seen = self._seen
        frames = ex.next_frames(seen)
        if frames is None:
            return False  # a peer left or sent something else: the round handles it
        for r, payload in frames.items():
            seen[r] = self._announced_by(r, payload)
        announced: set[tuple[str, int]] = set()
        for got in seen.values():
            if got is None:
                return False
            announced.update(got)
        ready = set(seen)
        if reqs:
            ready.add(self.rank)
            announced.update((r.name, r.ps_id) for r in reqs)
        return not neg.any_covered(announced, ready)

    def _announced_by(self, r: int, payload: bytes) -> frozenset[tuple[str, int]] | None:
        """What member ``r``'s frame of the next round announces, (name, process set);
        None when it says anything else or names a tensor by name (not cached yet)."""
        expand = self.negotiator.cache.expand
        try:
            msg, _ = self.exchange.channels.decoder.unpack(payload, r)
            if msg is protocol.SILENT:
                return frozenset()
            if not msg.only_announces():
                return None
            out = []
            for a in msg.announced:
                if type(a) is protocol.ByName:
                    return None
                name, _, meta = expand(a.cid, r)
                out.append((name, meta.ps_id))
        except RondeError:  # the round itself reports it, on every rank
            return None
        return frozenset(out)
