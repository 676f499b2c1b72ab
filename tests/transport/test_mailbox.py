"""Shared-memory negotiation mailboxes and socket doorbells (transport/mailbox.py)."""

from __future__ import annotations

import os
import socket
import tempfile
import threading

import pytest

from ronde._errors import ProtocolError
from ronde.core import protocol, rounds
from ronde.transport import mailbox, wire
from ronde.transport.mailbox import Mailboxes


@pytest.fixture
def pair():
    d = tempfile.mkdtemp()

    def path(r: int) -> str:
        return os.path.join(d, f"mb-{r}")

    # each maps the other's segment once it exists: made at once, as two ranks do
    made: dict[int, Mailboxes] = {}
    threads = [threading.Thread(target=lambda r=r: made.setdefault(
        r, Mailboxes(r, [1 - r], path, 5.0))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = made[0], made[1]
    yield a, b
    a.close()
    b.close()


def test_frames_alternate_between_two_slots(pair):
    a, b = pair
    assert b.take(0, 1) is None  # nothing posted yet
    assert not b.ahead(0)
    assert a.post(1, b"round one")
    assert b.ahead(0) and not b.ahead(1)
    assert b.take(0, 1) == b"round one"
    assert a.post(2, b"round two")
    # round 1's slot is untouched by round 2: a late reader still gets it
    assert b.take(0, 1) == b"round one"
    assert b.take(0, 2) == b"round two"
    assert a.post(3, b"")
    assert b.take(0, 3) == b""


def test_a_frame_larger_than_a_slot_is_marked_for_the_socket(pair):
    a, b = pair
    assert not a.post(1, b"x" * (mailbox.SLOT_BYTES + 1))
    assert b.take(0, 1) == mailbox.ON_SOCKET


def test_segments_are_unlinked_once_every_peer_mapped_them(pair):
    a, b = pair
    a.post(1, b"x")
    b.post(1, b"y")
    assert not os.path.exists(a._path) and not os.path.exists(b._path)


def test_sleeping_flag_is_seen_by_the_peer(pair):
    a, b = pair
    assert a.sleepers() == []
    b.set_sleeping(True)
    assert a.sleepers() == [1]
    b.set_sleeping(False)
    assert a.sleepers() == []


@pytest.mark.parametrize("length", [-2, mailbox.SLOT_BYTES + 1, 1 << 40])
def test_a_hostile_length_is_a_protocol_error(pair, length):
    a, b = pair
    a.post(1, b"ok")
    a._my_hdr[mailbox.LEN0 + 1] = length
    with pytest.raises(ProtocolError):
        b.take(0, 1)


def test_a_peer_two_rounds_ahead_is_a_protocol_error(pair):
    a, b = pair
    a._my_hdr[mailbox.SEQ] = 5
    with pytest.raises(ProtocolError):
        b.take(0, 1)


def test_frame_reader_skips_doorbells():
    x, y = socket.socketpair()
    try:
        reader = rounds.FrameReader(y)
        frame = wire.encode_frame(protocol.KIND_ROUND, b"payload")
        x.sendall(protocol.DOORBELL + protocol.DOORBELL + frame + protocol.DOORBELL)
        reader.fill()
        assert reader.has_frame()
        assert reader.peek() == b"payload"
        assert reader.pop() == b"payload"
        assert not reader.has_frame() and reader.pop() is None
        assert reader.buf == bytearray()
    finally:
        x.close()
        y.close()


def test_a_doorbell_with_a_payload_is_a_protocol_error():
    x, y = socket.socketpair()
    try:
        reader = rounds.FrameReader(y)
        x.sendall(wire.encode_frame(protocol.KIND_DOORBELL, b"junk"))
        reader.fill()
        with pytest.raises(ProtocolError):
            reader.has_frame()
    finally:
        x.close()
        y.close()


def test_sleeping_flag_stays_up_while_any_thread_sleeps(pair):
    # Two threads of one process may sleep in select at once (the control thread and a
    # caller driving a round). The flag must stay up until the last one wakes: when the
    # first waker lowered it, the other lost its doorbell and slept its full timeout
    # (training steps stalled for 500 ms now and then).
    from ronde._config import load
    from ronde.core.exchange import Exchange

    a, b = pair
    x, y = socket.socketpair()
    try:
        ex = Exchange(0, 2, {1: x}, a, load({}), str)
        assert not ex.before_block(0)  # the control thread goes to sleep
        assert b.sleepers() == [0]
        assert not ex.before_block(0)  # a driver waits for a frame too
        ex.after_block()  # the control thread wakes first
        assert b.sleepers() == [0]  # the driver still sleeps: peers must still ring
        ex.after_block()
        assert b.sleepers() == []
        b.post(1, b"frame")
        assert ex.before_block(0)  # a post already there: do not sleep on it
        ex.after_block()
    finally:
        x.close()
        y.close()


def test_a_peer_that_posts_its_last_round_and_exits_is_not_lost(pair, monkeypatch):
    # A peer posts its shutdown round to the mailbox, then exits. When this rank saw
    # the socket's EOF before the post, it called the peer lost ("exited without calling
    # shutdown()") and the job failed at a clean shutdown: its last frame comes first.
    from ronde._config import load
    from ronde.core.exchange import Exchange

    a, b = pair
    x, y = socket.socketpair()
    real_take, calls = a.take, []

    def late_take(r, round_no):  # the post lands just after this rank first looked
        calls.append(r)
        return None if len(calls) == 1 else real_take(r, round_no)

    monkeypatch.setattr(a, "take", late_take)
    try:
        ex = Exchange(0, 2, {1: x}, a, load({"RONDE_SPIN_TIME": "0"}), str)
        b.post(1, protocol.pack_round(protocol.RoundMessage(shutdown=True), b"tail"))
        y.close()
        messages, blobs = [protocol.SILENT] * 2, [b"", b""]
        ex.run(1, protocol.pack_round(protocol.SILENT), messages, blobs, lambda: None, set())
        assert messages[1].shutdown and blobs[1] == b"tail"
    finally:
        x.close()
