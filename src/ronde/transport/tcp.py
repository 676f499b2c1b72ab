"""The tcp data plane: point-to-point channels over the mesh's data sockets.

:class:`SocketP2P` implements the :class:`ronde.collectives.p2p.P2P` protocol for
one process set. Sockets are non-blocking and driven by ``poll``, so a
``sendrecv`` is truly full duplex (both directions of a ring step move at once)
and every wait wakes at least every ``_POLL_MS`` to check the engine's abort flag:
a dead peer or a failed engine never leaves the executor blocked.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Callable

from .._errors import PeerLostError, ShutdownError

_POLL_MS = 200
_CHUNK = 4 * 1024 * 1024


class SocketP2P:
    """P2P over authenticated stream sockets, each taken from ``links`` (a global rank's
    socket: a dict, or the mesh's :meth:`~ronde.transport.mesh.Mesh.link`, which opens
    it) when a collective first moves bytes with that peer."""

    def __init__(self, rank: int, members: list[int],
                 links: "dict[int, socket.socket] | Callable[[int], socket.socket]",
                 describe_peer: Callable[[int], str], aborted: Callable[[], BaseException | None],
                 progress_timeout_s: float = 0.0) -> None:
        self.members = members
        self.rank = members.index(rank)
        self.size = len(members)
        self._link = links.__getitem__ if isinstance(links, dict) else links
        self._socks: dict[int, socket.socket] = {}
        self._describe = describe_peer
        self._aborted = aborted
        #: fail when a peer moves no byte for this long (0: wait for ever)
        self.progress_timeout_s = progress_timeout_s

    def _sock(self, peer: int) -> socket.socket:
        s = self._socks.get(peer)
        if s is None:
            s = self._socks[peer] = self._link(self.members[peer])
            s.setblocking(False)
        return s

    def _lost(self, peer: int, why: str) -> PeerLostError:
        g = self.members[peer]
        return PeerLostError(f"lost rank {self._describe(g)} during a collective ({why}); "
                             "see that rank's output for the cause", rank=g)

    def _check_abort(self) -> None:
        err = self._aborted()
        if err is not None:
            raise err if isinstance(err, BaseException) else ShutdownError(str(err))

    def send(self, peer: int, buf: memoryview) -> None:
        self.sendrecv(peer, buf, -1, memoryview(b""))

    def recv(self, peer: int, buf: memoryview) -> None:
        self.sendrecv(-1, memoryview(b""), peer, buf)

    def sendrecv(self, send_peer: int, send_buf: memoryview, recv_peer: int,
                 recv_buf: memoryview) -> None:
        send_buf = send_buf.cast("B") if send_buf.format != "B" else send_buf
        recv_buf = recv_buf.cast("B") if recv_buf.format != "B" else recv_buf
        to_send, to_recv = len(send_buf), len(recv_buf)
        if to_send and to_recv and self.members[recv_peer] < self.members[send_peer]:
            rsock = self._sock(recv_peer)  # the link this rank opens first, the one it
            ssock = self._sock(send_peer)  # waits for then (mesh.py): no cycle of waits
        else:
            ssock = self._sock(send_peer) if to_send else None
            rsock = self._sock(recv_peer) if to_recv else None
        sent = got = 0
        last_progress = 0.0
        while sent < to_send or got < to_recv:
            progressed = False
            if sent < to_send:
                try:
                    n = ssock.send(send_buf[sent: sent + _CHUNK])  # type: ignore[union-attr]
                    sent += n
                    progressed = n > 0
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise self._lost(send_peer, str(exc)) from None
            if got < to_recv:
                try:
                    n = rsock.recv_into(recv_buf[got:], min(_CHUNK, to_recv - got))  # type: ignore[union-attr]
                    if n == 0:
                        raise self._lost(recv_peer, "connection closed")
                    got += n
                    progressed = True
                except BlockingIOError:
                    pass
                except PeerLostError:
                    raise
                except OSError as exc:
                    raise self._lost(recv_peer, str(exc)) from None
            if progressed:
                last_progress = 0.0
                continue
            poller = select.poll()
            if sent < to_send and ssock is rsock and got < to_recv:
                poller.register(ssock.fileno(), select.POLLOUT | select.POLLIN)  # type: ignore[union-attr]
            else:
                if sent < to_send:
                    poller.register(ssock.fileno(), select.POLLOUT)  # type: ignore[union-attr]
                if got < to_recv:
                    poller.register(rsock.fileno(), select.POLLIN)  # type: ignore[union-attr]
            if not poller.poll(_POLL_MS):
                self._check_abort()
                now = time.monotonic()
                if not last_progress:
                    last_progress = now
                elif self.progress_timeout_s and now - last_progress > self.progress_timeout_s:
                    stuck = recv_peer if got < to_recv else send_peer
                    raise self._lost(stuck, f"no data moved for {now - last_progress:.0f}s; "
                                     "the process is alive but not taking part")

