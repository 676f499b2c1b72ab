"""Reduction operators, shared by every algorithm and transport.

Ops are small integers so they travel in control messages; the public names
``ronde.Average``, ``ronde.Sum``... are these values (as in Horovod, where
``hvd.Average`` is an enum member). ``Average`` and ``Adasum`` are resolved by the
engine (a Sum followed by a scale), so algorithms only ever see the elementwise
ops below.
"""

from __future__ import annotations

import numpy as np


from .._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum

__all__ = ['ReduceOp', 'Average', 'Sum', 'Adasum', 'Min', 'Max', 'Product', 'reduce_into',
           'reduce_pair']

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> None:
    """``dst = dst (op) src`` elementwise, in place. Both are same-dtype 1-D views."""
    _UFUNCS[op](dst, src, out=dst)


def reduce_pair(a: np.ndarray, b: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """``out = a (op) b``; ``out`` may alias ``a`` or ``b``."""
    _UFUNCS[op](a, b, out=out)
