"""Negotiation: agree, on every rank, which collectives run next and in what order.

Where it sits in the engine cycle: the control thread exchanges one *round*
message with every peer (see ``engine.py``); every rank then feeds the same
messages, in rank order, to its own :class:`Negotiator`. Because the negotiator is
a deterministic function of those messages, every rank computes the same list of
:class:`Response` objects in the same order: no coordinator round trip, and a
mismatch (shape, dtype, op, root) is detected identically everywhere.

Steady state is cheap thanks to the response cache: once a name has completed, its
per-rank metadata is remembered under a small integer id, and later announcements
of the same name with the same metadata send only that id.

Small cached allreduces can go further: a rank may attach the tensor's bytes to its
announcement (:class:`~.protocol.Inline`: a span of the round frame's binary part). When
every member attached its bytes, the response carries them (``inline``) and each
rank reduces them itself, in rank order: one message exchange in all, no data-plane
round trip. Otherwise the executor runs the collective as usual.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from .._errors import ProtocolError, RondeError
from .cache import ResponseCache
from .protocol import ById, ByName, Inline, ProcessSetRequest, RoundMessage, check_inline
from .requests import KIND_NAMES, Kind, Meta, describe
from .responses import Response, any_meta, fusion_key  # noqa: F401 - re-exported
from . import crossed, planner
from .steady import SteadyMemo

log = logging.getLogger(__name__)


class _Entry:
    __slots__ = ("name", "metas", "order", "first_seen", "cids", "data")

    def __init__(self, name: str, order: tuple[int, int, int]) -> None:
        self.name = name
        self.metas: dict[int, Meta] = {}
        #: the cache id each rank announced with (None: full metadata)
        self.cids: dict[int, int | None] = {}
        self.data: dict[int, bytes] = {}
        self.order = order
        self.first_seen = time.monotonic()


class Negotiator:
    """The replicated message table and the decision function (see module docstring)."""

    def __init__(self, size: int, process_sets: dict[int, list[int]], fusion_threshold_bytes: int,
                 cache_capacity: int) -> None:
        self.size = size
        self.process_sets = process_sets
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.cache = ResponseCache(cache_capacity)
        self.entries: dict[str, _Entry] = {}
        self.joined: dict[int, dict[int, int]] = {}  # ps -> rank -> round joined
        self.shutdown: set[int] = set()
        #: ranks that said they are only waiting (``w``; see Engine._check_waiting)
        self.waiting: set[int] = set()
        #: every rank has said so once already; the next full set decides (crossed.py)
        self.waiting_armed = False
        #: rounds that produced a response (the same count on every rank)
        self.progress = 0
        self.ps_votes: dict[tuple[str, tuple[int, ...]], set[int]] = {}
        self._next_ps_id = max(process_sets) + 1 if process_sets else 1
        self.round = 0
        #: training's steady state: a memo in front of the general path (steady.py)
        self.steady = SteadyMemo(self)

    # -- building my message -------------------------------------------------------
    def encode_announcement(self, rank: int, name: str, raw_meta: list[Any]
                            ) -> ById | ByName:
        cid = self.cache.lookup(name, rank, raw_meta)
        return ById(cid) if cid is not None else ByName(name, raw_meta)

    def cached_id(self, rank: int, name: str, raw_meta: list[Any]) -> int | None:
        return self.cache.lookup(name, rank, raw_meta)

    def any_covered(self, announced: Iterable[tuple[str, int]], ready: set[int]) -> bool:
        """Whether a round now may complete one of ``announced`` (name, process set):
        every member of its set announced it before or is in ``ready`` (announces, or
        wants the round); an unknown set counts (the general path reports it at once).
        The engine holds back a round that can complete nothing (``holding.py``)."""
        entries, sets = self.entries, self.process_sets
        for name, ps_id in announced:
            members = sets.get(ps_id)
            if members is None:
                return True
            entry = entries.get(name)
            have = entry.metas if entry is not None else {}
            for r in members:  # a loop, not all(generator): once a step
                if r not in have and r not in ready:
                    break
            else:
                return True
        return False

    # -- applying a round ------------------------------------------------------------
    def apply_round(self, messages: list[RoundMessage],
                    blobs: list[bytes] | None = None) -> list[Response]:
        """Apply every rank's message of this round (index = rank); return responses.

        ``blobs[rank]`` is the binary section of that rank's frame (inline data).
        Messages come from authenticated peers but are still checked: anything
        malformed raises :class:`ProtocolError`, never another exception type.
        """
        try:
            return self._apply_round(messages, blobs)
        except RondeError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError,
                OverflowError) as exc:
            raise ProtocolError(f"malformed negotiation message: {exc!r}") from None

    def _apply_round(self, messages: list[RoundMessage],
                     blobs: list[bytes] | None) -> list[Response]:
        self.round += 1
        out = self.steady.replay(messages, blobs)
        if out is None:
            out = self._general(messages, blobs)
        out.extend(crossed.responses(self, messages, out))
        return out

    def _general(self, messages: list[RoundMessage],
                 blobs: list[bytes] | None) -> list[Response]:
        """The general path: table entries, validation, the cache, process sets, joins."""
        out: list[Response] = []
        # Expand cache ids against the state at the start of the round, before any update.
        expanded: list[list[tuple[str, Meta, int | None, bytes | None]]] = []
        for rank, msg in enumerate(messages):
            items: list[tuple[str, Meta, int | None, bytes | None]] = []
            blob = blobs[rank] if blobs is not None else b""
            for ann in msg.announced:
                if type(ann) is ById:
                    name, _, meta = self.cache.expand(ann.cid, rank)
                    items.append((name, meta, ann.cid, None))
                elif type(ann) is ByName:
                    items.append((ann.name, Meta(ann.raw), None, None))
                else:
                    assert type(ann) is Inline
                    name, _, meta = self.cache.expand(ann.cid, rank)
                    check_inline(ann, meta.nbytes, len(blob), f"rank {rank}")
                    items.append((name, meta, ann.cid,
                                  blob[ann.offset: ann.offset + ann.length]))
            expanded.append(items)
        for rank, items in enumerate(expanded):
            for idx, (name, meta, cid, data) in enumerate(items):
                entry = self.entries.get(name)
                if entry is None:
                    entry = self.entries[name] = _Entry(name, (self.round, rank, idx))
                if rank in entry.metas:
                    out.append(self._error_response(
                        entry, f"rank {rank} submitted {name!r} twice before it completed; "
                        "give each in-flight collective a unique name", "duplicate"))
                    continue
                entry.metas[rank] = meta
                entry.cids[rank] = cid
                if data is not None:
                    entry.data[rank] = data
        for rank, msg in enumerate(messages):
            for ps_id in msg.joins:
                self.joined.setdefault(ps_id, {})[rank] = self.round
            if msg.shutdown:
                self.shutdown.add(rank)
            for req in msg.ps_requests:
                out.extend(self._process_set_request(rank, req))
        out.extend(self._decide())
        out.extend(self._joins_complete())
        return out

    def abort(self, names: Iterable[str], message: str, error_type: str) -> list[Response]:
        """Fail the named pending entries on every rank (used by the stall inspector)."""
        out = []
        for name in names:
            entry = self.entries.get(name)
            if entry is not None:
                out.append(self._error_response(entry, message, error_type))
        if out:  # progress: waits before this abort say nothing about what comes after
            self.progress += 1
            self.waiting.clear()
            self.waiting_armed = False
        return out

    # -- internals ---------------------------------------------------------------------
    def fail_entry(self, entry: _Entry, message: str, error_type: str) -> Response:
        """Drop a pending entry and return the error response every rank gives for it."""
        return self._error_response(entry, message, error_type)

    def _error_response(self, entry: _Entry, message: str, error_type: str) -> Response:
        self.entries.pop(entry.name, None)
        some = next(iter(entry.metas.values()), None)
        kind = some.kind if some else Kind.ALLREDUCE
        ps_id = some.ps_id if some else 0
        return Response(kind, ps_id, [entry.name], [dict(entry.metas)], error=message,
                        error_type=error_type)

    def _decide(self) -> list[Response]:
        ready: list[tuple[tuple[int, int, int], Response]] = []
        for entry in list(self.entries.values()):
            first = next(iter(entry.metas.values()))
            if first.ps_id not in self.process_sets:
                ready.append((entry.order, self._error_response(
                    entry, f"{entry.name!r} uses process set {first.ps_id}, which is not "
                    "registered (or was removed); register it on every rank with "
                    "add_process_set()", "mismatch")))
                continue
            members = self.process_sets[first.ps_id]
            joined = self.joined.get(first.ps_id, {})
            missing = [r for r in members if r not in entry.metas and r not in joined]
            if missing:
                gone = [r for r in missing if r in self.shutdown]
                if gone:
                    resp = self._error_response(
                        entry, f"{KIND_NAMES[first.kind]} {entry.name!r}: rank(s) "
                        f"{_ranks(gone)} shut down without submitting it", "shutdown")
                    resp.value = min(gone)  # the ShutdownError's rank (what left first)
                    ready.append((entry.order, resp))
                continue
            joined_here = frozenset(r for r in members if r not in entry.metas)
            cids = set(entry.cids.values())
            if (len(cids) == 1 and None not in cids and not joined_here
                    and self.cache.touch(next(iter(cids)))):  # type: ignore[arg-type]
                # every rank repeated the metadata of an earlier success: valid as it was
                # (unless the id was evicted while some rank had not announced yet: with
                # more names in flight than the cache holds; then validate it afresh)
                pass
            else:
                error = self._validate(entry, members, joined_here)
                if error is not None:
                    ready.append((entry.order, self._error_response(entry, error[0], error[1])))
                    continue
                self.cache.put(entry.name, entry.metas)
            del self.entries[entry.name]
            inline = None
            if len(entry.data) == len(members) and not joined_here:
                inline = [entry.data[r] for r in members]
            resp = Response(first.kind, first.ps_id, [entry.name], [dict(entry.metas)],
                            joined=joined_here, inline=inline)
            key = None
            if first.kind == Kind.ALLREDUCE:
                key = fusion_key(first.ps_id, first, joined_here)
                resp.nbytes = first.nbytes
                if inline is None:
                    resp.fuse_key = key
            if not joined_here and len(members) == self.size:
                self.steady.remember(entry.name, first.kind, first.ps_id, key,
                                     first.nbytes if key is not None else -1)
            ready.append((entry.order, resp))
        ready.sort(key=lambda item: item[0])
        return planner.fused([resp for _, resp in ready], self.fusion_threshold_bytes)

    def _validate(self, entry: _Entry, members: list[int],
                  joined: frozenset[int]) -> tuple[str, str] | None:
        metas = entry.metas
        ranks = sorted(metas)
        first = metas[ranks[0]]
        what = f"{KIND_NAMES[first.kind]} {entry.name!r}"

        def differs(label: str, value_of: Any, fix: str) -> tuple[str, str] | None:
            groups: dict[Any, list[int]] = {}
            for r in ranks:
                groups.setdefault(value_of(metas[r]), []).append(r)
            if len(groups) <= 1:
                return None
            parts = [f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)} sent {shown}"
                     for shown, rs in sorted(groups.items(), key=lambda kv: kv[1][0])]
            return f"{what}: {label} differs across ranks: {'; '.join(parts)}; {fix}", "mismatch"

        kinds = differs("the operation", lambda m: KIND_NAMES[m.kind],
                        "every rank must call the same collective for the same name")
        if kinds:
            return kinds
        if joined and first.kind != Kind.ALLREDUCE:
            return (f"{what}: rank(s) {_ranks(sorted(joined))} already called join(); after a "
                    "join only allreduce is supported until every rank has joined", "joined")
        checks: list[tuple[str, Any, str]] = [
            ("the device", lambda m: "accelerator" if m.device else "host memory",
             "keep the tensor on the same kind of device on every rank"),
            ("dtype", lambda m: m.dtype, "cast the tensor to one dtype on all ranks"),
            ("process set", lambda m: m.ps_id, "pass the same process_set on all ranks"),
        ]
        if first.kind in (Kind.ALLREDUCE, Kind.BROADCAST, Kind.REDUCESCATTER):
            checks.append(("the shape", lambda m: m.describe(),
                           "every rank must pass a tensor of the same shape"))
        if first.kind in (Kind.ALLGATHER, Kind.ALLTOALL):
            checks.append(("the trailing shape", lambda m: describe(m.dtype, ("*",) + m.shape[1:]),
                           "only the first dimension may differ across ranks"))
        if first.kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER):
            checks.append(("the reduction op", lambda m: _op_name(m.op),
                           "pass the same op on all ranks"))
            checks.append(("the scale factors", lambda m: f"prescale={m.prescale:g}, "
                           f"postscale={m.postscale:g}", "pass the same factors on all ranks"))
        if first.kind == Kind.BROADCAST:
            checks.append(("root_rank", lambda m: m.root, "pass the same root_rank on all ranks"))
        if first.kind == Kind.ALLTOALL:
            checks.append(("whether splits are given", lambda m: m.splits is None,
                           "pass splits on every rank or on none"))
        for label, fn, fix in checks:
            found = differs(label, fn, fix)
            if found:
                return found
        if first.kind == Kind.BROADCAST and first.root not in members:
            return (f"{what}: root_rank {first.root} is not a member of the process set "
                    f"{members}", "mismatch")
        if first.kind == Kind.ALLTOALL:
            for r in ranks:
                splits = metas[r].splits
                if splits is not None and len(splits) != len(members):
                    return (f"{what}: rank {r} passed {len(splits)} splits for a process set "
                            f"of {len(members)} ranks", "mismatch")
        return None

    def _joins_complete(self) -> list[Response]:
        out = []
        for ps_id, joined in list(self.joined.items()):
            members = self.process_sets.get(ps_id, [])
            if members and all(r in joined for r in members):
                last_round = max(joined.values())
                last = max(r for r, rnd in joined.items() if rnd == last_round)
                del self.joined[ps_id]
                out.append(Response(Kind.JOIN, ps_id, [f"join.{ps_id}"], [{}], value=last))
        return out

    def _process_set_request(self, rank: int, req: ProcessSetRequest) -> list[Response]:
        action = req.action
        key = (action, req.key)
        voters = self.ps_votes.setdefault(key, set())
        voters.add(rank)
        if len(voters) < self.size:
            return []
        del self.ps_votes[key]
        if action == "add":
            ranks = list(key[1])
            for ps_id, members in self.process_sets.items():
                if members == ranks:
                    return [Response(Kind.BARRIER, 0, [f"process_set.add.{ranks}"], [{}],
                                     error=f"a process set with ranks {ranks} already exists "
                                     f"(id {ps_id})", error_type="process_set")]
            ps_id = self._next_ps_id
            self._next_ps_id += 1
            self.process_sets[ps_id] = ranks
            self.steady.clear()
            return [Response(Kind.BARRIER, 0, [f"process_set.add.{ranks}"], [{}],
                             value=("add", ps_id, ranks))]
        ps_id = key[1][0]
        name = f"process_set.remove.{ps_id}"
        if ps_id == 0 or ps_id not in self.process_sets:
            return [Response(Kind.BARRIER, 0, [name], [{}], error=f"cannot remove process set "
                             f"{ps_id}: it is the global set or not registered",
                             error_type="process_set")]
        del self.process_sets[ps_id]
        self.steady.clear()
        return [Response(Kind.BARRIER, 0, [name], [{}], value=("remove", ps_id, []))]

    def set_fusion_threshold(self, nbytes: int) -> None:
        """A new ``RONDE_FUSION_THRESHOLD`` (autotune): steady rounds are planned afresh."""
        if nbytes != self.fusion_threshold_bytes:
            self.fusion_threshold_bytes = nbytes
            self.steady.clear()

    def stalled(self, older_than_s: float) -> list[tuple[str, list[int], list[int], float]]:
        """Pending entries older than the limit: (name, ready ranks, missing ranks, age)."""
        now = time.monotonic()
        out = []
        for entry in self.entries.values():
            age = now - entry.first_seen
            if age < older_than_s:
                continue
            first = next(iter(entry.metas.values()))
            members = self.process_sets.get(first.ps_id, [])
            joined = self.joined.get(first.ps_id, {})
            ready = sorted(entry.metas)
            missing = [r for r in members if r not in entry.metas and r not in joined]
            out.append((entry.name, ready, missing, age))
        return out


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, ranks))


def _op_name(op: int) -> str:
    from ..collectives.ops import ReduceOp

    try:
        return ReduceOp(op).name.capitalize()
    except ValueError:
        return str(op)
