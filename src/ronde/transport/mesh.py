"""The connection mesh: authenticated sockets between ranks, opened when needed.

At ``init()``, every rank listens and publishes its address through the rendezvous.
Two channels join a pair of ranks: ``ctl`` (negotiation) and ``data`` (the tcp data
plane). The higher rank of a pair always connects, the lower one accepts (a thread
that listens for the life of the job: transport/admission.py, one thread for every
incoming connection), so a pair never has two sockets for one channel. Each connection
starts with the HMAC challenge of :mod:`ronde.transport.wire` and a hello frame naming
the rank, the generation and the channel; anything else is dropped.

What is opened when: the control sockets the negotiation needs from the start, before
``init()`` returns (``ctl_peers``: every peer when rounds go all-to-all; only the
coordinator, rank 0, for the other ranks when they go through it: ``N - 1``
connections in all, not ``N(N - 1) / 2``); everything else on first use, by
:meth:`Mesh.link`: a data socket when a collective first moves bytes to or from that
peer (a ring uses two per rank; shared memory none), a control socket when a rank
becomes the coordinator after rank 0 left.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable, Iterable

from .._errors import (AuthenticationError, PeerLostError, ProtocolError, RendezvousError,
                       ShutdownError)
from . import wire
from .admission import Admission

log = logging.getLogger(__name__)

KIND_HELLO = 2
KIND_BARRIER = 3
CHANNELS = ("ctl", "data")
_SOCK_BUF_BYTES = 4 * 1024 * 1024


def listen(bind_addr: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in bind_addr else socket.AF_INET,
                         socket.SOCK_STREAM)
    try:
        # accepted sockets take the listener's buffers from the handshake on: a data
        # link opened while a collective waits on it starts at full window
        wire.set_buffers(sock, _SOCK_BUF_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_addr, 0))
        sock.listen(1024)  # every higher rank at once
    except BaseException:
        sock.close()
        raise
    sock.settimeout(0.2)
    return sock


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A host that vanishes without closing its connections (power loss, partition) is
    # noticed by the kernel's keepalive within about 10 s, at no cost to Python.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 5),
                        ("TCP_USER_TIMEOUT", 10_000)):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass


class LinkError(PeerLostError):
    """A link to a peer cannot open: it refused the connection (its listener, open for
    the whole job, is gone: it exited) or did not open its side within the wait."""


class Mesh:
    """The sockets of one rank: ``ctl[rank]`` and ``data[rank]`` hold those open."""

    def __init__(self, rank: int, size: int, generation: int, secret: bytes,
                 listener: socket.socket, peers: list[dict[str, Any]], timeout_s: float,
                 ctl_peers: Iterable[int] | None = None) -> None:
        self.rank, self.size, self.generation = rank, size, generation
        self.ctl: dict[int, socket.socket] = {}
        self.data: dict[int, socket.socket] = {}
        #: the peers whose control sockets ``connect`` opens (default: every peer)
        self.ctl_peers = sorted(set(range(size)) - {rank} if ctl_peers is None
                                else set(ctl_peers) - {rank})
        self._secret = secret
        self._listener = listener
        self._peers = peers
        self._timeout_s = timeout_s
        #: guards the tables; notified when a socket is added or the mesh closes
        self._cond = threading.Condition()
        #: one lock per (peer, channel) this rank connects: one connection each
        self._connecting: dict[tuple[int, str], threading.Lock] = {}
        self._closed = False
        self._acceptor: Admission | None = None
        self._rejections = wire.Rejections(log, f"rank {rank}")

    def _table(self, chan: str) -> dict[int, socket.socket]:
        return self.ctl if chan == "ctl" else self.data

    def _add(self, peer: int, chan: str, sock: socket.socket) -> bool:
        """Publish a socket (False, and it is closed, after ``close()`` or when the
        pair already has one for ``chan``)."""
        with self._cond:
            table = self._table(chan)
            if not self._closed and peer not in table:
                table[peer] = sock
                self._cond.notify_all()
                return True
        sock.close()
        return False

    def connect(self) -> "Mesh":
        """Open the control sockets of ``ctl_peers``; start accepting the rest."""
        deadline = time.monotonic() + self._timeout_s
        self._acceptor = Admission(
            self._listener, self._secret, self._admitted, rejections=self._rejections,
            max_frame_bytes=1024, name=f"ronde-mesh-accept-{self.rank}").start()
        try:
            for peer in self.ctl_peers:
                if peer < self.rank:
                    self._connect_one(peer, "ctl", deadline)
            higher = [r for r in self.ctl_peers if r > self.rank]
            with self._cond:
                while True:
                    missing = [r for r in higher if r not in self.ctl]
                    left = deadline - time.monotonic()
                    if not missing or left <= 0:
                        break
                    self._cond.wait(min(left, 0.2))
        except BaseException:
            self.close()
            raise
        if missing:
            self.close()
            raise RendezvousError(
                f"rank {self.rank}: ranks {missing} did not connect within "
                f"{self._timeout_s:g}s after rendezvous; a firewall may block their "
                "connections, or they failed (see their output)")
        return self

    def opened(self, peer: int, chan: str) -> socket.socket | None:
        """The socket to ``peer`` on ``chan`` if it is open (never waits)."""
        return self._table(chan).get(peer)

    def wait_opened(self, timeout_s: float) -> None:
        """Sleep until a socket is added (or ``timeout_s`` passed, or the mesh closed)."""
        with self._cond:
            if not self._closed:
                self._cond.wait(timeout_s)

    def link(self, peer: int, chan: str = "data", timeout_s: float = 0.0,
             aborted: Callable[[], BaseException | None] = lambda: None) -> socket.socket:
        """The socket to ``peer`` on ``chan``, opened now if it is not yet: this rank
        connects to a lower rank, and waits for a higher one to connect (it does when it
        first needs the link: the two sides of a collective ask alike). Both check
        ``aborted`` every 0.2 s (and raise what it returns); the wait ends after
        ``timeout_s`` (0: it does not) with a :class:`LinkError`, as does a refused
        connection at once (every rank listens from before the rendezvous to its
        ``shutdown()``: a refusal means the peer is gone)."""
        sock = self._table(chan).get(peer)
        if sock is not None:
            return sock
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"rank {self.rank} has no link to rank {peer}")
        if self._closed:
            raise ShutdownError(f"rank {self.rank}: the mesh is closed")
        if peer < self.rank:
            return self._connect_link(peer, chan, timeout_s or self._timeout_s, aborted)
        start = time.monotonic()
        with self._cond:
            while peer not in self._table(chan):
                err = aborted()
                if err is not None:
                    raise err
                if self._closed:
                    raise ShutdownError(f"rank {self.rank}: the mesh is closed")
                waited = time.monotonic() - start
                if timeout_s and waited > timeout_s:
                    raise LinkError(
                        f"rank {peer} did not open its {chan} connection to rank "
                        f"{self.rank} within {waited:.0f}s; it is not taking part in "
                        "this collective (see its output)", rank=peer)
                self._cond.wait(0.2)
            return self._table(chan)[peer]

    def _connect_link(self, peer: int, chan: str, timeout_s: float,
                      aborted: Callable[[], BaseException | None]) -> socket.socket:
        with self._cond:
            lock = self._connecting.setdefault((peer, chan), threading.Lock())
        with lock:  # one connection per pair and channel, whatever the thread
            sock = self._table(chan).get(peer)
            if sock is not None:
                return sock
            try:
                self._connect_one(peer, chan, time.monotonic() + timeout_s, aborted=aborted)
            except PeerLostError:
                raise
            except ConnectionRefusedError as exc:
                raise LinkError(f"rank {peer} refused the {chan} connection from rank "
                                f"{self.rank} ({exc}): it is no longer running",
                                rank=peer) from None
            except (RendezvousError, AuthenticationError, OSError) as exc:
                # during the job: fail it everywhere, naming the peer
                raise LinkError(f"{exc} (opening the {chan} link to rank {peer} on "
                                "first use)", rank=peer) from None
            sock = self._table(chan).get(peer)
            if sock is None:
                raise ShutdownError(f"rank {self.rank}: the mesh is closed")
            return sock

    def _connect_one(self, peer: int, chan: str, deadline: float,
                     aborted: Callable[[], BaseException | None] | None = None) -> None:
        """Connect to lower rank ``peer``, retrying a connection its listener dropped
        before the verdict (``wire.HandshakeDropped``: it made room during a flood) or
        that timed out. At start-up every failure is retried (the peer may not listen
        yet) until ``deadline``, then named; during the job (``aborted`` given) a refusal
        is final: the peer's listener, open to its ``shutdown()``, is gone."""
        info = self._peers[peer]
        addr, port = str(info["addr"]), int(info["port"])
        last: OSError | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousError(
                    f"rank {self.rank} cannot connect to rank {peer} at {addr}:{port} "
                    f"(host {info.get('host')}; last: {last}); check that this address is "
                    "reachable (RONDE_BIND_ADDR / interfaces)")
            if aborted is not None:
                err = aborted()
                if err is not None:
                    raise err
            try:
                sock = wire.connect(addr, port, self._secret, min(remaining, 5.0),
                                    buffer_bytes=_SOCK_BUF_BYTES if chan == "data" else 0)
                break
            except ConnectionRefusedError as exc:
                if aborted is not None:
                    raise
                last = exc
            except (wire.HandshakeDropped, socket.timeout, TimeoutError) as exc:
                last = exc
                log.debug("rank %d: %s link to rank %d again: %s", self.rank, chan, peer, exc)
            except AuthenticationError:
                raise
            except socket.gaierror as exc:
                raise RendezvousError(
                    f"rank {self.rank} cannot resolve the address {addr!r} that rank {peer} "
                    f"(host {info.get('host')}) advertised: {exc}; set RONDE_BIND_ADDR to an "
                    "address the peers reach") from None
            except OSError as exc:
                if aborted is not None:
                    raise
                last = exc
            time.sleep(0.05)
        try:
            _tune(sock)
            wire.send_frame(sock, KIND_HELLO, wire.dumps(
                {"rank": self.rank, "gen": self.generation, "chan": chan}))
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self._add(peer, chan, sock)

    def _admitted(self, conn: socket.socket, addr: Any, kind: int, payload: bytes,
                  proven: bool) -> None:
        """A connection that proved the secret (transport/admission.py) sent its hello:
        file it as the link it names, unless it is not one this rank accepts."""
        try:
            hello = wire.loads(payload)
            peer, chan = int(hello["rank"]), str(hello["chan"])
            if kind != KIND_HELLO or int(hello["gen"]) != self.generation:
                raise ProtocolError("hello for another generation")
            if not self.rank < peer < self.size or chan not in CHANNELS \
                    or peer in self._table(chan):
                raise ProtocolError(f"unexpected hello {(peer, chan)}")
            conn.settimeout(None)
            _tune(conn)
        except (ProtocolError, OSError, KeyError, TypeError, ValueError) as exc:
            self._rejections.note(addr, exc)
            conn.close()
            return
        self._add(peer, chan, conn)

    def barrier(self, timeout_s: float) -> None:
        """Meet every peer on the data sockets (through rank 0: every rank tells it,
        it answers each once all did); raise on failure.

        Used when ronde's own transports are not: a rank leaves only after every peer
        has entered, which is what tearing down another library's connections needs.
        """
        deadline = time.monotonic() + timeout_s
        payload = wire.dumps({"rank": self.rank, "gen": self.generation})
        others = range(1, self.size) if self.rank == 0 else [0]
        socks = {p: self.link(p, "data", timeout_s) for p in others}
        if self.rank == 0:
            for peer, sock in socks.items():
                self._barrier_frame(sock, peer, deadline)
            for sock in socks.values():
                wire.send_frame(sock, KIND_BARRIER, payload)
        else:
            wire.send_frame(socks[0], KIND_BARRIER, payload)
            self._barrier_frame(socks[0], 0, deadline)
        for sock in socks.values():
            sock.settimeout(None)

    def _barrier_frame(self, sock: socket.socket, peer: int, deadline: float) -> None:
        kind, got = wire.recv_frame(sock, deadline, 1024)
        hello = wire.loads(got)
        if kind != KIND_BARRIER or hello.get("rank") != peer:
            raise ProtocolError(f"unexpected frame from rank {peer} in the closing barrier")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._acceptor is not None:
            self._acceptor.close()
        try:
            self._listener.close()
        except OSError:
            pass
        if self._acceptor is not None:
            self._acceptor.join(1.0)
        with self._cond:
            for table in (self.ctl, self.data):
                for s in table.values():
                    try:
                        s.close()
                    except OSError:
                        pass
                table.clear()
