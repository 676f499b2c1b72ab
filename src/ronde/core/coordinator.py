"""Negotiation through a coordinator: each rank's round frame goes to rank 0, which
sends every rank all the frames (Horovod's coordinator, without its decisions).

Where it sits: ``exchange.py`` moves a round's frames all-to-all, ``N - 1`` sends and
receives per rank and ``N(N - 1)`` messages in all: fastest for a few ranks, but at 16
ranks on 2 cores the system calls and wake-ups of 240 messages per round cost more than
the collective. From ``RONDE_COORDINATOR_MIN`` ranks on (and without same-host
mailboxes) a round costs ``3(N - 1)`` messages at most: every rank sends its frame to
rank 0 and receives one *bundle* of all frames back, so every rank still decides from
the same inputs, with the same code, as in the all-to-all exchange (nothing of the
decision moves to rank 0).

What a bundle carries: each distinct JSON part of the round's frames once, with the bit
mask of the ranks that sent it, then the ranks' binary parts (inline data); every rank
decodes each distinct part once. In training's steady state (every rank announcing the
same cached ids) that is one part and a bit vector of the ranks: a member receives and
decodes the same few bytes whatever N is, as with Horovod's bit-vector response cache,
and its negotiator's steady memo sees one message object N times (an identity test per
rank). Only the coordinator handles N frames a round.

Who starts a round: a rank with something to announce sends its frame; the coordinator
starts the round when a frame arrives (or it has one itself) and sends a *go* to every
rank whose frame it does not have yet, which makes their control threads take part (in
the all-to-all exchange the first frame to arrive does that). The coordinator is the
lowest rank still here: rank 0, until it shut down and left (ranks may leave while
others go on with a process set of their own); a rank whose coordinator's socket closes
after its shutdown sends the same round's frame to the next one, and frames that
arrive early at a rank that is about to coordinate stay buffered for it. A coordinator
leaves only between rounds, after every bundle went out. Failure: the coordinator sees a
rank's socket close; its error, with the failure notice it sends every live rank
before it leaves, ends the others' rounds naming the lost rank. A rank that loses its
coordinator (not shut down) fails naming it. A rank that stops answering (alive, its
socket open) is named by the coordinator after ``RONDE_STALL_SHUTDOWN_TIME``; members
wait for their bundle a second longer, so that they fail on its notice instead of
blaming the coordinator, which was only waiting too.

Every byte of a bundle is untrusted: its masks must hold ranks of the job, each once, and
include the coordinator and the receiver; a live rank it leaves out must have shut
down; its lengths must lie inside it; each frame then goes through the same decoder as
a frame from that rank itself.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, NamedTuple

from .._errors import PeerLostError, ProtocolError
from ..transport import ready, wire
from . import channels, protocol
from .channels import Channels

#: the coordinator asks a rank to take part in the round it started
KIND_GO = 5
#: the coordinator's bundle of every rank's frame for one round
KIND_BUNDLE = 6
GO = wire.encode_frame(KIND_GO, b"")
#: how much longer a rank waits for an answer per rank that waits on others in between
#: (a member for its bundle, while the coordinator waits for a silent rank): the rank
#: nearest the silent one times out first and names it, the others fail on its notice
LEVEL_MARGIN_S = 1.0
_U32 = struct.Struct("<I")
_ENTRY = struct.Struct("<II")


class Grouped(NamedTuple):
    """One round's frames with the same JSON parts told once: ``parts`` maps each
    distinct JSON part to the bit mask of the ranks that sent it (bit ``r`` for rank
    ``r``); ``blobs`` holds the non-empty binary parts (inline data) by rank. In training's
    steady state every rank sends the same part, so a bundle is one part and a mask of
    ``N / 8`` bytes, and every rank decodes one message, not ``N``."""

    parts: dict[bytes, int]
    blobs: dict[int, bytes]


def group(frames: dict[int, bytes]) -> Grouped:
    """``frames`` (rank -> round payload) grouped by JSON part (lengths checked)."""
    same: dict[bytes, int] = {}  # whole payloads first: hashing them is C, splitting not
    for r, payload in frames.items():
        same[payload] = same.get(payload, 0) | (1 << r)
    parts: dict[bytes, int] = {}
    blobs: dict[int, bytes] = {}
    for payload, mask in same.items():
        body, blob = protocol.split(payload, mask.bit_length() - 1)
        parts[body] = parts.get(body, 0) | mask
        if blob:
            for r in ranks_of(mask, mask.bit_length()):
                blobs[r] = blob
    return Grouped(parts, blobs)


def ranks_of(mask: int, size: int) -> list[int]:
    """The ranks below ``size`` whose bits ``mask`` sets, in order."""
    bits = bin(mask)[:1:-1][:size]  # bit r at index r
    return [r for r, b in enumerate(bits) if b == "1"]


def pack_bundle(g: Grouped, kind: int = KIND_BUNDLE) -> bytes:
    """One bundle frame carrying the grouped frames of a round (or, with the tree's
    ``kind``, of a subtree)."""
    out = [_U32.pack(len(g.parts))]
    for body, mask in g.parts.items():
        bits = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
        out += [_U32.pack(len(bits)), bits, _U32.pack(len(body)), body]
    out.append(_U32.pack(len(g.blobs)))
    for r, blob in g.blobs.items():
        out += [_ENTRY.pack(r, len(blob)), blob]
    return wire.encode_frame(kind, b"".join(out))


def unpack_bundle(payload: bytes, size: int,
                  sender: str = "the negotiation coordinator") -> Grouped:
    """The grouped frames of a bundle (or of a tree's aggregate, ``tree.py``) that
    ``sender`` sent, checked: masks non-empty, disjoint and of ranks
    below ``size``, each part once, blobs only of ranks present and each once, lengths
    inside the bundle, nothing after it."""
    view = memoryview(payload)
    off = 0

    def take(n: int) -> bytes:
        nonlocal off
        if n > len(payload) - off:
            raise ValueError
        off += n
        return bytes(view[off - n: off])

    try:
        parts: dict[bytes, int] = {}
        seen = 0
        (count,) = _U32.unpack(take(4))
        for _ in range(count):
            mask = int.from_bytes(take(_U32.unpack(take(4))[0]), "little")
            body = take(_U32.unpack(take(4))[0])
            if mask == 0 or mask >> size or mask & seen or body in parts:
                raise ValueError
            seen |= mask
            parts[body] = mask
        blobs: dict[int, bytes] = {}
        (count,) = _U32.unpack(take(4))
        for _ in range(count):
            r, n = _ENTRY.unpack(take(_ENTRY.size))
            if r in blobs or r >= size or not seen >> r & 1:
                raise ValueError
            blobs[r] = take(n)
    except (struct.error, ValueError):
        raise ProtocolError(f"{sender} sent a malformed bundle") from None
    if off != len(payload):
        raise ProtocolError(f"{sender} sent a bundle with trailing bytes")
    return Grouped(parts, blobs)


def decode(decoder: protocol.Decoder, g: Grouped, size: int, messages: list[protocol.RoundMessage],
           blobs: list[bytes], ranks: set[int],
           check: Callable[[Any, int], None] = lambda msg, r: None) -> set[int]:
    """Each distinct JSON part decoded once (in the name of its lowest rank, then
    ``check``-ed) into ``messages`` of the ``ranks`` that sent it, with their blobs;
    returns the ranks present."""
    present: set[int] = set()
    for body, mask in g.parts.items():
        senders = ranks_of(mask, size)
        present.update(senders)
        mine = ranks.intersection(senders)
        if not mine:
            continue
        msg = decoder.decode_part(body, senders[0])
        check(msg, senders[0])
        for r in mine:
            messages[r] = msg
            blobs[r] = g.blobs.get(r, b"")
    return present


class _CoordinatorLeft(Exception):
    """This round's coordinator left after its shutdown: ask the next one."""


def coordinator(ch: Channels) -> int:
    """The rank that coordinates this rank's next round: the lowest rank still here (a
    rank that announced its shutdown and closed its sockets is not)."""
    return min([ch.rank, *ch.live()])


def run(ch: Channels, round_no: int, payload: bytes, messages: list[protocol.RoundMessage],
        blobs: list[bytes], failed: Callable[[], BaseException | None],
        shut_down: set[int]) -> None:
    """One round through the coordinator (what :meth:`Exchange.run` does then)."""
    while True:
        root = coordinator(ch)
        if root == ch.rank:
            _run_root(ch, payload, messages, blobs, failed, shut_down)
            return
        try:
            _run_member(ch, root, payload, messages, blobs, failed, shut_down)
            return
        except _CoordinatorLeft:
            continue  # the same round's frame goes to the next coordinator


def _run_root(ch: Channels, payload: bytes, messages: list[protocol.RoundMessage],
              blobs: list[bytes],
              failed: Callable[[], BaseException | None], shut_down: set[int]) -> None:
    ch.await_members(shut_down, failed)  # after a failover the members connect now
    live = ch.live()
    got: dict[int, bytes] = {ch.rank: payload}
    for r in live:
        frame = _pop(ch, r)
        if frame is not None:
            got[r] = frame
    to_send = {r: memoryview(GO) for r in live if r not in got}
    waiting = set(live) - set(got)
    wait = channels.Wait(ch, failed)
    while waiting or to_send:
        rlist = [ch.readers[r].sock for r in waiting]
        wlist = [ch.readers[r].sock for r in to_send]
        readable, writable = ready.wait(rlist, wlist, 0.5)
        ch.send_some(writable, to_send)
        for s in readable:
            r = ch.rank_of(s)
            reader = ch.readers[r]
            reader.fill()
            frame = _pop(ch, r)
            if frame is not None:
                got[r] = frame
                waiting.discard(r)
            elif reader.eof:
                ch.peer_closed(r, shut_down)  # raises unless r shut down
                waiting.discard(r)
                to_send.pop(r, None)
        wait.check(waiting)
    live = ch.live()
    grouped = group({r: got[r] for r in [ch.rank, *live]})
    decode(ch.decoder, grouped, ch.size, messages, blobs, set(live), ch.check_notice)
    bundle = memoryview(pack_bundle(grouped))
    to_send = {r: bundle for r in live}
    while to_send:
        _, writable = ready.wait([], [ch.readers[r].sock for r in to_send], 0.5)
        ch.send_some(writable, to_send)
        err = failed()
        if err is not None:
            raise err


def _run_member(ch: Channels, root_rank: int, payload: bytes,
                messages: list[protocol.RoundMessage], blobs: list[bytes],
                failed: Callable[[], BaseException | None],
                shut_down: set[int]) -> None:
    root = ch.reader(root_rank, shut_down, failed)
    if root is None:  # it shut down and left before this rank connected
        raise _CoordinatorLeft
    to_send = {root_rank: memoryview(wire.encode_frame(protocol.KIND_ROUND, payload))}
    wait = channels.Wait(ch, failed, LEVEL_MARGIN_S)
    while True:
        _other_sockets(ch, root_rank, shut_down)
        got = root.pop_frame()
        if got is not None:
            kind, body = got
            if kind == KIND_BUNDLE:
                break
            if kind == protocol.KIND_ROUND:  # its failure notice
                ch.check_notice(ch.decoder.unpack(body, root_rank)[0], root_rank)
                raise ProtocolError(f"rank {root_rank} sent a round frame outside a bundle")
            if kind != KIND_GO:
                raise ProtocolError(f"rank {root_rank} sent control frame kind {kind}")
            continue  # a go: this rank takes part already
        if root.eof:
            if root_rank in shut_down:  # it left after its shutdown, between rounds
                ch.left(root_rank)
                raise _CoordinatorLeft
            raise PeerLostError(f"rank {ch.describe_rank(root_rank)} (the negotiation "
                                "coordinator) exited or lost its connection", rank=root_rank)
        readable, writable = ready.wait([root.sock], [root.sock] if to_send else [], 0.5)
        ch.send_some(writable, to_send)
        if readable:
            root.fill()
        wait.check({root_rank})
    grouped = unpack_bundle(body, ch.size)
    live = ch.live()
    present = decode(ch.decoder, grouped, ch.size, messages, blobs, set(live),
                     ch.check_notice)
    if root_rank not in present or ch.rank not in present:
        raise ProtocolError(f"rank {root_rank} sent a negotiation bundle without its or "
                            "this rank's frame")
    for r in live:
        if r in present:
            continue
        if r in shut_down:
            ch.left(r)  # the coordinator saw it leave: so does every rank, this round
        else:
            raise ProtocolError(f"rank {root_rank} left rank {r} out of a negotiation bundle")


def _other_sockets(ch: Channels, root_rank: int, shut_down: set[int]) -> None:
    """What the sockets to ranks other than this round's coordinator carry: a failure
    notice (a rank that lost a peer tells everyone: raised here), their close, or what
    a rank that already coordinates, or one that takes this rank for the coordinator,
    sent early (left buffered for that round)."""
    for r in ch.connected():
        if r == root_rank:
            continue
        reader = ch.readers[r]
        got = reader.peek_frame()
        if got is not None:
            kind, body = got
            if kind == protocol.KIND_ROUND:
                ch.check_notice(ch.decoder.unpack(body, r)[0], r)
            elif kind not in (KIND_GO, KIND_BUNDLE):
                raise ProtocolError(f"rank {r} sent control frame kind {kind}")
        elif reader.eof:
            ch.peer_closed(r, shut_down)


def _pop(ch: Channels, r: int) -> bytes | None:
    """Rank ``r``'s round frame, if complete (the coordinator's side: only round frames
    arrive)."""
    got = ch.readers[r].pop_frame()
    if got is None:
        return None
    kind, body = got
    if kind != protocol.KIND_ROUND:
        raise ProtocolError(f"rank {r} sent control frame kind {kind} to the coordinator")
    return body
