"""The memory a ``ShardedOptimizer`` step moves through, made once and reused
(:class:`Pool`), and the two pools of a layout (:class:`Pools`): see :mod:`._shards`."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ..transport import hugepages


class Laid(Protocol):
    """What the pools need of a bucket (:class:`._shards.Bucket`)."""

    dtype: torch.dtype
    padded: int  #: its elements, padded to N * S
    per: int  #: S, a rank's range


class Pool:
    """Flat buffers of one size per dtype (the largest a caller asked for at layout),
    made when first needed and reused: :meth:`take` a view of ``n`` elements,
    :meth:`give` it back."""

    def __init__(self, capacity: dict[torch.dtype, int], most: int | None = None,
                 device: torch.device | None = None) -> None:
        self.capacity, self.most = capacity, most  # most: buffers kept free (None: all)
        self.device = device  # None: the CPU
        self.free: dict[torch.dtype, list[torch.Tensor]] = {d: [] for d in capacity}

    def take(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        free = self.free[dtype]
        base = free.pop() if free else torch.empty(self.capacity[dtype], dtype=dtype,
                                                   device=self.device)
        return base[:n]

    def give(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        free = self.free[base.dtype]
        if self.most is None or len(free) < self.most:
            free.append(base)


class Pools:
    """A job layout's two pools: whole buckets (stage 2's gradients; the allgathers'
    results where they cannot land in the storage) and slices (the reduce-scatters'
    results where they cannot land in place; the allgathers' inputs without a storage);
    and the watch on the C heap a step's other memory comes from (``heap``: trimmed after
    a step that grew it, ``RONDE_SHARDED_TRIM_HEAP``; None: off)."""

    def __init__(self, buckets: Sequence[Laid], trim_heap: bool = True) -> None:
        self.heap = hugepages.HeapWatch() if trim_heap else None
        whole: dict[torch.dtype, int] = {}
        part: dict[torch.dtype, int] = {}
        for b in buckets:
            whole[b.dtype] = max(whole.get(b.dtype, 0), b.padded)
            part[b.dtype] = max(part.get(b.dtype, 0), b.per)
        self.whole, self.part = Pool(whole), Pool(part)
