"""Authentication and framing: a peer without the secret gets nothing accepted."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from ronde import AuthenticationError, ProtocolError
from ronde.runner.rendezvous import RendezvousServer, register
from ronde.transport import wire

pytestmark = pytest.mark.timeout(30)


def test_frames_roundtrip_and_bounds():
    a, b = socket.socketpair()
    wire.send_frame(a, 3, b'{"x":1}')
    assert wire.recv_frame(b, time.monotonic() + 2) == (3, b'{"x":1}')
    a.sendall(struct.pack("!2sBI", b"rd", 3, wire.MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="exceeds limit"):
        wire.recv_frame(b, time.monotonic() + 2)
    a.sendall(b"GET / HTTP/1.1\r\n")
    with pytest.raises(ProtocolError, match="bad frame magic"):
        wire.recv_frame(b, time.monotonic() + 2)


def test_mutual_authentication():
    a, b = socket.socketpair()
    errors = []

    def server(secret):
        try:
            wire.authenticate_server(b, secret, time.monotonic() + 2)
        except (AuthenticationError, ConnectionError) as exc:
            errors.append(exc)

    t = threading.Thread(target=server, args=(b"s3cret",))
    t.start()
    wire.authenticate_client(a, b"s3cret", time.monotonic() + 2)
    t.join()
    assert not errors
    errors.clear()
    a, b = socket.socketpair()
    t = threading.Thread(target=server, args=(b"other",))
    t.start()
    with pytest.raises(AuthenticationError, match="does not hold this job's secret"):
        wire.authenticate_client(a, b"s3cret", time.monotonic() + 2)
    a.close()
    t.join()


def test_rendezvous_survives_garbage_and_unauthenticated_peers():
    secret = os.urandom(32)
    srv = RendezvousServer(2, secret).start()
    try:
        for junk in (b"", b"\x00" * 100, os.urandom(4096), b"rd" + os.urandom(16)):
            s = socket.create_connection(srv.address)
            s.sendall(junk)
            s.close()
        with pytest.raises(AuthenticationError):
            register(srv.address, b"wrong", {"rank": 0, "size": 2, "generation": 1}, 5)
        results = {}

        def reg(r):
            results[r] = register(srv.address, secret,
                                  {"rank": r, "size": 2, "generation": 1, "host": "h"}, 10)

        threads = [threading.Thread(target=reg, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [p["rank"] for p in results[0]] == [0, 1] == [p["rank"] for p in results[1]]
    finally:
        srv.close()


def test_start_up_errors_say_what_is_wrong():
    from ronde import RendezvousError

    info = {"rank": 1, "size": 2, "generation": 1, "host": "h"}
    with pytest.raises(RendezvousError, match="cannot resolve rendezvous host"):
        register(("no-such-host.invalid", 1234), b"s", info, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    t = time.monotonic()
    with pytest.raises(RendezvousError, match=r"cannot reach the rendezvous service .*refused"):
        register(("127.0.0.1", port), b"s", info, 1.5)
    assert time.monotonic() - t < 5
