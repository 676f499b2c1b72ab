"""One thread admits every connection (issue #32): a flood of silent or half-open
connections costs no thread, cannot end the acceptor, and does not keep a real peer out."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from ronde.transport import wire
from ronde.transport.admission import Admission

pytestmark = pytest.mark.timeout(30)
log = logging.getLogger("test")


def serve(secret: bytes, **kw):
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[tuple[int, bytes, bool]] = []

    def admitted(conn, peer, kind, payload, proven):
        got.append((kind, payload, proven))
        wire.send_frame(conn, 9, b"welcome")
        conn.close()

    rejections = wire.Rejections(log, "test")
    adm = Admission(listener, secret, admitted, rejections=rejections, max_frame_bytes=1024,
                    name="test-admission", **kw).start()
    return listener, adm, got, rejections


def hello(port: int, secret: bytes, payload: bytes = b'{"x":1}') -> bytes:
    s = wire.connect("127.0.0.1", port, secret, 5.0)
    try:
        wire.send_frame(s, 4, payload)
        return wire.recv_frame(s, time.monotonic() + 5)[1]
    finally:
        s.close()


def test_a_flood_costs_no_thread_and_a_real_peer_gets_in() -> None:
    secret = os.urandom(32)
    listener, adm, got, rejections = serve(secret, max_pending=50, deadline_s=1.0)
    port = listener.getsockname()[1]
    threads = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    for s in flood[:20]:
        s.sendall(b"rd")  # half a hello, then silence
    time.sleep(0.3)
    assert threading.active_count() <= threads  # was one thread per connection
    # over the cap: the oldest make room at once; the rest: closed at their deadline
    deadline = time.monotonic() + 10
    while rejections.count < 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rejections.count == 200
    assert hello(port, secret) == b"welcome"
    assert got == [(4, b'{"x":1}', True)]
    for s in flood:
        s.close()
    adm.close()
    adm.join(2)
    listener.close()


def test_a_real_peer_gets_in_past_a_full_table_of_stalled_hellos() -> None:
    """Every handshake slot held by a connection that sent a valid hello and stalled
    (issue #50): the newcomer was closed, hello unread, so a real peer got a reset. Now
    the oldest unproven connection makes room, and one that proved the secret keeps its
    slot whatever arrives after it."""
    secret = os.urandom(32)
    listener, adm, got, rejections = serve(secret, max_pending=8, deadline_s=30.0)
    port = listener.getsockname()[1]
    flood = []
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(wire.MAGIC + os.urandom(wire.NONCE_BYTES))
        flood.append(s)
    # a peer that proved the secret and has yet to send its frame: never the one evicted
    proven = socket.create_connection(("127.0.0.1", port))
    wire.authenticate_client(proven, secret, time.monotonic() + 5)
    for _ in range(3):
        assert hello(port, secret) == b"welcome"  # was ConnectionResetError
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(wire.MAGIC + os.urandom(wire.NONCE_BYTES))
        flood.append(s)
    wire.send_frame(proven, 4, b'{"late":1}')
    assert wire.recv_frame(proven, time.monotonic() + 5)[1] == b"welcome"
    assert got.count((4, b'{"x":1}', True)) == 3 and (4, b'{"late":1}', True) in got
    for s in [*flood, proven]:
        s.close()
    adm.close()
    adm.join(2)
    listener.close()


def test_errors_on_one_connection_do_not_end_the_loop() -> None:
    secret = os.urandom(32)
    listener, adm, got, rejections = serve(secret)
    port = listener.getsockname()[1]
    for junk in (b"GET / HTTP/1.1\r\n\r\n", b"rd" + os.urandom(16) + os.urandom(32),
                 b"\x00" * 5000):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(junk)
            s.settimeout(2)
            try:
                while s.recv(100):
                    pass
            except OSError:
                pass
    with pytest.raises(Exception):
        hello(port, b"wrong secret, wrong secret!!")
    too_big = b"x" * 2000  # over max_frame_bytes
    with pytest.raises(ConnectionError):
        hello(port, secret, too_big)
    assert hello(port, secret) == b"welcome" and len(got) == 1
    assert rejections.count == 5
    adm.close()
    listener.close()


def test_an_idle_acceptor_sleeps_until_a_connection_or_close(monkeypatch) -> None:
    # it woke five times a second before, ~70 us of CPU each in a training process;
    # now it sleeps without a timeout while no handshake is pending, and close() wakes it
    import selectors

    from ronde.transport import admission

    timeouts: list[float | None] = []
    idle = threading.Event()

    class Counting(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
        def select(self, timeout=None):
            timeouts.append(timeout)
            idle.set()
            return super().select(timeout)

    monkeypatch.setattr(admission.selectors, "DefaultSelector", Counting)
    secret = os.urandom(32)
    listener, adm, got, _ = serve(secret, deadline_s=5.0)
    assert idle.wait(10)
    assert timeouts == [None]  # idle: no timeout at all
    assert hello(listener.getsockname()[1], secret) == b"welcome"
    assert any(t is not None and 0 < t <= 5.0 for t in timeouts)  # a handshake's deadline
    deadline = time.monotonic() + 10
    while timeouts[-1] is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert timeouts[-1] is None  # asleep again once it was admitted
    adm.close()
    adm.join(10)
    assert not adm._thread.is_alive()  # close() woke it
    listener.close()
