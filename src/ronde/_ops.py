"""Reduction op names (no numpy here, so ``import ronde`` stays light)."""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """How ``allreduce``/``reducescatter`` combine values across ranks."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

