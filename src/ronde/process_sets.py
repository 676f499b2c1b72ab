"""Process sets: collectives among a subset of ranks.

A :class:`ProcessSet` names some ranks; once registered (``init(process_sets=...)``
or :func:`ronde.add_process_set`, a collective over all ranks) every collective
accepts it as ``process_set=``. Collectives on disjoint sets run independently:
negotiation is global, so all ranks agree on one order, but each rank only moves
data for the sets it belongs to.
"""

from __future__ import annotations

from typing import Sequence

from . import _state

_registered: dict[int, "ProcessSet"] = {}


def registered(process_set_id: int) -> "ProcessSet | None":
    """The registered process set with this id (0: the global one, after init), or None."""
    return _registered.get(process_set_id)


def added() -> list["ProcessSet"]:
    """The process sets added to the running job (not the global one), in id order."""
    return [ps for ps_id, ps in sorted(_registered.items()) if ps_id != 0]


class ProcessSet:
    """A group of ranks that can run collectives among themselves."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks: list[int] | None = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id: int | None = None
        self._my_rank = -1

    def _bind(self, ps_id: int, ranks: list[int], my_rank: int) -> None:
        self.process_set_id = ps_id
        self.ranks = list(ranks)
        self._my_rank = my_rank
        _registered[ps_id] = self

    def as_global(self, ranks: list[int], my_rank: int) -> None:
        """This set now spans the whole job (an elastic job shrank to it): collectives
        on it run on the global set; it is not registered as a set of its own."""
        self.process_set_id = 0
        self.ranks = list(ranks)
        self._my_rank = my_rank

    def _unbind(self) -> None:
        if self.process_set_id is not None:
            _registered.pop(self.process_set_id, None)
        self.process_set_id = None

    def size(self) -> int:
        """Number of ranks in the set."""
        if self.ranks is None:
            raise ValueError("the global process set is sized by ronde.init()")
        return len(self.ranks)

    def _me(self) -> int:
        """This rank: the running job's (a thread's own, for threads as ranks), else the
        one the set was bound with."""
        rt = _state.current()
        return rt.topo.rank if rt is not None else self._my_rank

    def rank(self) -> int:
        """This process's index in the set, or -1 when it is not a member."""
        me = self._me()
        if self.ranks is None or me not in self.ranks:
            return -1
        return self.ranks.index(me)

    def included(self) -> bool:
        """True when this process is a member."""
        return self.ranks is not None and self._me() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(ranks={self.ranks}, id={self.process_set_id})"


#: Every rank; the default ``process_set`` of every collective.
global_process_set = ProcessSet()


def shard_position(process_set: ProcessSet | None = None) -> tuple[int, int]:
    """This rank's place among the ranks a sharded optimizer splits its state over:
    ``(index in the set, the set's size)``, or ``(0, 1)`` outside the set (a plain
    optimizer on everything there). Every binding's ``ShardedOptimizer`` uses it."""
    ps = process_set if process_set is not None else global_process_set
    if ps.ranks is None:  # the global set before it is bound: the whole job
        topo = _state.require().topo
        return topo.rank, topo.size
    if not ps.included():
        return 0, 1
    return ps.rank(), len(ps.ranks)
