"""Exactly-once sharding of an epoch across a changing set of ranks.

Where it sits: the framework samplers (``ronde.torch.elastic.ElasticSampler``) keep their
bookkeeping here. Each epoch has one order of the dataset's indices (shuffled with
``seed + epoch``); the indices not yet processed are dealt to the ranks in turn
(``remaining[rank::size]``), with nothing repeated and nothing dropped, so shards differ
by at most one index. A rank records what it processed (``record_batch`` or
``record_indices``); at ``State.commit()`` the records of every rank are gathered
(:meth:`ElasticShards.gather`, a collective) into the committed set, which is what a
reset restores and what the next shards exclude.

Horovod's sampler instead pads each shard by repeating indices and counts a processed
prefix (``batch_size * size`` per batch), which repeats samples across a reset and miscounts
when the last batch is short (horovod#3399, #3143).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np


class ElasticShards:
    """The epoch's order, what is committed as processed, and this rank's shard."""

    def __init__(self, length: int, shuffle: bool = True, seed: int = 0) -> None:
        self.length = int(length)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        #: processed this epoch, as committed (the same on every rank after gather/sync)
        self.processed = np.zeros(self.length, dtype=bool)
        #: recorded by this rank since the last gather
        self._recorded: list[np.ndarray] = []
        self.indices = np.zeros(0, dtype=np.int64)
        self.remaining = 0
        self._cursor = 0
        self.rank, self.size = 0, 1
        self.reset()

    def order(self) -> np.ndarray:
        """This epoch's order of every index."""
        if not self.shuffle:
            return np.arange(self.length, dtype=np.int64)
        return np.random.default_rng(self.seed + self.epoch).permutation(self.length)

    def reset(self) -> None:
        """Deal the unprocessed indices again, for the current rank and size."""
        from .. import _api

        if _api.is_initialized():
            self.rank, self.size = _api.rank(), _api.size()
        order = self.order()
        remaining = order[~self.processed[order]]
        self.remaining = len(remaining)
        self.indices = remaining[self.rank::self.size]
        self._cursor = 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet (call it when an epoch ends)."""
        self.epoch = int(epoch)
        self.processed[:] = False
        self._recorded.clear()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """This rank processed its next ``batch_size`` indices (``batch_idx`` is kept for
        Horovod's signature; the position is counted here)."""
        take = self.indices[self._cursor: self._cursor + int(batch_size)]
        self._cursor += len(take)
        self._recorded.append(take)

    def record_indices(self, indices: Iterable[int]) -> None:
        """This rank processed exactly these dataset indices."""
        arr = np.fromiter((int(i) for i in indices), dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.length):
            raise IndexError(f"record_indices: an index outside 0..{self.length - 1}")
        self._recorded.append(arr)

    def gather(self) -> None:
        """Collective: add every rank's records to the committed set."""
        from .. import _api
        from .._objects import allgather_object

        mine = np.concatenate(self._recorded) if self._recorded else np.zeros(0, np.int64)
        self._recorded.clear()
        parts = allgather_object(mine, name="ronde.elastic.sampler") \
            if _api.is_initialized() and _api.size() > 1 else [mine]
        for part in parts:
            self.processed[np.asarray(part, dtype=np.int64)] = True

    def processed_count(self) -> int:
        """Committed indices, plus this rank's records since times the number of ranks."""
        pending = sum(len(r) for r in self._recorded)
        return int(self.processed.sum()) + pending * self.size

    def drop_records(self) -> None:
        """Forget what was recorded since the last gather (a restore)."""
        self._recorded.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed": np.packbits(self.processed).tobytes(),
                "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("length", self.length)) != self.length:
            raise ValueError(f"this sampler's dataset has {self.length} items, the state "
                             f"{state['length']}")
        self.epoch = int(state["epoch"])
        bits = np.frombuffer(state["processed"], dtype=np.uint8)
        self.processed = np.unpackbits(bits)[: self.length].astype(bool)
        self._recorded.clear()
        self.reset()

    def batches(self, batch_size: int) -> list[list[int]]:
        """This rank's shard in batches of ``batch_size``, padded with empty batches to
        the count every rank has (shards differ by one index at most, which can make
        one batch more on some ranks): every rank runs the same number of steps, with
        nothing repeated. ronde's addition to Horovod's sampler."""
        batch_size = int(batch_size)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        longest = -(-self.remaining // self.size)
        count = -(-longest // batch_size)
        mine = self.indices.tolist()
        return [mine[i * batch_size: (i + 1) * batch_size] for i in range(count)]

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Any:
        self._cursor = 0
        return iter(self.indices.tolist())
