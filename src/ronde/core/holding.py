"""Holding a round back until it is worth the wake-ups (``RONDE_ROUND_HOLD``).

Where it sits in the engine cycle: before the control thread (or a waiting caller)
starts a negotiation round for this rank's new announcements, ``Engine._hold`` asks
:class:`RoundHold` whether to wait instead.

Why: ranks reach a gradient bucket milliseconds apart (4 ranks on 2 cores: 1-5 ms).
Each one's announcement used to start a round that every rank had to join, up to N
rounds a bucket of which only the last completed it, and every round wakes every rank's
control thread (measured: 5.7 rounds a step for a 2-bucket transformer at np=4, 2.0
held). Now a round starts when it completes a collective or when every rank wants it:

* it completes one when, with what was announced in earlier rounds, every member of the
  collective's process set announces it (the negotiator's table says; exact, since
  every rank holds the same table);
* between ranks of one host, a rank that wants the next round stores its number in its
  mailbox's ``WANT`` word (``transport/mailbox.py``), fences, and reads its peers': the
  last one to want it sees every word and starts it (of two at once, the Dekker
  handshake makes at least one see the other);
* through a coordinator (``coordinator.py``), a member's frame is its "want": the
  coordinator looks at the frames buffered for the next round (left there for it) and
  starts the round (sends its *go* to the others) only once they complete something,
  or every member sent one and it has announcements too.

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
                 size: int) -> None:
        self.hold_s = hold_s
        self.negotiator = negotiator
        self.exchange = exchange
        self.size = size
        #: the round held (its number) and until when at most
        self.round = 0
        self.until = 0.0

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

    def decide(self, reqs: list[Request], next_round: int) -> bool:
        """Whether to hold ``next_round``, whose announcements of this rank are ``reqs``
        (:meth:`may_hold` said yes; nothing else is to be sent)."""
        neg, ex = self.negotiator, self.exchange
        if neg.shutdown or any(neg.joined.values()):
            return False
        mb = ex.mailboxes
        if mb is not None:
            return not neg.completes_any([(r.name, r.ps_id, 1) for r in reqs]) \
                and not mb.want(next_round, ex.gone)
        frames = ex.next_frames()
        if frames is None or (reqs and len(frames) == len(ex.linked())):
            return False  # a peer left or sent something else; or every rank wants it
        counts = self._announced_in(frames)
        if counts is None:
            return False
        for r in reqs:
            counts[r.name] = (r.ps_id, counts.get(r.name, (0, 0))[1] + 1)
        return not neg.completes_any((k, ps, n) for k, (ps, n) in counts.items())

    def _announced_in(self, frames: dict[int, bytes]) -> dict[str, tuple[int, int]] | None:
        """What the members' frames of the next round announce: name -> (process set,
        how many of them); None when one says anything else or names a tensor by name
        (not cached yet)."""
        decoder, expand = self.exchange.channels.decoder, self.negotiator.cache.expand
        counts: dict[str, tuple[int, int]] = {}
        try:
            for r, payload in frames.items():
                msg, _ = decoder.unpack(payload, r)
                if msg is protocol.SILENT:
                    continue
                if not msg.only_announces():
                    return None
                for a in msg.announced:
                    if type(a) is protocol.ByName:
                        return None
                    name, _, meta = expand(a.cid, r)
                    counts[name] = (meta.ps_id, counts.get(name, (0, 0))[1] + 1)
        except RondeError:  # the round itself reports it, on every rank
            return None
        return counts
