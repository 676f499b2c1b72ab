"""The coordinator's bundle: what rank 0 sends every rank is checked like any frame
from a peer (untrusted), and carries exactly the frames it was given."""

from __future__ import annotations

import struct

import pytest

from ronde import ProtocolError
from ronde.core import coordinator
from ronde.transport import wire


def _body(frame: bytes) -> bytes:
    kind, length = wire.decode_header(frame[: wire.HEADER_BYTES])
    assert kind == coordinator.KIND_BUNDLE and length == len(frame) - wire.HEADER_BYTES
    return frame[wire.HEADER_BYTES:]


def test_a_bundle_carries_every_frame_it_was_given():
    frames = {0: b"zero", 3: b"", 1: b"x" * 1000}
    assert coordinator.unpack_bundle(_body(coordinator.pack_bundle(frames)), 4) == frames


@pytest.mark.parametrize("mangle", [
    lambda b: b[:3],                                      # truncated count
    lambda b: b[:-1],                                     # a frame cut short
    lambda b: b + b"extra",                               # trailing bytes
    lambda b: struct.pack("<I", 9) + b[4:],               # more entries than present
    lambda b: b[:4] + struct.pack("<II", 7, 4) + b[12:],  # a rank beyond the job
    lambda b: b[:4] + struct.pack("<II", 0, 1 << 30) + b[12:],  # a length beyond it
], ids=["count", "short", "trailing", "entries", "rank", "length"])
def test_a_malformed_bundle_is_a_protocol_error(mangle):
    body = _body(coordinator.pack_bundle({0: b"abcd", 1: b"efgh"}))
    with pytest.raises(ProtocolError, match="bundle"):
        coordinator.unpack_bundle(mangle(body), 4)


def test_a_rank_twice_in_a_bundle_is_refused():
    body = struct.pack("<I", 2) + struct.pack("<II", 1, 1) + b"a" + struct.pack("<II", 1, 1) + b"b"
    with pytest.raises(ProtocolError):
        coordinator.unpack_bundle(body, 4)
