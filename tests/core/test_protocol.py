"""The negotiation protocol (core/protocol.py): typed round messages, one codec."""

from __future__ import annotations

import numpy as np
import pytest

from ronde import ProtocolError
from ronde.core import protocol
from ronde.core.protocol import (Abort, ById, ByName, Decoder, Inline, Notice,
                                 ProcessSetRequest, RoundMessage, Tuning)
from ronde.core.requests import Kind, Request


def _full() -> RoundMessage:
    meta = Request(Kind.ALLREDUCE, "g", np.ones(3, np.float32)).meta()
    return RoundMessage(
        announced=(ByName("g", meta), ById(4), Inline(5, 0, 12)), joins=(0, 2),
        ps_requests=(ProcessSetRequest("add", (0, 1)), ProcessSetRequest("remove", (3,))),
        abort=Abort(("a", "b"), "stalled"), ask_stacks=(1,), stack="  File x", shutdown=True,
        waiting=7, notice=Notice(2, "rank 2 was lost"), tune=Tuning(1 << 20, 2.5, 0, 50.0))


def test_every_field_survives_the_wire():
    sent = _full()
    got, blob = Decoder().unpack(protocol.pack_round(sent, b"x" * 12), 1)
    assert blob == b"x" * 12
    for field in RoundMessage.__slots__[:-1]:
        assert getattr(got, field) == getattr(sent, field), field
    assert [type(a) for a in got.announced] == [ByName, ById, Inline]
    assert got.moves() and not got.only_announces()


def test_an_empty_message_is_silent_and_says_nothing():
    got, _ = Decoder().unpack(protocol.pack_round(protocol.SILENT), 0)
    assert got is protocol.SILENT
    assert not got.moves() and not got.only_announces()
    assert protocol.encode(protocol.SILENT) == {}


@pytest.mark.parametrize("obj", [
    [], {"a": 3}, {"a": [[1, 2]]}, {"a": [["n", 5]]}, {"a": [True]}, {"a": [[1, 2, "3"]]},
    {"j": [1.5]}, {"j": "0"}, {"ps": [["add"]]}, {"ps": [["drop", 1]]},
    {"ps": [["add", ["x"]]]}, {"ps": [["remove", [1]]]}, {"x": {"names": ["a"]}},
    {"x": {"names": [1], "message": "m"}}, {"k": [None]}, {"st": 3}, {"w": "1"},
    {"w": True}, {"f": [1]}, {"f": ["r", "m"]}, {"t": [1, 2.0, 0]}, {"t": [-1, 1.0, 0, 0]},
    {"t": [1, 0, 0, 0]}, {"t": [1.5, 1.0, 0, 0]}, {"t": [1, "1", 0, 0]}, {"t": [1, 1, 0, -5]},
])
def test_malformed_fields_are_protocol_errors_naming_the_rank(obj):
    with pytest.raises(ProtocolError, match="rank 3"):
        Decoder().decode(obj, 3)


def test_truncated_and_overlong_payloads_are_rejected():
    payload = protocol.pack_round(_full())
    with pytest.raises(ProtocolError, match="rank 2"):
        protocol.unpack_round(payload[:3], 2)
    with pytest.raises(ProtocolError, match="rank 2"):
        protocol.unpack_round(b"\xff\xff\xff\xff{}", 2)


def test_a_repeated_announcement_list_decodes_to_the_same_objects():
    # training announces the same ids step after step: one list comparison, no new
    # objects; another list still reuses each id's ById
    dec = Decoder()
    first = dec.decode({"a": [0, 1, 2]}, 1).announced
    again = dec.decode({"a": [0, 1, 2]}, 1).announced
    assert again is first
    other = dec.decode({"a": [2, 1]}, 1).announced
    assert other == (ById(2), ById(1)) and other[0] is first[2]
    assert dec.decode({"a": [0, 1, 2]}, 0).announced == first  # per rank


def test_inline_spans_are_checked_against_the_binary_part():
    protocol.check_inline(Inline(0, 4, 8), 8, 12, "rank 1")
    for bad in (Inline(0, -1, 8), Inline(0, 8, 8), Inline(0, 0, 4)):
        with pytest.raises(ProtocolError, match="rank 1 sent inline data out of bounds"):
            protocol.check_inline(bad, 8, 12, "rank 1")


def test_a_steady_round_of_cached_ids_travels_packed_not_as_json():
    # what a training step's rounds say once every name is cached: ids only. They go as
    # packed 32-bit integers (no JSON written or parsed on the step path), decode to the
    # same announcements (one ById object per id, the memo reused), and anything else
    # (an inline or named announcement, another field) still goes as JSON
    sent = RoundMessage(announced=(ById(4), ById(70000), ById(0)))
    payload = protocol.pack_round(sent, b"blob")
    body, blob = protocol.split(payload, 0)
    assert body == b"\x00" + np.array([4, 70000, 0], "<u4").tobytes() and blob == b"blob"
    dec = Decoder()
    got, _ = dec.unpack(payload, 1)
    assert got.announced == sent.announced and got.only_announces()
    again, _ = dec.unpack(payload, 1)
    assert again.announced is got.announced  # the memo: no new objects a step
    for other in (RoundMessage(announced=(ById(4), Inline(5, 0, 4))),
                  RoundMessage(announced=(ById(4),), waiting=3),
                  RoundMessage(announced=(ById(1 << 33),))):
        body, _ = protocol.split(protocol.pack_round(other), 0)
        assert body[:1] == b"{"
        assert Decoder().unpack(protocol.pack_round(other), 0)[0].announced == other.announced
    # untrusted bytes: a packed part of a wrong length is a ProtocolError naming the rank
    for bad in (b"\x00", b"\x00\x01\x02", b"\x00" + b"\x01" * 6):
        with pytest.raises(ProtocolError, match="rank 5"):
            Decoder().unpack(protocol.join(bad, b""), 5)
