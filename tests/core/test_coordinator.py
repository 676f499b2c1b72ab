"""The coordinator's bundle: what rank 0 sends every rank is checked like any frame
from a peer (untrusted), carries exactly the frames it was given, and tells a JSON
part that several ranks sent once, with the bit mask of its senders."""

from __future__ import annotations

import struct

import pytest

from ronde import ProtocolError
from ronde.core import coordinator, protocol
from ronde.transport import wire


def _body(frame: bytes) -> bytes:
    kind, length = wire.decode_header(frame[: wire.HEADER_BYTES])
    assert kind == coordinator.KIND_BUNDLE and length == len(frame) - wire.HEADER_BYTES
    return frame[wire.HEADER_BYTES:]


def _frames(g: coordinator.Grouped, size: int) -> dict[int, bytes]:
    """The payloads a grouped round stands for (rank -> payload)."""
    out = {}
    for body, mask in g.parts.items():
        for r in coordinator.ranks_of(mask, size):
            out[r] = protocol.join(body, g.blobs.get(r, b""))
    return out


def _payload(msg: protocol.RoundMessage, blob: bytes = b"") -> bytes:
    return protocol.pack_round(msg, blob)


def test_a_bundle_carries_every_frame_it_was_given():
    frames = {0: _payload(protocol.SILENT), 3: _payload(protocol.RoundMessage(joins=(1,))),
              1: _payload(protocol.RoundMessage(announced=(protocol.Inline(4, 0, 8),)),
                          b"x" * 1000)}
    g = coordinator.unpack_bundle(_body(coordinator.pack_bundle(coordinator.group(frames))), 4)
    assert _frames(g, 4) == frames


def test_identical_frames_travel_once_with_a_mask_of_their_senders():
    steady = _payload(protocol.RoundMessage(announced=(protocol.ById(1), protocol.ById(2))))
    frames = {r: steady for r in range(64)}
    frames[5] = _payload(protocol.RoundMessage(announced=(protocol.ById(1),)))
    frame = coordinator.pack_bundle(coordinator.group(frames))
    assert len(frame) < 2 * len(steady) + 64  # one copy each, not 64
    g = coordinator.unpack_bundle(_body(frame), 64)
    assert sorted(g.parts.values()) == sorted([1 << 5, ((1 << 64) - 1) & ~(1 << 5)])
    assert _frames(g, 64) == frames


def test_frames_that_differ_only_in_inline_data_share_their_json_part():
    msg = protocol.RoundMessage(announced=(protocol.Inline(7, 0, 4),))
    frames = {r: _payload(msg, struct.pack("<f", r)) for r in range(8)}
    g = coordinator.group(frames)
    assert len(g.parts) == 1 and len(g.blobs) == 8
    assert _frames(coordinator.unpack_bundle(_body(coordinator.pack_bundle(g)), 8), 8) == frames


def _two() -> bytes:
    return _body(coordinator.pack_bundle(coordinator.group(
        {0: _payload(protocol.SILENT, b"abcd"),
         1: _payload(protocol.RoundMessage(joins=(2,)), b"efgh")})))


def _patch(body: bytes, at: int, fmt: str, *values: int) -> bytes:
    return body[:at] + struct.pack(fmt, *values) + body[at + struct.calcsize(fmt):]


# layout of _two(): count, [mask len 1, mask, body len, body] x 2, blob count, blobs
_MASK0 = 8  # the first mask byte


@pytest.mark.parametrize("mangle", [
    lambda b: b[:3],                                      # truncated count
    lambda b: b[:-1],                                     # a blob cut short
    lambda b: b + b"extra",                               # trailing bytes
    lambda b: _patch(b, 0, "<I", 9),                      # more parts than present
    lambda b: _patch(b, _MASK0, "<B", 1 << 6),            # a rank beyond the job
    lambda b: _patch(b, _MASK0, "<B", 0),                 # a part nobody sent
    lambda b: _patch(b, _MASK0, "<B", 3),                 # a rank in two parts
    lambda b: _patch(b, 4, "<I", 1 << 30),                # a length beyond the bundle
], ids=["count", "short", "trailing", "entries", "rank", "empty", "twice", "length"])
def test_a_malformed_bundle_is_a_protocol_error(mangle):
    body = _two()
    coordinator.unpack_bundle(body, 4)  # the unmangled one is fine
    with pytest.raises(ProtocolError, match="bundle"):
        coordinator.unpack_bundle(mangle(body), 4)


def test_a_blob_of_a_rank_not_in_the_bundle_or_twice_is_refused():
    head = _body(coordinator.pack_bundle(coordinator.Grouped({b"{}": 1}, {})))[:-4]
    for blobs in ([(3, b"x")], [(0, b"x"), (0, b"y")]):
        body = head + struct.pack("<I", len(blobs)) + b"".join(
            struct.pack("<II", r, len(x)) + x for r, x in blobs)
        with pytest.raises(ProtocolError, match="bundle"):
            coordinator.unpack_bundle(body, 4)


def test_a_member_decodes_what_each_frame_alone_would_say():
    shared = protocol.RoundMessage(announced=(protocol.ById(3), protocol.Inline(4, 0, 4)))
    frames = {r: _payload(shared, struct.pack("<f", r)) for r in range(6)}
    frames[2] = _payload(protocol.RoundMessage(joins=(0,), shutdown=True))
    g = coordinator.unpack_bundle(_body(coordinator.pack_bundle(coordinator.group(frames))), 6)
    messages, blobs = [protocol.SILENT] * 6, [b""] * 6
    present = coordinator.decode(protocol.Decoder(), g, 6, messages, blobs, {0, 1, 2, 3, 5})
    assert present == set(range(6))
    for r in (0, 1, 2, 3, 5):
        alone, blob = protocol.unpack_round(frames[r], r)
        assert protocol.encode(messages[r]) == protocol.encode(alone) and blobs[r] == blob
    assert messages[4] is protocol.SILENT  # not asked for: this rank's own
    assert messages[0] is messages[5]  # one object for the ranks that sent the same part


def test_a_notice_in_a_bundle_is_checked_in_the_name_of_a_sender():
    frames = {0: _payload(protocol.SILENT),
              1: _payload(protocol.RoundMessage(notice=protocol.Notice(3, "gone")))}
    g = coordinator.group(frames)
    seen = []
    coordinator.decode(protocol.Decoder(), g, 4, [protocol.SILENT] * 4, [b""] * 4, {0, 1},
                       lambda msg, r: seen.append((r, msg.notice)))
    assert sorted(seen, key=lambda x: x[0]) == [(0, None), (1, protocol.Notice(3, "gone"))]
