"""Negotiation over a binomial tree: the coordinator's round with relays, so that no
rank handles more than ``log2 N`` frames a round.

Where it sits: ``coordinator.py`` runs a round as a star (every rank's frame to rank 0,
one bundle back): ``2(N - 1)`` messages through rank 0, which at hundreds of ranks
makes its system calls and wake-ups the round's critical path, linear in N. From
``RONDE_COORDINATOR_TREE`` ranks on, the same round travels over a binomial tree rooted
at rank 0 instead (rank ``r``'s parent is ``r`` with its lowest set bit cleared; its
children are ``r + 1, r + 2, r + 4, ...`` below its lowest set bit and the job size):

* **up**: each rank waits for its children's *aggregates* (their subtrees' frames,
  grouped as in a bundle: each distinct JSON part once with the bit mask of its
  senders, which merge by OR), adds its own frame and sends the aggregate of its
  subtree to its parent. In training's steady state every aggregate is one part and a
  mask, whatever the subtree's size;
* **down**: rank 0 packs the bundle of the whole round; every rank forwards the
  bundle's bytes unchanged to its children, then decodes it, exactly as a member of the
  star does. Every rank still decides from the same frames with the same code.

Each rank sends and receives at most ``1 + log2 N`` messages a round (rank 0: one per
child); the round's depth is ``2 log2 N`` hops instead of 2, so the star stays the
default below the threshold (one hop each way is faster for a few ranks).

Who starts a round: a rank that has something to announce (or that gets a child's
aggregate, or a *go* from its parent) takes part, and sends a go to each child whose
aggregate it does not have yet; goes thus spread down from any rank that starts, and
aggregates up. A go that crosses a child's aggregate is read and dropped by the child
before its bundle (the same socket carries them in order).

The tree holds only while every rank of the job is here: a rank's shutdown is agreed
in a round's frames, so from the next round on every rank alike goes back to the star
(``coordinator.py``), which knows how ranks leave and who coordinates after rank 0.
``init()`` opens only the tree's control sockets (each rank's parent and children:
rank 0 holds ``log2 N``, not ``N - 1``), and between rounds a rank watches only those;
the round that ends the tree opens the star's: each member connects to rank 0, which
waits for them (unless every rank is leaving), before any rank can start the next.

Failure: a rank sees its children and its parent; a socket that closes is a
``PeerLostError`` naming that rank, whose notice (``Channels.tell_peers``) travels on
to every neighbour of every rank that fails, along the tree. A rank waits for its
children ``RONDE_STALL_SHUTDOWN_TIME`` plus a second per level of its subtree (and for
its bundle a level more than the root), so the parent of a rank that stopped
answering times out first and names it; the others then fail on its notice.

Every byte is untrusted: an aggregate goes through the bundle decoder's checks (masks
disjoint, ranks of the job, lengths inside) and must hold exactly its sender's
subtree; a bundle must hold every rank.
"""

from __future__ import annotations

from typing import Callable

from .._errors import ProtocolError
from ..transport import ready, wire
from .._config import Config
from . import coordinator, protocol
from .channels import Channels, Wait
from .rounds import FrameReader


#: a subtree's frames, grouped as in a bundle, on their way to rank 0
KIND_AGGREGATE = 7
#: how much longer a rank waits per level of the subtree below it (see above)
LEVEL_MARGIN_S = coordinator.LEVEL_MARGIN_S


def wanted(cfg: Config, size: int) -> bool:
    """Whether a job of ``size`` ranks whose rounds go through the coordinator uses the
    tree (``RONDE_COORDINATOR_TREE``; decided alike on every rank)."""
    return cfg.coordinator_tree_min > 0 and size >= max(cfg.coordinator_tree_min, 3)


def parent(rank: int) -> int:
    """Rank ``rank``'s parent (``rank`` > 0): its lowest set bit cleared."""
    return rank & (rank - 1)


def children(rank: int, size: int) -> list[int]:
    """Rank ``rank``'s children in a job of ``size``: ``rank + 2^k`` for each ``2^k``
    below its lowest set bit (any, for rank 0) and ``rank + 2^k < size``."""
    low = rank & -rank if rank else size
    out = []
    k = 1
    while k < low and rank + k < size:
        out.append(rank + k)
        k <<= 1
    return out


def subtree(rank: int, size: int) -> range:
    """The ranks in ``rank``'s subtree: ``rank`` up to the next multiple of its lowest
    set bit (the whole job for rank 0)."""
    return range(rank, min(rank + (rank & -rank), size) if rank else size)


def subtree_mask(rank: int, size: int) -> int:
    """The bit mask of :func:`subtree`."""
    ranks = subtree(rank, size)
    return ((1 << len(ranks)) - 1) << rank


def check_aggregate(g: coordinator.Grouped, child: int, size: int) -> None:
    """An aggregate from ``child`` must hold exactly its subtree's frames."""
    senders = 0
    for mask in g.parts.values():
        senders |= mask
    if senders != subtree_mask(child, size):
        raise ProtocolError(f"rank {child} sent an aggregate of ranks "
                            f"{coordinator.ranks_of(senders, size)}, not its subtree's")


def neighbours(rank: int, size: int) -> list[int]:
    """The ranks whose control sockets a tree round uses at ``rank``, in order."""
    up = [] if rank == 0 else [parent(rank)]
    return up + children(rank, size)


def merge(parts: list[coordinator.Grouped]) -> coordinator.Grouped:
    """Grouped frames of disjoint sets of ranks as one: masks of equal JSON parts OR-ed,
    binary parts kept per rank."""
    if len(parts) == 1:
        return parts[0]
    out: dict[bytes, int] = {}
    blobs: dict[int, bytes] = {}
    for g in parts:
        for body, mask in g.parts.items():
            out[body] = out.get(body, 0) | mask
        blobs.update(g.blobs)
    return coordinator.Grouped(out, blobs)


