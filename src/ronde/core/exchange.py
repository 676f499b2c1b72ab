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
(callers spinning in ``wait()``) never touch it, so they are not rung while they poll;
the control thread stays out of their way meanwhile and looks every
``RONDE_CYCLE_TIME``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Protocol

from .._config import Config
from .._errors import PeerLostError
from ..transport import mailbox, ready, wire
from ..transport.mesh import LinkError
from . import coordinator, protocol, rounds, tree

log = logging.getLogger(__name__)


class Links(Protocol):
    """What the exchange uses of the mesh (``transport/mesh.py``): control sockets
    opened after ``init()`` (the coordinator's, after rank 0 left)."""

    def link(self, peer: int, chan: str = ..., timeout_s: float = ...,
             aborted: Callable[[], BaseException | None] = ...) -> socket.socket: ...

    def opened(self, peer: int, chan: str) -> socket.socket | None: ...

    def wait_opened(self, timeout_s: float) -> None: ...


class Exchange:
    """The control sockets and mailboxes of one engine, and who is awake to read them."""

    def __init__(self, rank: int, size: int, ctl_socks: dict[int, socket.socket],
                 mailboxes: "mailbox.Mailboxes | None", cfg: Config,
                 describe_rank: Callable[[int], str], links: Links | None = None) -> None:
        self.rank = rank
        self.cfg = cfg
        self.describe_rank = describe_rank
        #: the control sockets open (every peer's, or under the coordinator only rank 0's
        #: on a member: see transport/mesh.py); more come from ``links`` after a
        #: failover. Replaced, never changed in place: other threads iterate over it.
        self.readers = {r: rounds.FrameReader(s) for r, s in ctl_socks.items()}
        #: which rank each control socket joins (replaced with ``readers``)
        self._ranks_by_sock = {s: r for r, s in ctl_socks.items()}
        self._links = links
        #: :meth:`await_members` found every live rank connected (or gone) once
        self._members_linked = False
        self.decoder = protocol.Decoder()
        for s in ctl_socks.values():
            s.setblocking(False)
        self.mailboxes = mailboxes
        self.size = size
        #: every other rank of the job
        self.peers = [r for r in range(size) if r != rank]
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
        self.gone: set[int] = set()
        #: the start of the last wait whose slowness was logged (coordinator._checks)
        self.warned_wait = -1.0
        self.spin_s = cfg.spin_time_us / 1e6
        self._sleep_lock = threading.Lock()
        self._sleepers = 0

    # -- state seen by the driver ---------------------------------------------------------
    def live(self) -> list[int]:
        """The other ranks still in the job (whether or not a socket joins them)."""
        return [r for r in self.peers if r not in self.gone]

    def linked(self) -> list[int]:
        """The live ranks this rank holds a control socket to (over the tree: its
        neighbours there)."""
        if self.over_tree:
            return self._tree_peers
        return [r for r in self.readers if r not in self.gone]

    def reader(self, r: int, shut_down: set[int], failed: Callable[[], BaseException | None],
               ) -> "rounds.FrameReader | None":
        """The control socket to lower rank ``r`` (this rank's coordinator), opened if
        it is not yet (after rank 0 left: transport/mesh.py); None, and ``r`` gone, when
        ``r`` shut down and refuses the connection (it left too)."""
        reader = self.readers.get(r)
        if reader is not None or self._links is None:
            return reader
        try:
            sock = self._links.link(r, "ctl", self.cfg.start_timeout_s, failed)
        except LinkError as exc:
            if r not in shut_down:
                raise PeerLostError(f"rank {self.describe_rank(r)} (the negotiation "
                                    f"coordinator now) cannot be reached: {exc}",
                                    rank=r) from None
            self.gone.add(r)
            return None
        return self._add_reader(r, sock)

    def _add_reader(self, r: int, sock: socket.socket) -> "rounds.FrameReader":
        sock.setblocking(False)
        reader = rounds.FrameReader(sock)
        self.readers = {**self.readers, r: reader}
        self._ranks_by_sock = {**self._ranks_by_sock, sock: r}
        return reader

    def await_members(self, shut_down: set[int],
                      failed: Callable[[], BaseException | None]) -> None:
        """This rank coordinates now (rank 0 left): wait, under one deadline, until
        every live rank has connected; a rank that shut down and does not within
        ``RONDE_SHUTDOWN_TIMEOUT`` (the time it had to leave) is gone, any other one
        within ``RONDE_START_TIMEOUT`` is lost."""
        links = self._links
        if self._members_linked or links is None:
            return
        missing = [r for r in self.live() if r not in self.readers]
        start = time.monotonic()
        while missing:
            for r in list(missing):
                sock = links.opened(r, "ctl")
                if sock is not None:
                    self._add_reader(r, sock)
                    missing.remove(r)
            err = failed()
            if err is not None:
                raise err
            waited = time.monotonic() - start
            for r in list(missing):
                if r in shut_down and waited > self.cfg.shutdown_timeout_s:
                    self.gone.add(r)
                    missing.remove(r)
                elif r not in shut_down and waited > self.cfg.start_timeout_s:
                    raise PeerLostError(
                        f"rank {self.describe_rank(r)} did not connect to rank "
                        f"{self.rank}, the negotiation coordinator after rank 0 left, "
                        f"within {waited:.0f}s", rank=r)
            if missing:
                links.wait_opened(0.05)
        self._members_linked = True  # no rank joins later: one wait per coordinator

    def _end_tree(self, leaving: int, failed: Callable[[], BaseException | None]) -> None:
        """Ranks of ``leaving`` (a bit mask) announced their shutdown in a round over the
        tree: from the next round on, every rank alike, rounds go through the star. Its
        control sockets open now, before any rank can start that round (a member's frame
        on a socket rank 0 does not watch would wait for nothing): each member connects
        to rank 0, which waits for every one. Not when every rank is leaving."""
        self.over_tree = False
        if leaving == (1 << self.size) - 1 or self._links is None:
            return
        if self.rank == 0:
            shut = {r for r in range(self.size) if leaving >> r & 1}
            self.await_members(shut, failed)
        else:
            self.reader(0, set(), failed)

    def peer_started(self, rounds_done: int) -> bool:
        """Whether a peer has started the next round (or closed its socket)."""
        for r in self.linked():
            rd = self.readers[r]
            if rd.eof or rd.has_frame():
                return True
        mb = self.mailboxes
        return mb is not None and mb.ahead(rounds_done, self.gone)

    def sockets(self) -> list[socket.socket]:
        return [self.readers[r].sock for r in self.linked()]

    def fill(self, sock: Any) -> None:
        """Read what a socket that ``select`` found readable holds (hold the drive lock)."""
        self.readers[self._rank_of(sock)].fill()

    # -- sleeping and doorbells -----------------------------------------------------------
    def before_block(self, rounds_done: int) -> bool:
        """A thread is about to sleep in ``select`` on the control sockets: count it as
        a sleeper (peers ring while there is one), fence, and look once more. True
        when a same-host peer has already posted a round after ``rounds_done``: the
        caller must not sleep on it. Pair with :meth:`after_block`."""
        mb = self.mailboxes
        if mb is None:
            return False
        with self._sleep_lock:
            self._sleepers += 1
            mb.set_sleeping(True)
        mailbox.fence()
        return mb.ahead(rounds_done, self.gone)

    def after_block(self) -> None:
        mb = self.mailboxes
        if mb is None:
            return
        with self._sleep_lock:
            self._sleepers -= 1
            if not self._sleepers:
                mb.set_sleeping(False)

    # -- one round ------------------------------------------------------------------------
    def run(self, round_no: int, payload: bytes, messages: list[protocol.RoundMessage],
            blobs: list[bytes], failed: Callable[[], BaseException | None],
            shut_down: set[int]) -> None:
        """Send ``payload`` as this rank's frame of ``round_no`` to every live peer and
        read one frame from each into ``messages``/``blobs``."""
        if self.coordinated:
            if self.over_tree and (shut_down or self.gone):
                self.over_tree = False
            if self.over_tree:
                leaving = tree.run(self, payload, messages, blobs, failed)
                if leaving:
                    self._end_tree(leaving, failed)
            else:
                coordinator.run(self, round_no, payload, messages, blobs, failed, shut_down)
            return
        mb = self.mailboxes
        live = self.live()
        local = {r for r in live if mb is not None and r in mb.peers}
        remote = [r for r in live if r not in local]
        # the socket frame (a copy of the payload) only when some peer needs it
        frame = (wire.encode_frame(protocol.KIND_ROUND, payload)
                 if remote or (local and len(payload) > mailbox.SLOT_BYTES) else b"")
        to_send = {r: memoryview(frame) for r in remote}
        via_socket = set(remote)  # peers whose frame this round comes over the socket
        if local:
            assert mb is not None
            if mb.post(round_no, payload):
                mailbox.fence()
                for r in local.intersection(mb.sleepers()):
                    to_send[r] = memoryview(protocol.DOORBELL)
            else:
                for r in local:
                    to_send[r] = memoryview(frame)
        to_recv = set(live)
        start = time.monotonic()
        spin_until = start + self.spin_s
        polls = 0
        warned = False
        while to_send or to_recv:
            for r in list(to_recv):
                got = self._take(r, round_no, via_socket)
                if got is not None:
                    messages[r], blobs[r] = self.decoder.unpack(got, r)
                    to_recv.discard(r)
                    self._check_notice(messages[r], r)
            if not (to_send or to_recv):
                break
            polls += 1
            spinning = time.monotonic() < spin_until
            if spinning and not to_send and polls % 16:
                os.sched_yield()  # a same-host peer answers within microseconds
                continue
            rlist = [self.readers[r].sock for r in to_recv]
            wlist = [self.readers[r].sock for r in to_send]
            timeout = 0.0 if spinning else 0.5
            sleeping = not spinning and bool(to_recv & local)
            if sleeping and self.before_block(round_no - 1):
                timeout = 0.0
            try:
                readable, writable = ready.wait(rlist, wlist, timeout)
            finally:
                if sleeping:
                    self.after_block()
            self._send_some(writable, to_send)
            for s in readable:
                r = self._rank_of(s)
                reader = self.readers[r]
                reader.fill()
                if reader.eof and not reader.has_frame():
                    if self._posted(r, round_no, via_socket):
                        continue  # its last frame (say, its shutdown) is taken first
                    self.peer_closed(r, shut_down)
                    to_recv.discard(r)
                    to_send.pop(r, None)
            err = failed()
            if err is not None:
                raise err
            waited = time.monotonic() - start
            if not warned and waited > self.cfg.peer_timeout_s and to_recv:
                warned = True
                log.warning("rank %d: rank(s) %s have not answered a negotiation round for "
                            "%.0fs; is their Python process blocked?", self.rank,
                            sorted(to_recv), waited)
            limit = self.cfg.stall_shutdown_time_s
            if to_recv and limit > 0 and waited > limit:
                r = min(to_recv)
                raise PeerLostError(f"rank {self.describe_rank(r)} stopped responding for "
                                    f"{waited:.0f}s", rank=r)

    def _take(self, r: int, round_no: int, via_socket: set[int]) -> bytes | None:
        """Peer ``r``'s frame for this round if it has arrived."""
        reader = self.readers[r]
        if r in via_socket:
            return reader.pop()
        early = reader.peek()  # before the mailbox says "on the socket": only a notice
        if early is not None:
            self._check_notice(protocol.unpack_round(early, r)[0], r)
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

    def _send_some(self, writable: list[Any], to_send: dict[int, memoryview]) -> None:
        for s in writable:
            r = self._rank_of(s)
            view = to_send[r]
            try:
                n = s.send(view)
            except BlockingIOError:
                continue
            except OSError:
                to_send.pop(r)  # peer gone: reading will tell why
                continue
            if n >= len(view):
                to_send.pop(r)
            else:
                to_send[r] = view[n:]

    def _rank_of(self, sock: Any) -> int:
        return self._ranks_by_sock[sock]

    def _check_notice(self, msg: protocol.RoundMessage, r: int) -> None:
        """A peer's failure notice ("rank X was lost") ends this rank the same way."""
        notice = msg.notice
        if notice:
            lost = notice.rank if notice.rank is not None else r
            raise PeerLostError(
                f"rank {self.describe_rank(lost)} was lost (rank {r} reports: "
                f"{notice.message})", rank=lost)

    def peer_closed(self, r: int, shut_down: set[int]) -> None:
        if r in shut_down:
            self.gone.add(r)
            return
        raise PeerLostError(
            f"rank {self.describe_rank(r)} exited or lost its connection without calling "
            f"shutdown(); see that rank's output for the first failure", rank=r)

    # -- failure and the end --------------------------------------------------------------
    def tell_peers(self, exc: PeerLostError) -> None:
        """Before leaving, tell every live peer which rank was lost, so that they blame
        that rank rather than this one when this process exits."""
        frame = wire.encode_frame(protocol.KIND_ROUND, protocol.pack_round(
            protocol.RoundMessage(notice=protocol.Notice(exc.rank, str(exc)))))
        for r, reader in self.readers.items():
            if r in self.gone or r == exc.rank:
                continue
            try:
                reader.sock.setblocking(True)
                reader.sock.settimeout(0.5)
                reader.sock.sendall(frame)
            except OSError:
                pass

    def close_sockets(self) -> None:
        for rd in self.readers.values():
            try:
                rd.sock.close()
            except OSError:
                pass

    def close(self) -> None:
        if self.mailboxes is not None:
            self.mailboxes.close()
