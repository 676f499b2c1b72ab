"""Moving one negotiation round's frames between this rank and its peers.

Where it sits in the engine cycle: the thread driving a round (the control thread,
or a caller waiting on a handle, see ``engine.py``) packs its frame and calls
:meth:`Exchange.run`, which sends it to every live peer and returns one frame from
each. Same-host peers exchange through shared-memory mailboxes
(``transport/mailbox.py``); other peers over their authenticated control socket,
full duplex. Every peer's socket also carries what the mailboxes cannot: doorbells
that wake a sleeping peer, frames too large for a slot, failure notices, and EOF
when the peer dies.

Sleeping and doorbells. A peer posting a frame sends a doorbell only when this process
looks asleep (its mailbox ``sleeping`` flag). The flag is up while at least one thread
sleeps in ``select`` on the control sockets, ready to handle a post: the control thread
in its normal sleep, or a round's driver waiting for a frame. Such a thread raises
it, fences and looks at the mailboxes once more before it sleeps
(:meth:`Exchange.before_block`, the Dekker handshake of ``mailbox.py``) and lowers it
when the last sleeper wakes (:meth:`Exchange.after_block`). Threads that merely poll
(callers spinning in ``wait()``) are not rung while they poll; the control thread stays
out of their way meanwhile and looks every ``RONDE_CYCLE_TIME``. While one polls it
also *covers* the control thread's idle sleep (:meth:`Exchange.cover`): the flag
counts only the other sleepers (a round's driver waiting for frames), so a peer posting
the round that the poller is about to take does not ring (a socket write there, a
thread woken here for nothing: about 25 Python calls a training step). The poller's
last look on leaving raises the flag again, fences and looks at the mailboxes
(``Engine.spinner_leave``): a post it missed is handed on then.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, Container

from .._config import Config
from .._errors import PeerLostError
from ..transport import mailbox, ready, wire
from . import coordinator, protocol, tree
from .channels import Channels, Links, Wait



class Exchange:
    """The control sockets and mailboxes of one engine, and who is awake to read them."""

    def __init__(self, rank: int, size: int, ctl_socks: dict[int, socket.socket],
                 mailboxes: "mailbox.Mailboxes | None", cfg: Config,
                 describe_rank: Callable[[int], str], links: Links | None = None) -> None:
        self.rank = rank
        self.size = size
        self.cfg = cfg
        #: the control sockets to the peers (shared with the coordinator's and the tree's
        #: rounds: ``channels.py``)
        self.channels = Channels(rank, size, ctl_socks, cfg, describe_rank, links)
        self.mailboxes = mailboxes
        #: rounds go through rank 0 (``coordinator.py``) instead of all-to-all (decided
        #: alike on every rank by ``_cores.coordinated``, which sets ``coordinator_min``
        #: to 0 where not)
        self.coordinated = (cfg.coordinator_min > 0 and self.size >= cfg.coordinator_min
                            and mailboxes is None)
        #: ... and over a binomial tree of relays (``tree.py``) until a rank shuts down
        self.over_tree = self.coordinated and tree.wanted(cfg, size)
        #: what this rank watches between rounds while the tree holds: its neighbours
        #: only (rank 0 is not woken by, and does not poll, N - 1 sockets)
        self._tree_peers = tree.neighbours(rank, size) if self.over_tree else []
        self.spin_s = cfg.spin_time_us / 1e6
        #: the live peers split into (local, remote), by how many ranks have left
        self._split: tuple[int, frozenset[int], list[int]] = (-1, frozenset(), [])
        self._sleep_lock = threading.Lock()
        self._sleepers = 0  #: threads asleep in ``select``, ready to handle a post
        self._idle = 0  #: of those, the control thread's idle sleep (``Engine._sleep``)
        self._covered = 0  #: callers polling, who take the idle sleep's part (``cover``)

    # -- state seen by the driver ---------------------------------------------------------
    @property
    def gone(self) -> set[int]:
        """The ranks that shut down and left."""
        return self.channels.gone

    def linked(self) -> list[int]:
        """The live ranks this rank holds a control socket to (over the tree: its
        neighbours there)."""
        if self.over_tree:
            return self._tree_peers
        return self.channels.connected()

    def set_spin(self, spin_s: float) -> None:
        """A new ``RONDE_SPIN_TIME`` (autotune)."""
        self.spin_s = spin_s

    def _end_tree(self, leaving: int, failed: Callable[[], BaseException | None]) -> None:
        """Ranks of ``leaving`` (a bit mask) announced their shutdown in a round over the
        tree: from the next round on, every rank alike, rounds go through the star. Its
        control sockets open now, before any rank can start that round (a member's frame
        on a socket rank 0 does not watch would wait for nothing): each member connects
        to rank 0, which waits for every one. Not when every rank is leaving."""
        self.over_tree = False
        if leaving == (1 << self.size) - 1 or not self.channels.can_link:
            return
        if self.rank == 0:
            shut = {r for r in range(self.size) if leaving >> r & 1}
            self.channels.await_members(shut, failed)
        else:
            self.channels.reader(0, set(), failed)

    def peer_started(self, rounds_done: int) -> bool:
        """Whether a peer has started the next round (or closed its socket)."""
        readers = self.channels.readers  # ``linked()`` inlined: this runs at every poll
        for r in self._tree_peers if self.over_tree else self.channels.connected():
            rd = readers[r]
            if rd.eof or (rd.buf and rd.has_frame()):
                return True
        mb = self.mailboxes
        return mb is not None and mb.ahead(rounds_done, self.channels.gone)

    def coordinates(self) -> bool:
        """Whether rounds go through a coordinator (not over the tree) and this rank is
        it (``coordinator.py``)."""
        return (self.coordinated and not self.over_tree
                and coordinator.coordinator(self.channels) == self.rank)

    def next_frames(self, known: Container[int]) -> dict[int, bytes] | None:
        """The coordinator's look at the next round: the frames its members sent for it
        already (left buffered for the round), by rank, but for the ``known`` ranks'
        (seen at an earlier look: a member sends one frame a round); None when a peer's
        socket closed or holds anything but a round frame (the round handles it)."""
        out: dict[int, bytes] = {}
        readers = self.channels.readers
        for r in self.linked():
            rd = readers[r]
            if rd.eof:
                return None
            if r in known:
                continue
            got = rd.peek_frame()
            if got is not None:
                if got[0] != protocol.KIND_ROUND:
                    return None
                out[r] = got[1]
        return out

    def sockets(self) -> list[socket.socket]:
        return [self.channels.readers[r].sock for r in self.linked()]

    def fill(self, sock: socket.socket) -> None:
        """Read what a socket that ``select`` found readable holds (hold the drive lock)."""
        self.channels.readers[self.channels.rank_of(sock)].fill()

    # -- sleeping and doorbells -----------------------------------------------------------
    def before_block(self, rounds_done: int, idle: bool = False) -> bool:
        """A thread is about to sleep in ``select`` on the control sockets: count it as
        a sleeper (peers ring while there is one; ``idle``: the control thread's idle
        sleep, which a polling caller covers), fence, and look once more. True when a
        same-host peer has already posted a round after ``rounds_done``: the caller
        must not sleep on it. Pair with :meth:`after_block`."""
        mb = self.mailboxes
        if mb is None:
            return False
        with self._sleep_lock:
            self._sleepers += 1
            self._idle += idle
            mb.set_sleeping(self._sleepers > (self._idle if self._covered else 0))
        mailbox.fence()
        return mb.ahead(rounds_done, self.channels.gone)

    def after_block(self, idle: bool = False) -> None:
        mb = self.mailboxes
        if mb is None:
            return
        with self._sleep_lock:
            self._sleepers -= 1
            self._idle -= idle
            mb.set_sleeping(self._sleepers > (self._idle if self._covered else 0))

    def cover(self, polling: bool) -> None:
        """A caller starts (``polling``) or stops polling the mailboxes for the control
        thread (module docstring). On stopping, the flag goes up again where the control
        thread sleeps, then a fence: the caller looks at the mailboxes after this."""
        mb = self.mailboxes
        if mb is None:
            return
        with self._sleep_lock:  # peers ring for a sleeper that no poller covers
            self._covered += 1 if polling else -1
            rung = self._sleepers > (self._idle if self._covered else 0)
            mb.set_sleeping(rung)
        if rung and not polling:
            mailbox.fence()

    # -- one round ------------------------------------------------------------------------
    def run(self, round_no: int, payload: bytes, messages: list[protocol.RoundMessage],
            blobs: list[bytes], failed: Callable[[], BaseException | None],
            shut_down: set[int]) -> None:
        """Send ``payload`` as this rank's frame of ``round_no`` to every live peer and
        read one frame from each into ``messages``/``blobs``. A peer's frame that is
        byte for byte this rank's (a training step's round: every rank announces the
        same cache ids) is this rank's message, not decoded again."""
        if self.coordinated:
            if self.over_tree and (shut_down or self.gone):
                self.over_tree = False
            if self.over_tree:
                leaving = tree.run(self.channels, payload, messages, blobs, failed)
                if leaving:
                    self._end_tree(leaving, failed)
            else:
                coordinator.run(self.channels, round_no, payload, messages, blobs, failed,
                                shut_down)
            return
        mb = self.mailboxes
        ch = self.channels
        if self._split[0] != len(ch.gone):  # ranks only leave: recomputed when one does
            live = ch.live()
            self._split = (len(ch.gone),
                           frozenset(r for r in live if mb is not None and r in mb.peers),
                           [r for r in live if mb is None or r not in mb.peers])
        _, local, remote = self._split
        # the socket frame (a copy of the payload) only when some peer needs it
        frame = (wire.encode_frame(protocol.KIND_ROUND, payload)
                 if remote or (local and len(payload) > mailbox.SLOT_BYTES) else b"")
        to_send = {r: memoryview(frame) for r in remote} if remote else {}
        via_socket = set(remote)  # peers whose frame this round comes over the socket
        if local:
            assert mb is not None
            if mb.post(round_no, payload):
                mailbox.fence()
                for r in mb.sleepers():
                    if r in local:
                        to_send[r] = memoryview(protocol.DOORBELL)
            else:
                for r in local:
                    to_send[r] = memoryview(frame)
        to_recv = set(local)
        to_recv.update(remote)
        own = messages[self.rank], blobs[self.rank]
        wait: Wait | None = None  # made once the first look did not find every frame
        spin_until = 0.0
        polls = 0
        while to_send or to_recv:
            for r in list(to_recv):
                got = self._take(r, round_no, via_socket)
                if got is not None:
                    to_recv.discard(r)
                    if got == payload:
                        messages[r], blobs[r] = own
                        continue
                    messages[r], blobs[r] = ch.decoder.unpack(got, r)
                    ch.check_notice(messages[r], r)
            if not (to_send or to_recv):
                break
            if wait is None:
                wait = Wait(ch, failed)
                spin_until = wait.start + self.spin_s
            polls += 1
            spinning = time.monotonic() < spin_until
            if spinning and not to_send and polls % 16:
                os.sched_yield()  # a same-host peer answers within microseconds
                continue
            rlist = [ch.readers[r].sock for r in to_recv]
            wlist = [ch.readers[r].sock for r in to_send]
            timeout = 0.0 if spinning else 0.5
            sleeping = not spinning and bool(to_recv & local)
            if sleeping and self.before_block(round_no - 1):
                timeout = 0.0
            try:
                readable, writable = ready.wait(rlist, wlist, timeout)
            finally:
                if sleeping:
                    self.after_block()
            ch.send_some(writable, to_send)
            for s in readable:
                r = ch.rank_of(s)
                reader = ch.readers[r]
                reader.fill()
                if reader.eof and not reader.has_frame():
                    if self._posted(r, round_no, via_socket):
                        continue  # its last frame (say, its shutdown) is taken first
                    ch.peer_closed(r, shut_down)
                    to_recv.discard(r)
                    to_send.pop(r, None)
            wait.check(to_recv)

    def _take(self, r: int, round_no: int, via_socket: set[int]) -> bytes | None:
        """Peer ``r``'s frame for this round if it has arrived."""
        reader = self.channels.readers[r]
        if r in via_socket:
            return reader.pop()
        early = reader.peek() if reader.buf else None  # before the mailbox says "on the
        if early is not None:  # socket": only a notice
            self.channels.check_notice(protocol.unpack_round(early, r)[0], r)
        got = self.mailboxes.take(r, round_no)  # type: ignore[union-attr]
        if got is None:
            return None
        if got == mailbox.ON_SOCKET:
            via_socket.add(r)
            return reader.pop()
        return got  # type: ignore[return-value]

    def _posted(self, r: int, round_no: int, via_socket: set[int]) -> bool:
        """Whether peer ``r``'s frame for this round waits in its mailbox: a peer posts
        its last round, then exits, and its socket's EOF can be seen first."""
        mb = self.mailboxes
        return (r not in via_socket and mb is not None and r in mb.peers
                and mb.take(r, round_no) is not None)

    # -- failure and the end --------------------------------------------------------------
    def tell_peers(self, exc: PeerLostError) -> None:
        """Before leaving, tell every live peer which rank was lost (``Channels``)."""
        self.channels.tell_peers(exc)

    def close_sockets(self) -> None:
        self.channels.close_sockets()

    def close(self) -> None:
        if self.mailboxes is not None:
            self.mailboxes.close()
