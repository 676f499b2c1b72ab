"""Training's steady state: a memo in front of the negotiator's general path.

Where it sits in the engine cycle: the :class:`~ronde.core.negotiation.Negotiator` asks
:meth:`SteadyMemo.replay` first for each round. A round qualifies when every rank
announced the same response-cache ids in the same order and nothing else (a training
step repeating earlier ones) and nothing is pending: its responses are then a function
of the ids alone. The memo holds what the general path decided for each id (one
*template* per id, recorded by :meth:`SteadyMemo.remember` when the general path
completed that id with every rank of the job announcing it), and whole rounds already
replayed. A qualifying round is answered from the templates, fused by the same planner
(``planner.group``), with the cache touched in the same order: the responses the general
path would give. A round seen before (the same ids, the cache unchanged since: its
``version``) is one list comparison. Anything else (an id without a template, a template
whose cache entry changed, a name twice) returns None: the general path runs, and
records what the next round can replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from .._errors import ProtocolError
from . import planner
from .protocol import ByName, Inline, RoundMessage, check_inline
from .requests import Kind, Meta
from .responses import Response

if TYPE_CHECKING:
    from .negotiation import Negotiator

#: rounds remembered whole; past this, start afresh
_ROUNDS_KEPT = 32


class _Template(NamedTuple):
    """What the general path decided for one cache id, valid while ``entry`` is the
    cache's entry for it."""

    entry: Any
    kind: Kind
    ps_id: int
    name: str
    metas: dict[int, Meta]
    key: tuple[Any, ...] | None
    nbytes: int


class SteadyMemo:
    """The steady-state memo of one negotiator (see the module docstring)."""

    def __init__(self, neg: "Negotiator") -> None:
        self.neg = neg
        self._ids: dict[int, _Template] = {}
        #: rounds replayed, by (count, first id, last id): (cache version, their
        #: announcements, their responses as tuples, their ids in order)
        self._rounds: dict[tuple[int, int, int], tuple[int, Any, list[Any], list[int]]] = {}

    def clear(self) -> None:
        """Forget everything (the process sets changed)."""
        self._ids.clear()
        self._rounds.clear()

    def remember(self, name: str, kind: Kind, ps_id: int, key: tuple[Any, ...] | None,
                 nbytes: int) -> None:
        """The general path completed ``name`` with every rank of the job and no join:
        remember its decision under the name's cache id."""
        cache = self.neg.cache
        cid = cache.id_of(name)
        entry = cache.get(cid) if cid is not None else None
        if entry is None:
            return
        if len(self._ids) > 2 * cache.capacity:
            self._ids.clear()  # ids evicted from the cache leave their templates behind
        self._ids[cid] = _Template(entry, kind, ps_id, name, entry.metas, key, nbytes)

    def replay(self, messages: list[RoundMessage],
               blobs: list[bytes] | None) -> list[Response] | None:
        """The responses of a qualifying round (module docstring), or None."""
        neg = self.neg
        if neg.entries or any(neg.joined.values()):
            return None
        first = messages[0]
        ann = first.announced
        if not first.only_announces():
            return None
        same = first  # ranks whose frames the coordinator grouped share one object
        for m in messages:
            if m is not first and m is not same:
                if m.announced != ann or not m.only_announces():
                    return None
                same = m
        if type(ann[0]) is ByName or type(ann[-1]) is ByName:
            return None
        shortest = min(map(len, blobs)) if blobs else 0
        where = (len(ann), ann[0][0], ann[-1][0])
        last = self._rounds.get(where)
        cache = neg.cache
        if last is not None and last[0] == cache.version and last[1] == ann:
            out = []
            for kind, ps_id, names, metas, span, nbytes, key in last[2]:
                resp = Response(kind, ps_id, list(names), list(metas))
                if span is not None:
                    resp.inline = _slices(blobs, span, shortest)
                resp.nbytes, resp.fuse_key = nbytes, key
                out.append(resp)
            cache.mark_used(last[3])  # in the order the general path touches them
            return out
        found = self._from_templates(ann)
        if found is None:
            return None
        items, order = found
        out = []
        kept = []
        for members in planner.group(items, neg.fusion_threshold_bytes):
            tpl, span = members[0]
            if len(members) == 1:
                resp = Response(tpl.kind, tpl.ps_id, [tpl.name], [tpl.metas])
                resp.nbytes = tpl.nbytes
                if span is not None:
                    check_inline(span, tpl.nbytes, shortest, "a rank")
                    resp.inline = _slices(blobs, span[1:], shortest)
                else:
                    resp.fuse_key = tpl.key
            else:
                resp = Response(tpl.kind, tpl.ps_id, [t.name for t, _ in members],
                                [t.metas for t, _ in members])
                resp.nbytes = sum(t.nbytes for t, _ in members)
                resp.fuse_key = tpl.key
            out.append(resp)
            kept.append((resp.kind, resp.ps_id, tuple(resp.names), tuple(resp.metas),
                         None if span is None else span[1:], resp.nbytes, resp.fuse_key))
        cache.mark_used(order)
        if len(self._rounds) >= _ROUNDS_KEPT and where not in self._rounds:
            self._rounds.clear()
        self._rounds[where] = (cache.version, ann, kept, order)
        return out

    def _from_templates(self, ann: tuple[Any, ...]
                        ) -> tuple[list[tuple[Any, int, tuple[_Template, Any]]], list[int]] | None:
        """``planner.group``'s items for the announcements, from the templates (an
        inline one never fuses), and the ids in order; None where one needs the general
        path."""
        get, templates = self.neg.cache.get, self._ids
        items: list[tuple[Any, int, tuple[_Template, Any]]] = []
        order: list[int] = []
        for a in ann:
            if type(a) is ByName:
                return None
            cid = a[0]
            tpl = templates.get(cid)
            if tpl is None or get(cid) is not tpl.entry:
                return None
            order.append(cid)
            if type(a) is Inline:
                items.append((None, tpl.nbytes, (tpl, a)))
            else:
                items.append((tpl.key, tpl.nbytes, (tpl, None)))
        if len(set(order)) != len(order):
            return None  # a name twice: the general path reports it
        return items, order


def _slices(blobs: list[bytes] | None, span: tuple[int, int], shortest: int) -> list[bytes]:
    """Every rank's bytes at ``span`` of its frame's binary part."""
    off, length = span
    if blobs is None or off < 0 or off + length > shortest:
        raise ProtocolError("a rank sent inline data out of bounds")
    return [b[off: off + length] for b in blobs]
