"""The negotiation protocol: what one rank says to every peer in a round, typed.

Where it sits in the engine cycle: the control thread builds one :class:`RoundMessage`
per round (``Engine._build_message``); :func:`pack_round` encodes it into the frame's
payload (a length, a compact JSON part, then the binary part carrying inline allreduce
data; a steady training round, which only announces cached ids, sends them as packed
32-bit integers instead of JSON, so no text is written or parsed on the step path);
every peer's :class:`Decoder` turns the payload back into a :class:`RoundMessage`,
checking every field (the bytes come from an authenticated peer, but are still untrusted:
anything malformed is a :class:`~ronde.ProtocolError` naming the rank). The negotiator,
the crossed-collectives watch, the stall inspector and the exchange read only the typed
fields; the wire's one-letter keys appear in this module alone.

Announcements are of three types: :class:`ById` (a collective whose name and metadata
are in the response cache), :class:`Inline` (the same, for a small allreduce whose bytes
ride in the frame's binary part) and :class:`ByName` (a new name, or changed metadata).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple, Union

from .._errors import ProtocolError
from ..transport import wire

#: the frame kind of a round's payload
KIND_ROUND = 3
#: an empty frame that only wakes a peer sleeping in ``select`` (shm mailboxes)
KIND_DOORBELL = 4
DOORBELL = wire.encode_frame(KIND_DOORBELL, b"")


class ById(NamedTuple):
    """A collective announced by its response-cache id (name and metadata as cached)."""

    cid: int


class Inline(NamedTuple):
    """A cached small allreduce whose (prescaled) bytes ride in the frame: ``length``
    bytes at ``offset`` of the binary part."""

    cid: int
    offset: int
    length: int


class ByName(NamedTuple):
    """A collective announced in full: its name and its metadata as sent
    (:meth:`~ronde.core.requests.Request.meta`; parsed by ``requests.Meta``)."""

    name: str
    raw: list[Any]


Announcement = Union[ById, Inline, ByName]


class ProcessSetRequest(NamedTuple):
    """``add_process_set`` (``key``: the sorted ranks) or ``remove_process_set``
    (``key``: the one process-set id)."""

    action: str
    key: tuple[int, ...]


class Abort(NamedTuple):
    """Rank 0's stall inspector fails these pending collectives on every rank."""

    names: tuple[str, ...]
    message: str


class Notice(NamedTuple):
    """A peer is failing because ``rank`` was lost (None: the peer itself)."""

    rank: int | None
    message: str


class Tuning(NamedTuple):
    """From rank 0's autotuner (autotune.py): values every rank applies after this round."""

    fusion_threshold_bytes: int
    cycle_time_ms: float
    inline_bytes: int
    spin_time_us: float


class RoundMessage:
    """What one rank says in one round; a field is empty when it says nothing of it."""

    __slots__ = ("announced", "joins", "ps_requests", "abort", "ask_stacks", "stack",
                 "shutdown", "waiting", "notice", "tune", "wire_announced")

    def __init__(self, announced: tuple[Announcement, ...] = (),
                 joins: tuple[int, ...] = (),
                 ps_requests: tuple[ProcessSetRequest, ...] = (),
                 abort: Abort | None = None, ask_stacks: tuple[int, ...] = (),
                 stack: str | None = None, shutdown: bool = False,
                 waiting: int | None = None, notice: Notice | None = None,
                 tune: Tuning | None = None, wire_announced: list[Any] | None = None) -> None:
        #: new announcements, in this rank's submission order
        self.announced = announced
        #: process sets this rank joined (``join()``)
        self.joins = joins
        self.ps_requests = ps_requests
        #: from rank 0: stalled collectives to fail everywhere (stall.py)
        self.abort = abort
        #: from rank 0: ranks asked to send their main thread's stack
        self.ask_stacks = ask_stacks
        #: this rank's main-thread stack, when asked
        self.stack = stack
        self.shutdown = shutdown
        #: only waiting, at this negotiator progress count (crossed.py)
        self.waiting = waiting
        self.notice = notice
        #: from rank 0: autotuned values (autotune.py)
        self.tune = tune
        #: ``announced`` as it goes on the wire, where already known (a memo)
        self.wire_announced = wire_announced

    def moves(self) -> bool:
        """Whether this rank asks for anything new (announces, joins, process sets)."""
        return bool(self.announced or self.joins or self.ps_requests)

    def only_announces(self) -> bool:
        """Announcements and nothing else (what a steady training round says)."""
        return bool(self.announced) and not (
            self.joins or self.ps_requests or self.abort or self.ask_stacks or self.stack
            or self.shutdown or self.waiting is not None or self.notice or self.tune)

    def __repr__(self) -> str:
        fields = {k: getattr(self, k) for k in self.__slots__[:-1]}
        return "RoundMessage(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()
                                           if v not in ((), None, False)) + ")"


#: a rank that said nothing this round (or was not heard from)
SILENT = RoundMessage()


