"""Framing and peer authentication shared by every ronde socket.

Every connection ronde opens (rendezvous, control, data) starts with a mutual
HMAC-SHA256 challenge over the per-job secret, so a peer that does not hold the
secret never gets a byte accepted. After that, control traffic is carried in
length-prefixed frames whose lengths are checked against a hard bound before any
allocation, and whose payloads are JSON (never pickle).

Frame layout: ``MAGIC (2 bytes) | kind (1 byte) | length (4 bytes, big endian) | payload``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import logging
import socket
import struct
import threading
import time
from typing import Any

from .._errors import AuthenticationError, ProtocolError

MAGIC = b"rd"
_HEADER = struct.Struct("!2sBI")
HEADER_BYTES = _HEADER.size
#: Upper bound for one control frame; anything larger is a protocol error.
MAX_FRAME_BYTES = 64 * 1024 * 1024
NONCE_BYTES = 16
_DIGEST = hashlib.sha256


def recv_exact(sock: socket.socket, nbytes: int, deadline: float | None = None) -> bytes:
    """Read exactly ``nbytes`` or raise ``ConnectionError`` on EOF.

    ``deadline`` is a ``time.monotonic()`` value; the socket timeout is set so the
    whole read finishes before it.
    """
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("timed out reading from peer")
            sock.settimeout(remaining)
        n = sock.recv_into(view[got:], nbytes - got)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        got += n
    return bytes(buf)


def encode_frame(kind: int, payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(MAGIC, kind, len(payload)) + payload


def decode_header(header: bytes, max_bytes: int = MAX_FRAME_BYTES) -> tuple[int, int]:
    """Validate a frame header and return ``(kind, length)``."""
    if len(header) != HEADER_BYTES:
        raise ProtocolError("short frame header")
    magic, kind, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError("bad frame magic")
    if length > max_bytes:
        raise ProtocolError(f"frame length {length} exceeds limit {max_bytes}")
    return kind, length


def send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(encode_frame(kind, payload))


def recv_frame(
    sock: socket.socket, deadline: float | None = None, max_bytes: int = MAX_FRAME_BYTES
) -> tuple[int, bytes]:
    kind, length = decode_header(recv_exact(sock, HEADER_BYTES, deadline), max_bytes)
    return kind, recv_exact(sock, length, deadline) if length else b""


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"undecodable control payload: {exc}") from None


def mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    """One side's proof of the secret over both nonces."""
    return hmac.new(secret, role + a + b, _DIGEST).digest()


#: The key an *open* rendezvous accepts (a torchrun or Slurm job given no secret,
#: see runner/rendezvous.py): public by design. It admits a process only to register
#: during the job's first start-up; the reply then carries the job's random secret.
OPEN_KEY = b"ronde: open rendezvous, no job secret"


class HandshakeDropped(ConnectionError):
    """The server closed a connection before it judged the client's proof: not a
    refusal of the secret (that is an explicit ``no``, :class:`AuthenticationError`) but
    a listener that made room for other connections or is closing: a client retries."""


