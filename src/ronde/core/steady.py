"""Training's steady state: rounds in which every rank announced the same cached ids.

Where it sits in the engine cycle: the :class:`~ronde.core.negotiation.Negotiator` asks
:meth:`SteadyRounds.responses` first for each round. When every rank announced the same
response-cache ids in the same order and nothing else (a training step repeating the
last one), the responses follow from the ids alone: no table entries, no validation
(each id stands for metadata every rank used together before), and what each id
needs is worked out once and kept. A round seen before (the same ids, the cache
unchanged since: its ``version``) replays its groups from a memo: one list
comparison instead of a lookup per tensor. Anything else returns None and takes the
general path, which gives the same responses, in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import ProtocolError
from .requests import Kind, Meta
from .responses import Response, fusion_key

if TYPE_CHECKING:
    from .negotiation import Negotiator

#: steady rounds remembered; past this, start afresh
_ROUNDS_KEPT = 32


class SteadyRounds:
    """The steady-state shortcut of one negotiator, and what it remembers."""

    def __init__(self, neg: "Negotiator") -> None:
        self.neg = neg
        #: cache id -> (its cache entry, what a steady round needs of it)
        self._ids: dict[int, tuple[Any, Any]] = {}
        #: steady rounds seen, by (count, first id, last id): (cache version, their
        #: announcements, their groups, their ids)
        self._rounds: dict[tuple[int, Any, Any], tuple[int, list[Any], list[Any],
                                                       list[int]]] = {}

    def clear(self) -> None:
        """Forget everything (the process sets changed)."""
        self._ids.clear()
        self._rounds.clear()

    def responses(self, messages: list[dict[str, Any]],
                  blobs: list[bytes] | None) -> list[Response] | None:
        """The responses of a round in which every rank announced the same cached ids in
        the same order and nothing else (training's steady state), or None.

        Such a round needs no table entries and no validation: each id stands for
        metadata every rank used together before. It gives what the general path (with
        :meth:`Negotiator._fuse`) gives, in the same order, and touches the cache in the
        same order; what it needs per id is worked out once and kept (:meth:`_info`).
        """
        neg = self.neg
        if neg.entries or any(neg.joined.values()):
            return None
        first = messages[0].get("a")
        if not first or any(len(m) != 1 or m.get("a") != first for m in messages):
            return None
        cache = self.neg.cache
        shortest = min(len(b) for b in blobs) if blobs else 0
        where = (len(first), _cid(first[0]), _cid(first[-1]))
        last = self._rounds.get(where)
        if last is not None and last[0] == self.neg.cache.version and last[1] == first:
            # the same ids as a steady round before, the cache unchanged since: the same
            # groups (fresh objects: the executor attaches followers to them)
            out = []
            for kind, ps_id, names, metas, span, nbytes in last[2]:
                inline = None
                if span is not None:
                    off, length = span
                    if blobs is None or off < 0 or off + length > shortest:
                        raise ProtocolError("a rank sent inline data out of bounds")
                    inline = [b[off: off + length] for b in blobs]
                resp = Response(kind, ps_id, list(names), list(metas), inline=inline)
                resp.nbytes = nbytes
                out.append(resp)
            cache.mark_used(last[3])  # in the order the general path touches them
            return out
        found = self._groups(first, blobs, shortest)
        if found is None:
            return None
        out, spans = found
        order = [a if type(a) is int else a[0] for a in first]
        if len(set(order)) != len(order):
            return None  # a name twice: the general path reports it
        cache.mark_used(order)  # recently used, in the order the general path touches them
        if len(self._rounds) >= _ROUNDS_KEPT and where not in self._rounds:
            self._rounds.clear()
        self._rounds[where] = (self.neg.cache.version, first, [
            (r.kind, r.ps_id, tuple(r.names), tuple(r.metas), span, r.nbytes)
            for r, span in zip(out, spans)], order)
        return out

    def _groups(self, first: list[Any], blobs: list[bytes] | None, shortest: int
                ) -> tuple[list[Response], list[tuple[int, int] | None]] | None:
        """The responses of a steady round's announcements (see :meth:`responses`)
        and, for each, where its inline data lies in the frames (or None); None where
        one of them needs the general path."""
        get, memo = self.neg.cache.get, self._ids
        threshold = self.neg.fusion_threshold_bytes
        out: list[Response] = []
        spans: list[tuple[int, int] | None] = []
        open_groups: dict[tuple[Any, ...], Response] = {}
        for ann in first:
            span = None
            if type(ann) is int:
                cid = ann
            elif (type(ann) is list and len(ann) == 3 and type(ann[0]) is int
                  and type(ann[1]) is int and type(ann[2]) is int):
                cid, span = ann[0], ann
            else:
                return None
            entry = get(cid)
            if entry is None:
                return None
            known = memo.get(cid)
            if known is None or known[0] is not entry:
                if len(memo) > 2 * self.neg.cache.capacity:
                    memo.clear()  # ids evicted from the cache leave their memo behind
                known = memo[cid] = (entry, self._info(entry))
            info = known[1]
            if info is None:
                return None
            kind, ps_id, key, nbytes = info
            if span is not None:
                off, length = span[1], span[2]
                if blobs is None or off < 0 or length != nbytes or off + length > shortest:
                    raise ProtocolError("a rank sent inline data out of bounds")
                resp = Response(kind, ps_id, [entry.name], [entry.metas],
                                inline=[b[off: off + length] for b in blobs])
                resp.nbytes = nbytes
                out.append(resp)
                spans.append((off, length))
                continue
            if key is not None and threshold > 0:
                group = open_groups.get(key)
                if group is not None and group.nbytes + nbytes <= threshold:
                    group.names.append(entry.name)
                    group.metas.append(entry.metas)
                    group.nbytes += nbytes
                    continue
                group = Response(kind, ps_id, [entry.name], [entry.metas])
                group.nbytes = nbytes
                open_groups[key] = group
                out.append(group)
                spans.append(None)
                continue
            resp = Response(kind, ps_id, [entry.name], [entry.metas])
            resp.nbytes = nbytes
            out.append(resp)
            spans.append(None)
        return out, spans

    def _info(self, entry: tuple[str, Any, dict[int, Meta]]
              ) -> tuple[Kind, int, tuple[Any, ...] | None, int] | None:
        """(kind, process set, fusion key or None, bytes) of a cache entry, or None when
        its rounds must take the general path (not every rank of the job in it)."""
        metas = entry.metas
        meta = metas.get(0)
        if meta is None or len(metas) != self.neg.size \
                or len(self.neg.process_sets.get(meta.ps_id, ())) != self.neg.size:
            return None
        key = None
        if meta.kind == Kind.ALLREDUCE:
            key = fusion_key(meta.ps_id, meta)
        return meta.kind, meta.ps_id, key, meta.nbytes


def _cid(ann: Any) -> Any:
    """The cache id of a steady announcement (an id, or [id, offset, length])."""
    return ann if type(ann) is int else ann[0] if type(ann) is list and ann else None
