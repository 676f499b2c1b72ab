"""The control sockets of one engine to its peers, and what their frames and closing mean.

Where it sits: :class:`~.exchange.Exchange` moves a round's frames and decides how
(all-to-all with same-host mailboxes, through a coordinator, or over a tree); the round
functions of ``coordinator.py`` and ``tree.py`` and the exchange itself all read and
write through one :class:`Channels`: the sockets by rank, the frame decoder, which ranks
have left, and the three things any of them may conclude from a socket: a peer's
failure notice ends this rank the same way, a peer that closes without its shutdown is
lost, one that closes after it has left. Nothing here imports the modules that drive
rounds, so the three of them depend on this one and not on each other.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable, Protocol

from .._config import Config
from .._errors import PeerLostError
from ..transport import wire
from ..transport.mesh import LinkError
from . import protocol, rounds

log = logging.getLogger(__name__)


class Links(Protocol):
    """What the channels use of the mesh (``transport/mesh.py``): control sockets
    opened after ``init()`` (the coordinator's, after rank 0 left)."""

    def link(self, peer: int, chan: str = ..., timeout_s: float = ...,
             aborted: Callable[[], BaseException | None] = ...) -> socket.socket: ...

    def opened(self, peer: int, chan: str) -> socket.socket | None: ...

    def wait_opened(self, timeout_s: float) -> None: ...


class Channels:
    """The control sockets to this rank's peers (by rank), their decoder, and who left."""

    def __init__(self, rank: int, size: int, ctl_socks: dict[int, socket.socket],
                 cfg: Config, describe_rank: Callable[[int], str],
                 links: Links | None = None) -> None:
        self.rank = rank
        self.size = size
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
        #: every other rank of the job
        self.peers = [r for r in range(size) if r != rank]
        #: the ranks that shut down and left (see :meth:`left`)
        self.gone: set[int] = set()
        self._connected: list[int] = []
        self._connected_key = (-1, -1)

    def live(self) -> list[int]:
        """The other ranks still in the job (whether or not a socket joins them)."""
        return [r for r in self.peers if r not in self.gone]

    def connected(self) -> list[int]:
        """The live ranks this rank holds a control socket to (the control loop asks
        every cycle: kept until a socket opens or a rank leaves; both only add)."""
        key = (len(self.readers), len(self.gone))
        if key != self._connected_key:
            self._connected = [r for r in self.readers if r not in self.gone]
            self._connected_key = key
        return self._connected

    @property
    def can_link(self) -> bool:
        """Whether control sockets can be opened after ``init()`` (a failover's)."""
        return self._links is not None

    def left(self, r: int) -> None:
        """Rank ``r`` shut down and left: no round waits for it from now on."""
        self.gone.add(r)


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
            self.left(r)
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
                    self.left(r)
                    missing.remove(r)
                elif r not in shut_down and waited > self.cfg.start_timeout_s:
                    raise PeerLostError(
                        f"rank {self.describe_rank(r)} did not connect to rank "
                        f"{self.rank}, the negotiation coordinator after rank 0 left, "
                        f"within {waited:.0f}s", rank=r)
            if missing:
                links.wait_opened(0.05)
        self._members_linked = True  # no rank joins later: one wait per coordinator

    def send_some(self, writable: list[socket.socket], to_send: dict[int, memoryview]) -> None:
        """Send what each writable socket takes of its peer's ``to_send`` (dropped when
        all went, or when the peer is gone: reading its socket tells why)."""
        for s in writable:
            r = self.rank_of(s)
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

    def rank_of(self, sock: socket.socket) -> int:
        return self._ranks_by_sock[sock]

    def check_notice(self, msg: protocol.RoundMessage, r: int) -> None:
        """A peer's failure notice ("rank X was lost") ends this rank the same way."""
        notice = msg.notice
        if notice:
            lost = notice.rank if notice.rank is not None else r
            raise PeerLostError(
                f"rank {self.describe_rank(lost)} was lost (rank {r} reports: "
                f"{notice.message})", rank=lost)

    def peer_closed(self, r: int, shut_down: set[int]) -> None:
        if r in shut_down:
            self.left(r)
            return
        raise PeerLostError(
            f"rank {self.describe_rank(r)} exited or lost its connection without calling "
            f"shutdown(); see that rank's output for the first failure", rank=r)

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


class Wait:
    """One wait of a round for some ranks' frames (started when made): :meth:`check` in
    each turn of the loop raises a failure, logs the ranks still awaited once the wait
    passed ``RONDE_PEER_TIMEOUT`` (a warning, as the all-to-all exchange logs it), and
    names one of them by a ``PeerLostError`` once it passed ``RONDE_STALL_SHUTDOWN_TIME``
    (plus ``extra_s``)."""

    def __init__(self, ch: Channels, failed: Callable[[], BaseException | None],
                 extra_s: float = 0.0) -> None:
        self.ch = ch
        self.failed = failed
        self.extra_s = extra_s
        self.start = time.monotonic()
        self.warned = False

    def check(self, waiting: set[int]) -> None:
        err = self.failed()
        if err is not None:
            raise err
        ch = self.ch
        limit = ch.cfg.stall_shutdown_time_s
        waited = time.monotonic() - self.start
        if waiting and waited > ch.cfg.peer_timeout_s and not self.warned:
            self.warned = True
            if self.extra_s and len(waiting) == 1 and min(waiting) < ch.rank:  # coordinator
                log.warning("rank %d: rank %s, which relays this rank's negotiation rounds, "
                            "has not answered for %.0fs; it waits for a silent rank, or is "
                            "blocked itself (its own log names which)", ch.rank,
                            min(waiting), waited)
            else:
                log.warning("rank %d: rank(s) %s have not answered a negotiation round for "
                            "%.0fs; is their Python process blocked?", ch.rank,
                            sorted(waiting), waited)
        if waiting and limit > 0 and waited > limit + self.extra_s:
            r = min(waiting)
            raise PeerLostError(f"rank {ch.describe_rank(r)} stopped responding for "
                                f"{waited:.0f}s", rank=r)
