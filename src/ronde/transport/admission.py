"""Admission: one thread accepts and authenticates every incoming connection of a listener.

Used by the mesh's listener (transport/mesh.py) and the rendezvous service
(runner/rendezvous.py). Before, each accepted connection got a thread of its own for its
handshake: a flood of connections could exhaust threads (``can't start new thread``
ended the acceptor, and the next collective waited minutes with no message). Now one
selector loop carries every connection through the handshake of transport/wire.py as a
small state machine, never blocking on any one of them:

1. the client's hello (``"rd"`` and its nonce); the server sends its own nonce;
2. the client's proof, ``HMAC(secret, "client" | nonce_c | nonce_s)``; the server answers
   ``ok`` and its own proof, or ``no`` and closes;
3. one frame (header, then a payload of at most ``max_frame_bytes``): the hello or the
   registration that says what the connection is for.

Then the socket (blocking again) and the frame go to ``on_admitted``, on this thread: it
must not block (it files the socket and returns). A connection that fails any step is
closed and counted (:class:`wire.Rejections`); an error in ``on_admitted`` is logged; the
loop goes on until :meth:`Admission.close`.

Floods. At most ``max_pending`` connections are in the handshake at once, each for at
most ``deadline_s``; established links are other sockets, which nothing here touches.
When a connection arrives with the table full, the oldest one that has not proved the
job's secret makes room (it is closed); only when every pending connection has proved
the secret is the newcomer refused. Refusing the newcomer instead (as before) let a
flood of connections that send a hello and stall (1500 a second, issue #50) fill the
table for good: the listener closed every real peer's connection, unread hello and
all, so the peer got a reset (``LinkError: Connection reset by peer`` on the first tcp
allreduce, a raw traceback at start-up). A peer holding the secret answers within a
round trip, while a stalled connection is dropped once ``max_pending`` newer ones
arrived: measured at np=2 and np=4 over tcp, with 1500 such connections a second
spread over every listener and 3600 a second at rank 0's alone, every start-up and
allreduce completed and no real peer's handshake was ever dropped. A limit per source
address was not chosen: an attacker on one of the job's hosts (another user) shares
the address of the ranks there. The client's side is the backstop: a connection
dropped before its verdict raises :class:`wire.HandshakeDropped`, which the mesh and the
rendezvous client retry (a refusal of the secret is an explicit ``no``, never retried).
"""

from __future__ import annotations

import hmac
import logging
import os
import selectors
import socket
import threading
import time
from typing import Any, Callable

from .._errors import AuthenticationError, ProtocolError
from . import wire

log = logging.getLogger(__name__)

#: what ``on_admitted`` gets: the socket, the peer's address, the frame's kind and
#: payload, and whether the peer proved the job's secret (False: only the open key)
Admitted = Callable[[socket.socket, Any, int, bytes, bool], None]
_DIGEST_BYTES = 32


class _Pending:
    """One connection in the handshake: what it has sent so far, what comes next."""

    def __init__(self, sock: socket.socket, peer: Any, deadline: float) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.step = "hello"
        self.need = len(wire.MAGIC) + wire.NONCE_BYTES
        self.buf = bytearray()
        self.nonce_c = self.nonce_s = b""
        self.proven = False
        self.kind = 0


