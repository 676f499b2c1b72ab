"""Split an allreduce's vector into blocks that take each owner the same time.

In the single-copy allreduce (``shm/single_copy.py``) every rank reduces one block and writes it
into its peers; the op ends when the slowest owner is done. Equal blocks are not equal
work: ResNet-50's gradients, allocated one by one, put 139 of their 161 tensors in the
first half, which costs its owner more calls and more small pages to read (1.2 ms
more per op, about 15 %, here). Nor are cores equal: one may share its CPU.

So each rank measures how long its block took and publishes it; after the op every
rank reads all the times (the same numbers everywhere) and moves the boundaries of
the next op with the same key towards blocks that would take equal time. The
computation is deterministic, so every rank derives the same blocks without
exchanging them; a key seen for the first time gets equal blocks.
"""

from __future__ import annotations

from collections import OrderedDict

from ..collectives.allreduce import even_counts

#: how far the next split moves towards the one measured to be even (1: all the way)
STEP = 0.5
#: no block shrinks below this share of an equal one
MIN_SHARE = 0.25
#: block boundaries fall on multiples of this many bytes (whole cache lines)
ALIGN_BYTES = 64
#: splits remembered (the least recently used is forgotten first)
CAPACITY = 64


def even(total: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous blocks of ``total`` elements, sizes differing by at most one."""
    out, lo = [], 0
    for count in even_counts(total, n):
        out.append((lo, lo + count))
        lo += count
    return out


class BlockSplit:
    """Per-key shares of the vector, updated from every op's measured block times."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._shares: OrderedDict[tuple, list[float]] = OrderedDict()

    def blocks(self, key: tuple, total: int, item: int) -> list[tuple[int, int]]:
        """The blocks of ``total`` elements of ``item`` bytes for the op with ``key``."""
        shares = self._shares.get(key)
        if shares is None:
            return even(total, self.n)
        self._shares.move_to_end(key)
        # (tiny vectors: exact shares; shm/single_copy.py sees none smaller than 256 KiB)
        align = max(1, ALIGN_BYTES // item) if total * item >= ALIGN_BYTES * 64 * self.n else 1
        out, lo, acc = [], 0, 0.0
        for i, s in enumerate(shares):
            acc += s
            hi = total if i == self.n - 1 else min(total, max(lo, int(acc * total) // align * align))
            out.append((lo, hi))
            lo = hi
        return out

    def update(self, key: tuple, total: int, used: list[tuple[int, int]],
               seconds: list[float]) -> None:
        """Record that blocks ``used`` took ``seconds`` (one per owner) for ``key``."""
        if total <= 0 or len(seconds) != self.n:
            return
        shares = [(hi - lo) / total for lo, hi in used]
        # the share each owner could take in the same time as the others
        speed = [s / max(t, 1e-6) for s, t in zip(shares, seconds)]
        total_speed = sum(speed)
        if total_speed <= 0:
            return
        floor = MIN_SHARE / self.n
        new = [max(floor, s + STEP * (v / total_speed - s)) for s, v in zip(shares, speed)]
        norm = sum(new)
        self._shares[key] = [s / norm for s in new]
        self._shares.move_to_end(key)
        while len(self._shares) > CAPACITY:
            self._shares.popitem(last=False)
