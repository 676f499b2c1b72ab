"""Round frames on the control sockets, and this rank's announcements.

Where it sits in the engine cycle: the control thread turns its new requests into typed
announcements (:class:`Announcer`, :func:`announcements`; the message types and their
encoding are in ``protocol.py``) and reads each peer's frame incrementally with a
:class:`FrameReader` (bounded: a length over the limit is a :class:`~ronde.ProtocolError`
before anything is allocated).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from typing import Any

import numpy as np

from .._errors import ProtocolError
from .._ops import ReduceOp
from ..transport import wire
from ..collectives import fusion
from .protocol import (KIND_DOORBELL, KIND_ROUND, Announcement, ById, ByName, Inline,
                       encode_announcements)
from .requests import Kind

_READ_BYTES = 1 << 16


class FrameReader:
    """Incremental, bounded frame parser for one non-blocking control socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.eof = False

    def fill(self) -> None:
        try:
            data = self.sock.recv(_READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.eof = True
        self.buf += data

    def _drop_doorbells(self) -> None:
        while len(self.buf) >= wire.HEADER_BYTES:
            kind, length = wire.decode_header(bytes(self.buf[: wire.HEADER_BYTES]))
            if kind != KIND_DOORBELL:
                return
            if length:
                raise ProtocolError(f"doorbell frame with a payload of {length} bytes")
            del self.buf[: wire.HEADER_BYTES]

    def has_frame(self) -> bool:
        """Whether a complete round frame (not a doorbell) is buffered."""
        if not self.buf:
            return False
        self._drop_doorbells()
        if len(self.buf) < wire.HEADER_BYTES:
            return False
        _, length = wire.decode_header(bytes(self.buf[: wire.HEADER_BYTES]))
        return len(self.buf) >= wire.HEADER_BYTES + length

    def peek_frame(self) -> tuple[int, bytes] | None:
        """The next complete frame's ``(kind, payload)`` (doorbells skipped), left in
        the buffer."""
        if not self.buf:
            return None
        self._drop_doorbells()
        if len(self.buf) < wire.HEADER_BYTES:
            return None
        kind, length = wire.decode_header(bytes(self.buf[: wire.HEADER_BYTES]))
        end = wire.HEADER_BYTES + length
        if len(self.buf) < end:
            return None
        return kind, bytes(self.buf[wire.HEADER_BYTES: end])

    def pop_frame(self) -> tuple[int, bytes] | None:
        """:meth:`peek_frame`, taken out of the buffer."""
        got = self.peek_frame()
        if got is not None:
            del self.buf[: wire.HEADER_BYTES + len(got[1])]
        return got

    def peek(self) -> bytes | None:
        """The next complete round frame's payload, left in the buffer."""
        got = self.peek_frame()
        if got is None:
            return None
        if got[0] != KIND_ROUND:
            raise ProtocolError(f"unexpected control frame kind {got[0]}")
        return got[1]

    def pop(self) -> bytes | None:
        payload = self.peek()
        if payload is not None:
            del self.buf[: wire.HEADER_BYTES + len(payload)]
        return payload


def main_thread_stack() -> str:
    """The main thread's current Python stack (what a stalled rank is doing).

    The main thread may be the one building this very message (a waiting caller drives
    the engine): the engine's own innermost frames are left out, so the user's code
    that waits is what shows.
    """
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return "(main thread not found)"
    frames = traceback.extract_stack(frame)
    here = os.path.dirname(os.path.abspath(__file__))
    while len(frames) > 1 and os.path.dirname(os.path.abspath(frames[-1].filename)) == here:
        frames.pop()
    return "".join(traceback.format_list(frames[-12:]))


def announcements(reqs: list[Any], cached_id: Any, inline_bytes: int
                  ) -> tuple[list[Announcement], bytes]:
    """The announcements of ``reqs`` and the binary part of the round frame.

    A request whose name and metadata are in the response cache (``cached_id(name,
    meta)`` is not None) goes as :class:`ById`; a small cached allreduce also carries its
    (prescaled) bytes, as :class:`Inline` into the binary part, up to ``inline_bytes``
    each and ``INLINE_ROUND_BYTES`` per round. Anything else goes :class:`ByName`.

    Not inline, though small: an allreduce whose message also carries a larger one with
    the same reduction (process set, dtype, op, scales). That one moves through the data
    path anyway, and the small one fuses into it for next to nothing (tensors that lie
    side by side in memory, like a model's flattened gradients, make one contiguous
    read), where carrying it inline costs a copy into the frame, a slice per rank and a
    separate reduction (ResNet-50's 99 small gradients: about 0.4 ms a step here). A
    rank decides this from its own message; where ranks' messages differ, the tensor's
    ranks disagree on inlining and the round's general path moves it through the data
    path, which is always correct.
    """
    out: list[Announcement] = []
    parts: list[bytes] = []
    used = 0
    left = inline_bytes and INLINE_ROUND_BYTES
    allreduce = Kind.ALLREDUCE
    moving = _data_path_reductions(reqs, inline_bytes) if left else ()
    for r in reqs:
        raw = r.meta()
        cid = cached_id(r.name, raw)
        if cid is None:
            out.append(ByName(r.name, raw))
            continue
        arr = r.array
        if r.kind == allreduce and arr is not None and arr.nbytes <= inline_bytes \
                and arr.nbytes <= left and not (moving and _reduction(r) in moving) \
                and r.op != ReduceOp.ADASUM:  # inline rounds sum; Adasum needs the tree
            data = prescaled_bytes(arr, r.prescale)
            n = len(data)
            out.append(Inline(cid, used, n))
            parts.append(data)
            used += n
            left -= n
        else:
            out.append(ById(cid))
    return out, b"".join(parts)


class Announcer:
    """A rank's announcements (:func:`announcements`), remembered for the lists of
    requests that went entirely by cache id.

    Training announces the same names with the same metadata step after step; when
    this round's requests match remembered ones (names and metadata, in order) and the
    response cache has not changed since (its ``version``), the announcements are the
    same: only the inline bytes are taken afresh. That skips a cache lookup per request
    (ResNet-50's 161 gradients: 0.2-0.3 ms a step in a training process, 0.03 with
    the memo). Several lists are kept (a step may take several rounds), by their
    length and end names, then compared in full. Returns the announcements, their wire
    form (see ``protocol.encode``) and the binary part.
    """

    def __init__(self, cache: Any, rank: int, inline_bytes: int) -> None:
        self.cache, self.rank, self.inline_bytes = cache, rank, inline_bytes
        #: (count, first name, last name) -> (cache version, [(name, meta)...],
        #: announcements, their wire form, indices of the inline ones)
        self._memo: dict[tuple[int, str, str], tuple[int, list[Any], tuple[Announcement, ...],
                                                     list[Any], list[int]]] = {}

    def set_inline_bytes(self, inline_bytes: int) -> None:
        """A new ``RONDE_INLINE_BYTES`` (autotune): announcements are worked out afresh."""
        if inline_bytes != self.inline_bytes:
            self.inline_bytes = inline_bytes
            self._memo.clear()

    def __call__(self, reqs: list[Any]) -> tuple[tuple[Announcement, ...], list[Any], bytes]:
        keys = [(r.name, r.meta()) for r in reqs]
        where = (len(reqs), reqs[0].name, reqs[-1].name)
        memo = self._memo.get(where)
        if memo is not None and memo[0] == self.cache.version and memo[1] == keys:
            inline = memo[4]
            blob = b"".join([prescaled_bytes(reqs[i].array, reqs[i].prescale)
                             for i in inline]) if inline else b""
            return memo[2], memo[3], blob
        lookup, rank = self.cache.lookup, self.rank
        out, blob = announcements(reqs, lambda name, raw: lookup(name, rank, raw),
                                  self.inline_bytes)
        typed = tuple(out)
        encoded = encode_announcements(typed)
        if not any(type(a) is ByName for a in out):  # every request by its id
            if len(self._memo) >= _MEMO_ENTRIES and where not in self._memo:
                self._memo.clear()
            self._memo[where] = (self.cache.version, keys, typed, encoded,
                                 [i for i, a in enumerate(out) if type(a) is Inline])
        return typed, encoded, blob


#: request lists remembered by an Announcer; past this, it starts afresh
_MEMO_ENTRIES = 32


def _data_path_reductions(reqs: list[Any], inline_bytes: int) -> set[tuple[Any, ...]]:
    """The reductions (process set, dtype, op, scales) of the host allreduces in ``reqs``
    too large to ride inline."""
    allreduce = Kind.ALLREDUCE
    return {_reduction(r) for r in reqs
            if r.kind == allreduce and r.array is not None and r.array.nbytes > inline_bytes}


def _reduction(r: Any) -> tuple[Any, ...]:
    """What allreduces must share to be reduced together: process set, dtype, op, scales."""
    return (r.ps_id, r.dtype, r.op, r.prescale, r.postscale)


#: at most this many inline bytes ride in one round message
INLINE_ROUND_BYTES = 256 * 1024


def prescaled_bytes(arr: np.ndarray, prescale: float) -> bytes:
    if prescale == 1.0:
        return arr.tobytes()
    scaled = np.empty_like(arr)
    fusion.scaled_copy(scaled.reshape(-1), arr.reshape(-1), prescale)
    return scaled.tobytes()
