"""The fusion planner: which agreed allreduces move together, decided in one place.

Where it sits in the engine cycle: fusion is decided in two stages, both here.

1. :func:`group` (:func:`fused` on responses), when a round's responses are agreed (by the negotiator's general path
   and by its steady-state memo alike): consecutive-compatible allreduces (equal
   :attr:`Response.fuse_key`: process set, dtype, op, scales, joined ranks, device) are
   packed into one response, up to ``RONDE_FUSION_THRESHOLD`` bytes.
2. :func:`chain` and :func:`parts`, when the executor hands a round out: a fused group
   that can run with the one before it (only inline ones between) rides along as that
   one's follower; when the group is run, the communicator says whether it takes the
   whole chain as one operation (:meth:`~ronde.transport.base.Communicator.reads_peers`:
   the single-copy allreduce needs no fusion buffer, so the threshold has nothing to
   bound), else the groups run one by one.

Every input is state that every rank has at the same point (the agreed responses, in
order), so every rank plans the same.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from .requests import Kind
from .responses import Response, any_meta

T = TypeVar("T")


def group(items: list[tuple[tuple[Any, ...] | None, int, T]], threshold: int
          ) -> list[list[T]]:
    """Stage 1: which of a round's agreed responses fuse, in order.

    ``items`` are ``(fusion key, bytes, what)`` per response in the agreed order (key
    None: never fused); consecutive-compatible ones (equal keys, nothing incompatible
    decides: a group stays open for later items of its key) are packed together up to
    ``threshold`` bytes (0: no fusion). Returns the groups of ``what``, in the order of
    their first member.
    """
    if threshold <= 0:
        return [[what] for _, _, what in items]
    out: list[list[T]] = []
    open_groups: dict[tuple[Any, ...], list[Any]] = {}  # key -> [bytes, members]
    for key, nbytes, what in items:
        if key is None:
            out.append([what])
            continue
        lead = open_groups.get(key)
        if lead is not None and lead[0] + nbytes <= threshold:
            lead[0] += nbytes
            lead[1].append(what)
            continue
        members = [what]
        open_groups[key] = [nbytes, members]
        out.append(members)
    return out


def fused(responses: list[Response], threshold: int) -> list[Response]:
    """:func:`group` on responses: each group merged into its first response."""
    out = []
    for members in group([(r.fuse_key, r.nbytes, r) for r in responses], threshold):
        lead = members[0]
        for r in members[1:]:
            lead.names.extend(r.names)
            lead.metas.extend(r.metas)
            lead.nbytes += r.nbytes
        out.append(lead)
    return out


def chain(responses: list[Response], fusing: bool) -> list[Response]:
    """Attach each fused allreduce that may run with the one before it (same
    reduction, only inline responses between) as that one's follower; returns what
    remains to hand out, in order."""
    plan: list[Response] = []
    lead: Response | None = None
    lead_key: tuple[Any, ...] | None = None
    for resp in responses:
        if resp.inline is not None:
            plan.append(resp)
            continue
        key = _follow_key(resp) if fusing else None
        if lead is not None and key is not None and key == lead_key:
            if lead.followers is None:
                lead.followers = []
            lead.followers.append(resp)
            continue
        lead, lead_key = (resp, key) if key is not None else (None, None)
        plan.append(resp)
    return plan


def parts(item: Response, reads_peers: Callable[[int, int], bool]) -> list[Response]:
    """What to run for ``item``: itself and its followers (:func:`chain`), as one
    operation when this rank's communicator's ``reads_peers(bytes, tensors)`` says so
    (every member answers alike), else one by one."""
    followers = item.followers
    if not followers:
        return [item]
    item.followers = None
    chained = [item, *followers]
    tensors = sum(len(r.names) for r in chained)
    if reads_peers(sum(nbytes(r) for r in chained), tensors):
        one = Response(item.kind, item.ps_id, [n for r in chained for n in r.names],
                       [m for r in chained for m in r.metas])
        one.reqs = [q for r in chained for q in r.reqs]
        one.members, one.comm = item.members, item.comm
        return [one]
    return chained


def nbytes(resp: Response) -> int:
    """The bytes of a response's tensors together."""
    if resp.nbytes >= 0:
        return resp.nbytes
    return sum(any_meta(m).nbytes for m in resp.metas)


def _follow_key(resp: Response) -> tuple[Any, ...] | None:
    """What makes two fused allreduces of one round candidates to run as one."""
    if resp.kind != Kind.ALLREDUCE or resp.error or resp.joined or not resp.metas:
        return None
    return None if any_meta(resp.metas[0]).device else resp.fuse_key