def run(ch: Channels, payload: bytes, messages: list[protocol.RoundMessage], blobs: list[bytes],
        failed: Callable[[], BaseException | None]) -> int:
    """One round over the tree (what :meth:`Exchange.run` does while every rank is
    here and the job has ``RONDE_COORDINATOR_TREE`` ranks or more); returns the bit mask
    of the ranks that announced their shutdown in it (every rank sees the same bundle:
    when it is not 0, all go back to the star from the next round)."""
    rank, size = ch.rank, ch.size
    kids = children(rank, size)
    up = None if rank == 0 else parent(rank)
    readers = {r: ch.readers[r] for r in neighbours(rank, size)}
    by_sock = {rd.sock: r for r, rd in readers.items()}
    got: dict[int, coordinator.Grouped] = {}
    for c in kids:
        g = _aggregate(ch, readers[c], c)
        if g is not None:
            got[c] = g
    to_send = {c: memoryview(coordinator.GO) for c in kids if c not in got}
    waiting = {c for c in kids if c not in got}
    wait = Wait(ch, failed, LEVEL_MARGIN_S * len(kids))
    while waiting or to_send:
        watch = [readers[r].sock for r in waiting] + ([readers[up].sock] if up is not None
                                                      else [])
        readable, writable = ready.wait(watch, [readers[r].sock for r in to_send], 0.5)
        ch.send_some(writable, to_send)
        for s in readable:
            r = by_sock[s]
            rd = readers[r]
            rd.fill()
            if r == up:
                if _from_parent(ch, rd, r) is not None:
                    raise ProtocolError(f"rank {r} sent a negotiation bundle before this "
                                        "rank's aggregate")
                continue
            g = _aggregate(ch, rd, r)
            if g is not None:
                got[r] = g
                waiting.discard(r)
        wait.check(waiting)
    grouped = merge([coordinator.group({rank: payload}), *got.values()])
    if up is None:
        frame = coordinator.pack_bundle(grouped)
    else:
        body = _exchange_with_parent(ch, readers[up], up, grouped, failed)
        frame = wire.encode_frame(coordinator.KIND_BUNDLE, body)
        grouped = coordinator.unpack_bundle(body, size, f"rank {up}")
    bundle = memoryview(frame)
    to_send = {c: bundle for c in kids}
    while to_send:
        _, writable = ready.wait([], [readers[c].sock for c in to_send], 0.5)
        ch.send_some(writable, to_send)
        err = failed()
        if err is not None:
            raise err
    present = coordinator.decode(ch.decoder, grouped, size, messages, blobs, set(ch.peers),
                                 ch.check_notice)
    if len(present) != size:
        missing = sorted(set(range(size)) - present)
        raise ProtocolError(f"a negotiation bundle from rank {up} left ranks {missing} out")
    leaving = 0
    for mask in grouped.parts.values():  # each distinct part once: its lowest sender's
        if messages[(mask & -mask).bit_length() - 1].shutdown:
            leaving |= mask
    return leaving


def _exchange_with_parent(ch: Channels, rd: FrameReader, up: int,
                          grouped: coordinator.Grouped,
                          failed: Callable[[], BaseException | None]) -> bytes:
    """Send this subtree's aggregate to the parent; return the round's bundle (payload)."""
    to_send = {up: memoryview(coordinator.pack_bundle(grouped, KIND_AGGREGATE))}
    levels = ch.size.bit_length() + 1  # longer than any rank waiting for a child
    wait = Wait(ch, failed, LEVEL_MARGIN_S * levels)
    while True:
        body = _from_parent(ch, rd, up)
        if body is not None:
            return body
        readable, writable = ready.wait([rd.sock], [rd.sock] if to_send else [], 0.5)
        ch.send_some(writable, to_send)
        if readable:
            rd.fill()
        wait.check({up})


def _from_parent(ch: Channels, rd: FrameReader, up: int) -> bytes | None:
    """The bundle's payload once the parent's socket holds it (goes read and dropped; a
    failure notice raised; a close is a lost parent)."""
    while True:
        got = rd.pop_frame()
        if got is None:
            if rd.eof:
                ch.peer_closed(up, set())  # raises: nobody leaves while the tree holds
            return None
        kind, body = got
        if kind == coordinator.KIND_BUNDLE:
            return body
        if kind == protocol.KIND_ROUND:  # its failure notice
            ch.check_notice(ch.decoder.unpack(body, up)[0], up)
            raise ProtocolError(f"rank {up} sent a round frame outside a bundle")
        if kind != coordinator.KIND_GO:
            raise ProtocolError(f"rank {up} sent control frame kind {kind} to a child")


def _aggregate(ch: Channels, rd: FrameReader, child: int) -> coordinator.Grouped | None:
    """Child ``child``'s aggregate if its socket holds it, checked to be exactly its
    subtree; a failure notice raised; a close is a lost child."""
    got = rd.pop_frame()
    if got is None:
        if rd.eof:
            ch.peer_closed(child, set())  # raises
        return None
    kind, body = got
    if kind == protocol.KIND_ROUND:  # its failure notice
        ch.check_notice(ch.decoder.unpack(body, child)[0], child)
        raise ProtocolError(f"rank {child} sent a round frame outside an aggregate")
    if kind != KIND_AGGREGATE:
        raise ProtocolError(f"rank {child} sent control frame kind {kind} to its parent")
    g = coordinator.unpack_bundle(body, ch.size, f"rank {child}")
    check_aggregate(g, child, ch.size)
    return g
