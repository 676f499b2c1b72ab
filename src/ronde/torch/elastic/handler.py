"""The base of ``TorchState``'s handlers (:mod:`.state`, :mod:`.sharded`): what saves,
restores and syncs one value."""

from __future__ import annotations

from typing import Any


class StateHandler:
    """Saves, restores and syncs one value of a :class:`TorchState`."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def reset(self) -> None:
        """The job re-formed (new rank and size), before any sync."""