class Admission:
    """Accept and authenticate the connections of ``listener`` on one thread."""

    def __init__(self, listener: socket.socket, secret: bytes, on_admitted: Admitted, *,
                 rejections: wire.Rejections, max_frame_bytes: int, name: str,
                 open_key: Callable[[], bytes | None] = lambda: None, max_pending: int = 64,
                 deadline_s: float = 5.0) -> None:
        self._listener = listener
        self._secret = secret
        self._on_admitted = on_admitted
        self._rejections = rejections
        self._max_frame_bytes = max_frame_bytes
        self._open_key = open_key
        self.max_pending = max_pending
        self._deadline_s = deadline_s
        self._pending: dict[socket.socket, _Pending] = {}
        self._closed = False
        #: ``close`` writes a byte here: the loop sleeps without a timeout while no
        #: connection is in the handshake (it woke five times a second before, ~70 us of
        #: CPU each, a training process's steady cost)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> "Admission":
        self._listener.setblocking(False)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop admitting (the loop ends at once; pending connections are closed)."""
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed already
            pass

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # -- the loop ------------------------------------------------------------------
    def _loop(self) -> None:
        sel = selectors.DefaultSelector()  # epoll here: no limit on descriptor numbers
        try:
            sel.register(self._listener, selectors.EVENT_READ, None)
            sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
            while not self._closed:
                pending = self._pending
                timeout = None if not pending else max(
                    0.0, min(p.deadline for p in pending.values()) - time.monotonic())
                for key, _ in sel.select(timeout):
                    if key.data is None:
                        self._accept(sel)
                    elif key.data is not self._wake_r and key.data.sock in pending:
                        self._advance(sel, key.data)  # (not one _accept evicted just now)
                now = time.monotonic()
                for p in [p for p in pending.values() if p.deadline < now]:
                    self._drop(sel, p, TimeoutError("did not finish the handshake in time"))
        except Exception:  # noqa: BLE001 - the acceptor must say why it stopped
            if not self._closed:
                log.exception("%s stopped admitting connections", self._thread.name)
        finally:
            for p in list(self._pending.values()):
                p.sock.close()
            self._pending.clear()
            sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):  # a burst, then the pending ones get their turn
            try:
                conn, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE, ECONNABORTED: log, go on
                if self._closed:
                    return
                self._rejections.note("(accept)", exc)
                time.sleep(0.05)
                return
            if len(self._pending) >= self.max_pending and not self._evict(sel):
                conn.close()
                self._rejections.note(peer, ProtocolError(
                    f"{self.max_pending} connections that proved the secret are already "
                    "in the handshake"))
                continue
            conn.setblocking(False)
            p = _Pending(conn, peer, time.monotonic() + self._deadline_s)
            self._pending[conn] = p
            sel.register(conn, selectors.EVENT_READ, p)

    def _evict(self, sel: selectors.BaseSelector) -> bool:
        """Make room for a new connection: drop the oldest one that has not proved the
        job's secret (False when every one has), one that proved no key at all first (an
        open rendezvous's public-key client sends its frame right after the verdict). A
        peer holding the secret finishes the handshake within a round trip of its hello;
        a connection still unproven when ``max_pending`` newer ones have arrived is the
        oldest of a flood."""
        for keyless in (True, False):
            for p in self._pending.values():  # insertion order: the oldest first
                if not p.proven and (not keyless or p.step in ("hello", "proof")):
                    self._drop(sel, p, ProtocolError(
                        f"made room for a newer connection: {self.max_pending} were in the "
                        "handshake, this one the oldest that had not proved the secret"))
                    return True
        return False

    def _advance(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        try:
            data = p.sock.recv(p.need - len(p.buf))
            if not data:
                raise ConnectionError("closed during the handshake")
            p.buf += data
            if len(p.buf) < p.need:
                return
            chunk, p.buf = bytes(p.buf), bytearray()
            if self._step(p, chunk):
                self._finish(sel, p)
        except (AuthenticationError, ProtocolError, OSError) as exc:
            self._drop(sel, p, exc)

    def _step(self, p: _Pending, chunk: bytes) -> bool:
        """Take the bytes of the current step; True when the connection is admitted."""
        if p.step == "hello":
            if chunk[:len(wire.MAGIC)] != wire.MAGIC:
                raise AuthenticationError("connection does not speak the ronde protocol")
            p.nonce_c, p.nonce_s = chunk[len(wire.MAGIC):], os.urandom(wire.NONCE_BYTES)
            self._send(p, p.nonce_s)
            p.step, p.need = "proof", _DIGEST_BYTES
            return False
        if p.step == "proof":
            for key in (self._secret, self._open_key()):
                if key is not None and hmac.compare_digest(
                        chunk, wire.mac(key, b"client", p.nonce_c, p.nonce_s)):
                    self._send(p, b"ok" + wire.mac(key, b"server", p.nonce_c, p.nonce_s))
                    p.proven = key is self._secret
                    p.step, p.need = "header", wire.HEADER_BYTES
                    return False
            try:
                p.sock.send(b"no")
            except OSError:
                pass
            raise AuthenticationError("client failed authentication")
        if p.step == "header":
            p.kind, length = wire.decode_header(chunk, self._max_frame_bytes)
            p.step, p.need = "payload", length
            if length:
                return False
            chunk = b""
        p.buf = bytearray(chunk)  # the payload
        return True

    def _send(self, p: _Pending, data: bytes) -> None:
        if p.sock.send(data) != len(data):  # a few bytes into a fresh socket's buffer
            raise ConnectionError("could not send the handshake")

    def _finish(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        sel.unregister(p.sock)
        del self._pending[p.sock]
        p.sock.setblocking(True)
        try:
            self._on_admitted(p.sock, p.peer, p.kind, bytes(p.buf), p.proven)
        except Exception as exc:  # noqa: BLE001 - one connection's error, not the loop's
            log.warning("%s: a connection from %s failed after its handshake: %s",
                        self._thread.name, p.peer, exc)
            p.sock.close()

    def _drop(self, sel: selectors.BaseSelector, p: _Pending, exc: BaseException) -> None:
        sel.unregister(p.sock)
        del self._pending[p.sock]
        p.sock.close()
        self._rejections.note(p.peer, exc)