def encode_announcements(announced: tuple[Announcement, ...] | list[Announcement]
                         ) -> list[Any]:
    """The wire form: an id as an int, inline as ``[id, offset, length]``, by name as
    ``[name, meta]``."""
    return [a.cid if type(a) is ById else list(a) for a in announced]


def encode(msg: RoundMessage) -> dict[str, Any]:
    """The JSON part of a round message (a key only when it says something)."""
    out: dict[str, Any] = {}
    if msg.announced:
        out["a"] = (msg.wire_announced if msg.wire_announced is not None
                    else encode_announcements(msg.announced))
    if msg.joins:
        out["j"] = list(msg.joins)
    if msg.ps_requests:
        out["ps"] = [[p.action, list(p.key) if p.action == "add" else p.key[0]]
                     for p in msg.ps_requests]
    if msg.abort:
        out["x"] = {"names": list(msg.abort.names), "message": msg.abort.message}
    if msg.ask_stacks:
        out["k"] = list(msg.ask_stacks)
    if msg.stack:
        out["st"] = msg.stack
    if msg.shutdown:
        out["s"] = 1
    if msg.waiting is not None:
        out["w"] = msg.waiting
    if msg.notice is not None:
        out["f"] = [msg.notice.rank, msg.notice.message]
    if msg.tune is not None:
        out["t"] = list(msg.tune)
    return out


_JSON_LEN = struct.Struct("!I")
#: the first byte of a part that is only cached ids, packed (a JSON part starts with "{")
_IDS_ONLY = b"\x00"
_MAX_ID = (1 << 32) - 1


def pack_round(msg: RoundMessage, blob: bytes = b"") -> bytes:
    if msg.only_announces():
        raw = (msg.wire_announced if msg.wire_announced is not None
               else encode_announcements(msg.announced))
        if all(type(a) is int and 0 <= a <= _MAX_ID for a in raw):
            return join(_IDS_ONLY + struct.pack(f"<{len(raw)}I", *raw), blob)
    return join(wire.dumps(encode(msg)), blob)


def split(payload: bytes, rank: int) -> tuple[bytes, bytes]:
    """``(JSON part, binary part)`` of one round payload from ``rank`` (lengths checked)."""
    if len(payload) < _JSON_LEN.size:
        raise ProtocolError(f"rank {rank} sent a truncated negotiation message")
    (n,) = _JSON_LEN.unpack_from(payload)
    if n > len(payload) - _JSON_LEN.size:
        raise ProtocolError(f"rank {rank} sent a negotiation message with a bad length")
    end = _JSON_LEN.size + n
    return payload[_JSON_LEN.size: end], payload[end:]


def join(body: bytes, blob: bytes) -> bytes:
    """One round payload: the JSON part's length, the JSON part, the binary part (what
    :func:`split` takes apart)."""
    return _JSON_LEN.pack(len(body)) + body + blob


