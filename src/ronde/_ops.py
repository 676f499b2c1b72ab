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



def predivide_scales(op: int, gradient_predivide_factor: float) -> tuple[float, float]:
    """Horovod's ``gradient_predivide_factor`` as a reduction's (prescale, postscale):
    with Average (the engine divides the sum by the size) divide by the factor before
    the sum and multiply by it after, so the result is the average whatever the factor;
    with another op the factor must be 1 (every binding's optimizer and tape use this
    one rule and message).

    Raises:
        ValueError: a factor other than 1 with another op than Average.
    """
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if op == ReduceOp.AVERAGE:
        return 1.0 / gradient_predivide_factor, float(gradient_predivide_factor)
    return 1.0, 1.0
