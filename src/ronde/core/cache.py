"""The response cache: a collective's name and per-rank metadata under a small id.

Once a name has completed, every rank remembers its per-rank metadata under the same
integer id (every rank applies the same updates in the same order, so the ids need no
coordination); a later announcement of that name with the same metadata sends only the
id. LRU with ``RONDE_CACHE_CAPACITY`` entries, deterministic everywhere.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, NamedTuple

from .._errors import ProtocolError
from .requests import Meta


class CacheEntry(NamedTuple):
    """What the cache remembers of one name: per rank its raw (wire) and parsed metadata."""

    name: str
    raws: dict[int, list[Any]]
    metas: dict[int, Meta]


class ResponseCache:
    """name -> id with the per-rank metadata of its last success; LRU, deterministic."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_id: collections.OrderedDict[int, CacheEntry] = collections.OrderedDict()
        #: the entry under an id, or None (``dict.get``: the steady path's hot lookup)
        self.get = self._by_id.get
        self._by_name: dict[str, int] = {}
        self._next_id = 0
        #: changes whenever an id's name or metadata may have changed (each put): what
        #: was derived from ids (the round memos in rounds.py, negotiation.py) holds
        #: while it stays the same
        self.version = 0

    def lookup(self, name: str, rank: int, raw_meta: list[Any]) -> int | None:
        cid = self._by_name.get(name)
        if cid is None:
            return None
        if self._by_id[cid].raws.get(rank) != raw_meta:
            return None
        return cid

    def id_of(self, name: str) -> int | None:
        """The id ``name`` is cached under, or None."""
        return self._by_name.get(name)

    def expand(self, cid: int, rank: int) -> tuple[str, list[Any], Meta]:
        try:
            name, raws, metas = self._by_id[cid]
            return name, raws[rank], metas[rank]
        except KeyError:
            raise ProtocolError(f"rank {rank} referred to unknown cache entry {cid}") from None

    def mark_used(self, cids: Iterable[int]) -> None:
        """Mark entries that exist (just looked up) recently used, in this order."""
        move = self._by_id.move_to_end
        for cid in cids:
            move(cid)

    def touch(self, cid: int) -> bool:
        """Mark ``cid`` recently used; False if it was evicted meanwhile."""
        if cid not in self._by_id:
            return False
        self._by_id.move_to_end(cid)
        return True

    def put(self, name: str, metas: dict[int, Meta]) -> None:
        if self.capacity <= 0:
            return
        self.version += 1
        raws = {r: _raw(m) for r, m in metas.items()}
        cid = self._by_name.get(name)
        if cid is not None:
            self._by_id[cid] = CacheEntry(name, raws, dict(metas))
            self._by_id.move_to_end(cid)
            return
        cid = self._next_id
        self._next_id += 1
        self._by_name[name] = cid
        self._by_id[cid] = CacheEntry(name, raws, dict(metas))
        while len(self._by_id) > self.capacity:
            old_id, (old_name, _, _) = self._by_id.popitem(last=False)
            del self._by_name[old_name]

    def __len__(self) -> int:
        return len(self._by_id)


def _raw(meta: Meta) -> list[Any]:
    return [int(meta.kind), meta.ps_id, meta.dtype, list(meta.shape), meta.op, meta.root,
            meta.prescale, meta.postscale, None if meta.splits is None else list(meta.splits),
            meta.device]
