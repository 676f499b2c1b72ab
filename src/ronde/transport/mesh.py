"""The connection mesh: one authenticated control and one data socket per peer.

At ``init()``, every rank listens, publishes its address through the rendezvous,
then connects to every *lower* rank (twice: ``ctl`` and ``data``) while a
background thread accepts the connections of every *higher* rank. Each connection
starts with the HMAC challenge of :mod:`ronde.transport.wire` and a hello frame
naming the rank, the generation and the channel; anything else is dropped.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from .._errors import AuthenticationError, ProtocolError, RendezvousError
from . import wire

log = logging.getLogger(__name__)

KIND_HELLO = 2
KIND_BARRIER = 3
CHANNELS = ("ctl", "data")
_SOCK_BUF_BYTES = 4 * 1024 * 1024


def listen(bind_addr: str) -> socket.socket:
    sock = socket.create_server((bind_addr, 0), backlog=1024)  # every higher rank at once
    sock.settimeout(0.2)
    return sock


def _tune(sock: socket.socket, chan: str) -> None:
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
    if chan == "data":
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF_BYTES)
            except OSError:
                pass


class Mesh:
    """Sockets to every peer: ``ctl[rank]`` and ``data[rank]``."""

    def __init__(self, rank: int, size: int, generation: int, secret: bytes,
                 listener: socket.socket, peers: list[dict[str, Any]], timeout_s: float) -> None:
        self.rank, self.size, self.generation = rank, size, generation
        self.ctl: dict[int, socket.socket] = {}
        self.data: dict[int, socket.socket] = {}
        self._secret = secret
        self._listener = listener
        self._peers = peers
        self._timeout_s = timeout_s
        self._accept_error: BaseException | None = None
        self._rejected_logged = False

    def connect(self) -> "Mesh":
        deadline = time.monotonic() + self._timeout_s
        acceptor = threading.Thread(target=self._accept, args=(deadline,), daemon=True,
                                    name="ronde-mesh-accept")
        acceptor.start()
        try:
            for peer in range(self.rank):
                info = self._peers[peer]
                for chan in CHANNELS:
                    self._connect_one(peer, info, chan, deadline)
        finally:
            acceptor.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if self._accept_error is not None:
            self.close()
            raise self._accept_error
        missing = [r for r in range(self.rank + 1, self.size)
                   if r not in self.ctl or r not in self.data]
        if missing:
            self.close()
            raise RendezvousError(
                f"rank {self.rank}: ranks {missing} did not connect within "
                f"{self._timeout_s:g}s after rendezvous; a firewall may block their "
                "connections, or they failed (see their output)")
        self._listener.close()
        return self

    def _connect_one(self, peer: int, info: dict[str, Any], chan: str, deadline: float) -> None:
        addr, port = str(info["addr"]), int(info["port"])
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousError(
                    f"rank {self.rank} cannot connect to rank {peer} at {addr}:{port} "
                    f"(host {info.get('host')}); check that this address is reachable "
                    "(RONDE_BIND_ADDR / interfaces)")
            try:
                sock = wire.connect(addr, port, self._secret, min(remaining, 5.0))
                break
            except (ConnectionRefusedError, socket.timeout, TimeoutError):
                time.sleep(0.05)
        _tune(sock, chan)
        wire.send_frame(sock, KIND_HELLO, wire.dumps(
            {"rank": self.rank, "gen": self.generation, "chan": chan}))
        sock.settimeout(None)
        (self.ctl if chan == "ctl" else self.data)[peer] = sock

    def _accept(self, deadline: float) -> None:
        expected = {(r, c) for r in range(self.rank + 1, self.size) for c in CHANNELS}
        while expected and time.monotonic() < deadline:
            try:
                conn, addr = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError as exc:
                self._accept_error = exc
                return
            try:
                conn.settimeout(None)
                wire.authenticate_server(conn, self._secret, time.monotonic() + 5.0)
                kind, payload = wire.recv_frame(conn, time.monotonic() + 5.0, 1024)
                hello = wire.loads(payload)
                key = (int(hello["rank"]), str(hello["chan"]))
                if kind != KIND_HELLO or int(hello["gen"]) != self.generation:
                    raise ProtocolError("hello for another generation")
                if key not in expected:
                    raise ProtocolError(f"unexpected hello {key}")
            except (AuthenticationError, ProtocolError, OSError, TimeoutError, KeyError,
                    TypeError, ValueError) as exc:
                if not self._rejected_logged:
                    self._rejected_logged = True
                    log.warning("rank %d dropped a connection from %s: %s", self.rank, addr, exc)
                conn.close()
                continue
            expected.discard(key)
            _tune(conn, key[1])
            (self.ctl if key[1] == "ctl" else self.data)[key[0]] = conn

    def barrier(self, timeout_s: float) -> None:
        """Meet every peer on the (otherwise idle) data sockets; raise on failure.

        Used when ronde's own transports are not: a rank leaves only after every peer
        has entered, which is what tearing down another library's connections needs.
        """
        deadline = time.monotonic() + timeout_s
        payload = wire.dumps({"rank": self.rank, "gen": self.generation})
        for sock in self.data.values():
            wire.send_frame(sock, KIND_BARRIER, payload)
        for peer, sock in self.data.items():
            kind, got = wire.recv_frame(sock, deadline, 1024)
            hello = wire.loads(got)
            if kind != KIND_BARRIER or hello.get("rank") != peer:
                raise ProtocolError(f"unexpected frame from rank {peer} in the closing barrier")
        for sock in self.data.values():
            sock.settimeout(None)

    def close(self) -> None:
        for table in (self.ctl, self.data):
            for s in table.values():
                try:
                    s.close()
                except OSError:
                    pass
            table.clear()
        try:
            self._listener.close()
        except OSError:
            pass