def authenticate_client(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """Client side of the mutual challenge; raises ``AuthenticationError``.

    The client proves it holds the secret *first*: a process that connects without it
    gets one random nonce and nothing computed from the secret, so it cannot test
    guesses of the secret offline. Then the server proves it holds the secret too.
    """
    nonce_c = os.urandom(NONCE_BYTES)
    try:
        sock.sendall(MAGIC + nonce_c)
        nonce_s = recv_exact(sock, NONCE_BYTES, deadline)
        sock.sendall(mac(secret, b"client", nonce_c, nonce_s))
        verdict = recv_exact(sock, 2, deadline)
    except ConnectionError as exc:
        raise HandshakeDropped(
            f"the peer closed the connection before its verdict ({exc}): its listener "
            "dropped it (busy with other connections, or closing); try again") from None
    if verdict != b"ok":
        raise AuthenticationError(
            "peer rejected our credentials: this process does not hold this job's secret "
            "(RONDE_SECRET differs between ranks, or another job listens on this port)")
    mac_s = recv_exact(sock, _DIGEST().digest_size, deadline)
    if not hmac.compare_digest(mac_s, mac(secret, b"server", nonce_c, nonce_s)):
        raise AuthenticationError(
            "peer failed authentication: it does not hold this job's secret "
            "(RONDE_SECRET differs, or a foreign service listens on this port)"
        )


def authenticate_server(sock: socket.socket, secret: bytes, deadline: float,
                        open_key: bytes | None = None) -> bool:
    """Server side of the mutual challenge; raises on a peer without the secret.

    With ``open_key`` (an open rendezvous) a client holding that public key is
    admitted too; returns True when the client proved the job's ``secret``, False
    when it proved only ``open_key``.
    """
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if hello[: len(MAGIC)] != MAGIC:
        raise AuthenticationError("connection does not speak the ronde protocol")
    nonce_c = hello[len(MAGIC):]
    nonce_s = os.urandom(NONCE_BYTES)
    sock.sendall(nonce_s)
    mac_c = recv_exact(sock, _DIGEST().digest_size, deadline)
    for key in (secret, open_key):
        if key is not None and hmac.compare_digest(mac_c, mac(key, b"client", nonce_c, nonce_s)):
            sock.sendall(b"ok" + mac(key, b"server", nonce_c, nonce_s))
            return key is secret
    try:
        sock.sendall(b"no")
    except OSError:
        pass
    raise AuthenticationError("client failed authentication")


class Rejections:
    """Connections a listener dropped before they authenticated: counted, and logged
    the first time, then at most once every ``every_s`` seconds with the count since
    (a scan or a flood cannot fill the log, and a repeated attempt is not hidden)."""

    def __init__(self, log: logging.Logger, where: str, every_s: float = 10.0) -> None:
        self._log, self._where, self._every_s = log, where, every_s
        self._lock = threading.Lock()
        self.count = 0
        self._logged_at: float | None = None
        self._count_at_log = 0

    def note(self, peer: Any, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self.count += 1
            last = self._logged_at
            if last is not None and now - last < self._every_s:
                return
            since, self._count_at_log = self.count - self._count_at_log, self.count
            self._logged_at = now
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else peer
        if last is None:
            self._log.warning("%s dropped a connection from %s: %s", self._where, who, exc)
        else:
            self._log.warning("%s dropped %d more connection(s) that did not authenticate, "
                              "the latest from %s: %s", self._where, since, who, exc)


def connect(
    host: str, port: int, secret: bytes, timeout_s: float, *, family: int | None = None,
    buffer_bytes: int = 0
) -> socket.socket:
    """Open an authenticated TCP (or, for a path starting with NUL, abstract unix)
    connection; ``buffer_bytes``: the send and receive buffers, set before the
    handshake so that the window it negotiates can use them."""
    deadline = time.monotonic() + timeout_s
    if family == socket.AF_UNIX:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(host)
    else:
        sock = _tcp_connect(host, port, timeout_s, buffer_bytes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        authenticate_client(sock, secret, deadline)
    except BaseException:
        sock.close()
        raise
    return sock


def set_buffers(sock: socket.socket, nbytes: int) -> None:
    """Ask for ``nbytes`` send and receive buffers (the kernel may cap them)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, nbytes)
        except OSError:
            pass


def _tcp_connect(host: str, port: int, timeout_s: float, buffer_bytes: int) -> socket.socket:
    """``socket.create_connection``, with the buffers set before ``connect``."""
    if not buffer_bytes:
        return socket.create_connection((host, port), timeout=timeout_s)
    err: OSError | None = None
    for fam, kind, proto, _, addr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(fam, kind, proto)
        try:
            set_buffers(sock, buffer_bytes)
            sock.settimeout(timeout_s)
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            err = exc
    raise err if err is not None else OSError(f"cannot resolve {host}")
