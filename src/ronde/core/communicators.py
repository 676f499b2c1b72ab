"""The process sets as the executor sees them: every set's members, and the
communicator of each set this rank belongs to.

Changed only by the executor thread, in response order (a set added or removed by an
agreed response), so every rank changes its table at the same point of the collective
sequence; read by the executor for each collective.
"""

from __future__ import annotations

from typing import Callable

from ..transport.base import Communicator


class Communicators:
    """Process set id -> members, and -> this rank's communicator for it."""

    def __init__(self, rank: int, comms: dict[int, Communicator],
                 process_sets: dict[int, list[int]],
                 make: Callable[[int, list[int]], Communicator | None]) -> None:
        self.rank = rank
        self._comms = comms
        self._members = {k: list(v) for k, v in process_sets.items()}
        self._make = make

    def members(self, ps_id: int) -> list[int]:
        return self._members.get(ps_id, [])

    def get(self, ps_id: int) -> Communicator:
        return self._comms[ps_id]

    def apply(self, change: tuple[str, int, list[int]]) -> None:
        """A set added (``("add", id, ranks)``) or removed: create or drop its communicator."""
        action, ps_id, ranks = change
        if action == "add":
            self._members[ps_id] = list(ranks)
            # every rank calls the factory (a Gloo group needs all of them); members keep it
            comm = self._make(ps_id, list(ranks))
            if comm is not None and self.rank in ranks:
                self._comms[ps_id] = comm
        else:
            self._members.pop(ps_id, None)
            comm = self._comms.pop(ps_id, None)
            if comm is not None:
                comm.close()

    def close(self) -> None:
        for comm in self._comms.values():
            comm.close()
