"""``ElasticSampler``: a torch ``Sampler`` over :class:`ronde.elastic.sampler.ElasticShards`.

Every index of the epoch is used exactly once across the ranks, counting the steps
that were committed, however often the job re-forms; shards are never padded, so they
differ by at most one index (see docs/elastic.md for the uneven last step).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch.utils.data

from ...elastic.sampler import ElasticShards


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions ``dataset`` over the current ranks; repartitions what is left after
    every reset.

    Use it as Horovod's: put it in the ``TorchState`` (it is then saved at each
    ``commit()`` and synced after each reset), call ``record_batch(batch_idx,
    batch_size)`` (or ``record_indices(indices)``) after each processed batch, and
    ``set_epoch(epoch + 1)`` when an epoch ends.

    Args:
        dataset: anything with ``len()`` (its length must not change).
        shuffle: shuffle the indices, with ``seed + epoch`` (the same on every rank).
        seed: the shuffle seed; identical on every rank.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.shards = ElasticShards(len(dataset), shuffle, seed)

    @property
    def epoch(self) -> int:
        return self.shards.epoch

    @property
    def rank(self) -> int:
        return self.shards.rank

    @property
    def num_replicas(self) -> int:
        return self.shards.size

    @property
    def processed_num(self) -> int:
        """Indices of this epoch processed: those committed, plus this rank's records
        since the last commit times the number of ranks (Horovod's count, which
        assumes every rank recorded as many)."""
        return self.shards.processed_count()

    def set_epoch(self, epoch: int) -> None:
        self.shards.set_epoch(epoch)

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.shards.record_batch(batch_idx, batch_size)

    def record_indices(self, indices: Any) -> None:
        if isinstance(indices, torch.Tensor):
            indices = indices.reshape(-1).tolist()
        self.shards.record_indices(indices)

    def reset(self) -> None:
        self.shards.reset()

    def batches(self, batch_size: int) -> list[list[int]]:
        """This rank's indices in batches, the same count on every rank (see
        :meth:`ronde.elastic.sampler.ElasticShards.batches`)."""
        return self.shards.batches(batch_size)

    def state_dict(self) -> dict[str, Any]:
        return self.shards.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.shards.load_state_dict(state_dict)

    def __iter__(self) -> Iterator[int]:
        return iter(self.shards)

    def __len__(self) -> int:
        return len(self.shards)
