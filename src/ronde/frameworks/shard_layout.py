"""The shard layout every ``ShardedOptimizer`` shares (torch, Keras, JAX), its checkpoints
and the elastic reshard: the arithmetic in one place.

Parameters are flattened and laid end to end in *spans* (torch: buckets of one dtype
up to a byte size; Keras and JAX: one span per dtype). A span of ``L`` elements is padded
to ``N * S`` (``S = ceil(L / N)``) and rank ``r`` owns elements ``[r*S, (r+1)*S)``: split
by elements, not by parameters. A *piece* is the part of one parameter that falls in a
rank's range: elements ``[a, b)`` of the parameter, at ``at`` in the rank's slice of its
span. What differs by framework (how gradients reach the flat buffer, how the slots of
the optimizer's state are read and written) stays in the bindings; they hang it on the
:class:`Piece` (``tensor``) or beside it.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ..process_sets import ProcessSet


class Span:
    """Parameters ``members`` (indices into the layout's parameters, in order) of
    ``sizes`` elements laid end to end, padded to ``size * per``."""

    def __init__(self, members: Sequence[int], sizes: Sequence[int], size: int) -> None:
        self.members = list(members)
        self.sizes = dict(zip(self.members, (int(n) for n in sizes)))
        self.offset: dict[int, int] = {}  #: where each member starts in the span
        at = 0
        for i in self.members:
            self.offset[i] = at
            at += self.sizes[i]
        self.length = at
        self.per = -(-at // size) if size > 0 else at  #: S: each rank's slice
        self.padded = self.per * size

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """``(member, a, b)``: the elements ``[a, b)`` of each member that ``rank`` owns."""
        lo, hi = rank * self.per, min((rank + 1) * self.per, self.length)
        out = []
        for i in self.members:
            o = self.offset[i]
            a, b = max(o, lo) - o, min(o + self.sizes[i], hi) - o
            if a < b:
                out.append((i, a, b))
        return out


class Piece:
    """The part ``[a, b)`` of flattened parameter ``index`` (named ``name``) that a rank
    owns, at ``at`` in its slice of span ``span``; ``tensor``: the binding's view of it
    (torch: a flat view of the parameter's storage), None where it keeps none."""

    __slots__ = ("index", "name", "a", "b", "at", "span", "tensor")

    def __init__(self, index: int, name: str, a: int, b: int, at: int, span: int,
                 tensor: Any = None) -> None:
        self.index, self.name, self.a, self.b, self.at = index, name, a, b, at
        self.span, self.tensor = span, tensor


class ShardLayout:
    """Spans over named parameters, for one rank of ``size`` in ``process_set``: what a
    sharded optimizer exposes (``shard_layout``) for its checkpoints, the elastic
    reshard and the whole-state export to read, instead of its private attributes."""

    def __init__(self, spans: list[Span], names: list[str], rank: int, size: int,
                 process_set: ProcessSet | None) -> None:
        self.spans = spans
        self.names = names  #: every parameter's name (a key in the files), by index
        self.rank, self.size = rank, size
        self.process_set = process_set

    def pieces_of(self, rank: int) -> list[Piece]:
        """Rank ``rank``'s pieces, span by span."""
        out = []
        for k, span in enumerate(self.spans):
            lo = rank * span.per
            out.extend(Piece(i, self.names[i], a, b, span.offset[i] + a - lo, k)
                       for i, a, b in span.owned(rank))
        return out

    def ranges_of(self, rank: int) -> dict[str, tuple[int, int]]:
        """The element range ``[a, b)`` of each parameter (by name) that ``rank`` owns
        (parameters it owns nothing of are left out)."""
        return {self.names[i]: (a, b) for span in self.spans for i, a, b in span.owned(rank)}


def by_kind(kinds: Iterable[Any]) -> dict[Any, list[int]]:
    """Indices grouped by kind (a dtype), in first-seen order: Keras' and JAX's spans."""
    out: dict[Any, list[int]] = {}
    for i, kind in enumerate(kinds):
        out.setdefault(kind, []).append(i)
    return out


def spans_by_kind(kinds: Sequence[Any], sizes: Sequence[int], size: int) -> list[Span]:
    """One span per kind (dtype), members in their order: Keras' and JAX's layout."""
    return [Span(ids, [sizes[i] for i in ids], size) for ids in by_kind(kinds).values()]
