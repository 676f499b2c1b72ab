"""``transport/ready.py``: readiness of sockets numbered past select's FD_SETSIZE (1024),
which the coordinator of a thousand ranks holds (``select.select`` raised
``ValueError`` there before every wait went through ``ready.wait``)."""

from __future__ import annotations

import os
import socket

import pytest

from ronde.transport import ready


@pytest.fixture
def high_pair():
    a, b = socket.socketpair()
    fd = os.dup2(a.fileno(), 1500)
    high = socket.socket(fileno=fd)
    a.close()
    yield high, b
    high.close()
    b.close()


def test_a_socket_numbered_past_1024_is_seen_ready(high_pair):
    high, peer = high_pair
    with pytest.raises(ValueError):
        import select

        select.select([high], [], [], 0)  # what the waits called before
    assert ready.wait([high], [], 0.0) == ([], [])
    peer.send(b"x")
    low_r, low_w = socket.socketpair()
    try:
        readable, writable = ready.wait([high, low_r], [high], 1.0)
        assert readable == [high] and writable == [high]
        low_w.send(b"y")
        readable, _ = ready.wait([high, low_r], [], 1.0)
        assert sorted(map(id, readable)) == sorted([id(high), id(low_r)])
        fd = low_r.fileno()  # a bare descriptor (the engine's wake pipe) beside them
        assert ready.wait([high, fd], [], 1.0)[0] in ([high, fd], [fd, high])
    finally:
        low_r.close()
        low_w.close()


def test_few_low_sockets_take_select_and_a_closed_one_is_an_error():
    a, b = socket.socketpair()
    b.send(b"x")
    assert ready.wait([a], [b], 1.0) == ([a], [b])
    a.close()
    with pytest.raises(ValueError):
        ready.wait([a], [], 0.0)
    b.close()