class Decoder:
    """Decodes peers' round payloads; remembers each rank's last announcement list, so
    that a training step announcing what the last one did costs one list comparison,
    not an object per announcement."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[Any, tuple[Announcement, ...]]] = {}  # (part, memo)
        #: one ById per id seen (ids repeat every step; bounded, see _announcements)
        self._ids: dict[int, ById] = {}

    def unpack(self, payload: bytes, rank: int) -> tuple[RoundMessage, bytes]:
        """``(message, binary part)`` of one payload from ``rank``."""
        body, blob = split(payload, rank)
        return self.decode_part(body, rank), blob

    def decode_part(self, body: bytes, rank: int) -> RoundMessage:
        """A round message from its first part: packed ids, or JSON."""
        if body[:1] != _IDS_ONLY:
            return self.decode(wire.loads(body), rank)
        if len(body) < 5 or (len(body) - 1) % 4:
            raise ProtocolError(f"rank {rank} sent a malformed negotiation message")
        msg = RoundMessage()
        last = self._last.get(rank)
        if last is not None and last[0] == body:
            msg.announced = last[1]
        else:
            raw = list(struct.unpack(f"<{(len(body) - 1) // 4}I", body[1:]))
            msg.announced = _announcements(raw, rank, self._ids)
            self._last[rank] = (body, msg.announced)
        return msg

    def decode(self, obj: Any, rank: int) -> RoundMessage:
        """A round message from its JSON part (every field checked)."""
        if not isinstance(obj, dict):
            raise ProtocolError(f"rank {rank} sent a malformed negotiation message")
        if not obj:
            return SILENT
        try:
            return self._decode(obj, rank)
        except ProtocolError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError,
                OverflowError) as exc:
            raise ProtocolError(f"rank {rank} sent a malformed negotiation message "
                                f"({exc!r})") from None

    def _decode(self, obj: dict[str, Any], rank: int) -> RoundMessage:
        msg = RoundMessage()
        raw = obj.get("a")
        if raw:
            last = self._last.get(rank)
            if last is not None and last[0] == raw:
                msg.announced = last[1]
            else:
                msg.announced = _announcements(raw, rank, self._ids)
                self._last[rank] = (raw, msg.announced)
            msg.wire_announced = raw
        if "j" in obj:
            msg.joins = tuple(_ints(obj["j"], rank, "joins"))
        if "ps" in obj:
            msg.ps_requests = tuple(_ps_request(p, rank) for p in _list(obj["ps"], rank))
        if "x" in obj:
            x = obj["x"]
            if not isinstance(x, dict) or not isinstance(x.get("message"), str):
                raise ProtocolError(f"rank {rank} sent a malformed abort")
            names = _list(x.get("names", []), rank)
            if not all(isinstance(s, str) for s in names):
                raise ProtocolError(f"rank {rank} sent a malformed abort")
            msg.abort = Abort(tuple(names), x["message"])
        if "k" in obj:
            msg.ask_stacks = tuple(_ints(obj["k"], rank, "stack request"))
        if "st" in obj:
            if not isinstance(obj["st"], str):
                raise ProtocolError(f"rank {rank} sent a malformed stack")
            msg.stack = obj["st"]
        if obj.get("s"):
            msg.shutdown = True
        if "w" in obj:
            msg.waiting = _int(obj["w"], rank, "waiting count")
        if "f" in obj:
            f = obj["f"]
            if not (isinstance(f, list) and len(f) == 2 and isinstance(f[1], str)):
                raise ProtocolError(f"rank {rank} sent a malformed failure notice")
            msg.notice = Notice(None if f[0] is None else _int(f[0], rank, "lost rank"), f[1])
        if "t" in obj:
            msg.tune = _tuning(obj["t"], rank)
        return msg


def check_inline(a: Inline, nbytes: int, blob_len: int, who: str) -> None:
    """An inline announcement must cover its tensor's bytes, inside the binary part."""
    if a.offset < 0 or a.length != nbytes or a.offset + a.length > blob_len:
        raise ProtocolError(f"{who} sent inline data out of bounds")


def unpack_round(payload: bytes, rank: int) -> tuple[RoundMessage, bytes]:
    """One payload decoded without a memo (tests, and a peer's early notice)."""
    return Decoder().unpack(payload, rank)


def from_wire(obj: dict[str, Any], rank: int = 0) -> RoundMessage:
    """A round message from its JSON part, as a peer's would be decoded (tests)."""
    return Decoder().decode(obj, rank)


#: ById objects a Decoder keeps; past this it starts afresh
_IDS_KEPT = 1 << 16


def _announcements(raw: Any, rank: int, ids: dict[int, ById]) -> tuple[Announcement, ...]:
    out: list[Announcement] = []
    if len(ids) > _IDS_KEPT:
        ids.clear()
    for a in _list(raw, rank):
        t = type(a)
        if t is int:
            known = ids.get(a)
            if known is None:
                known = ids[a] = ById(a)
            out.append(known)
        elif t is list and len(a) == 3 and all(type(v) is int for v in a):
            out.append(Inline(a[0], a[1], a[2]))
        elif t is list and len(a) == 2 and type(a[0]) is str and type(a[1]) is list:
            out.append(ByName(a[0], a[1]))
        else:
            raise ProtocolError(f"malformed announcement from rank {rank}")
    return tuple(out)


def _tuning(t: Any, rank: int) -> Tuning:
    ok = (isinstance(t, list) and len(t) == 4 and type(t[0]) is int and type(t[2]) is int
          and all(type(v) in (int, float) for v in t[1::2]))
    if not ok or not (0 <= t[0] <= 1 << 40 and 0 < t[1] <= 1e5 and 0 <= t[2] <= 1 << 20
                      and 0 <= t[3] <= 1e8):
        raise ProtocolError(f"rank {rank} sent malformed autotune values: {t!r}")
    return Tuning(t[0], float(t[1]), t[2], float(t[3]))


def _ps_request(p: Any, rank: int) -> ProcessSetRequest:
    if not (isinstance(p, list) and len(p) == 2 and p[0] in ("add", "remove")):
        raise ProtocolError(f"malformed process-set request from rank {rank}")
    if p[0] == "add":
        ranks = _ints(p[1], rank, "process-set ranks")
        return ProcessSetRequest("add", tuple(sorted(ranks)))
    return ProcessSetRequest("remove", (_int(p[1], rank, "process-set id"),))


def _list(v: Any, rank: int) -> list[Any]:
    if not isinstance(v, list):
        raise ProtocolError(f"rank {rank} sent a malformed negotiation message")
    return v


def _int(v: Any, rank: int, what: str) -> int:
    if type(v) is not int:
        raise ProtocolError(f"rank {rank} sent a malformed {what}: {v!r}")
    return v


def _ints(v: Any, rank: int, what: str) -> list[int]:
    return [_int(x, rank, what) for x in _list(v, rank)]
