"""Reduction operators, shared by every algorithm and transport.

Ops are small integers so they travel in control messages; the public names
``ronde.Average``, ``ronde.Sum``... are these values (as in Horovod, where
``hvd.Average`` is an enum member). ``Average`` and ``Adasum`` are resolved by the
engine (a Sum followed by a scale), so algorithms only ever see the elementwise
ops below.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum

__all__ = ['ReduceOp', 'Average', 'Sum', 'Adasum', 'Min', 'Max', 'Product', 'as_sum',
           'reduce_into', 'reduce_pair', 'reduce_in_rank_order', 'scaled_copy',
           'scale_inplace']

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def as_sum(op: ReduceOp, postscale: float, count: int) -> tuple[ReduceOp, float]:
    """``Average`` over ``count`` contributions as the engine runs it: a ``Sum`` with the
    postscale divided by ``count`` (Horovod's divisor: the whole set, joined ranks
    included); any other op as it is."""
    if op == ReduceOp.AVERAGE:
        return ReduceOp.SUM, postscale / count
    return op, postscale


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> None:
    """``dst = dst (op) src`` elementwise, in place. Both are same-dtype 1-D views."""
    _UFUNCS[op](dst, src, out=dst)


def reduce_pair(a: np.ndarray, b: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """``out = a (op) b``; ``out`` may alias ``a`` or ``b``."""
    _UFUNCS[op](a, b, out=out)


def reduce_in_rank_order(me: int, n: int, fetch: Callable[[int, np.ndarray], np.ndarray],
                         out: Sequence[np.ndarray], op: ReduceOp, low: np.ndarray,
                         part: np.ndarray | None = None,
                         mine: np.ndarray | None = None) -> None:
    """Reduce one piece of ``n`` ranks' values into ``out`` in rank order,
    ``((x0 (op) x1) (op) x2) ...``, whichever rank (``me``) does it: the bits then do not
    depend on how a vector was split among ranks or fused. The ranks below ``me`` are
    combined in scratch, ``me``'s values join them (``a (op) b == b (op) a`` exactly),
    then the ranks above, one by one: as many reads and reductions as any other order.

    ``out``: consecutive 1-D views, as long as the piece together; they hold ``me``'s
    values, unless ``mine`` (one array of the piece's length) does. ``fetch(j, buf)``:
    rank ``j``'s values, either copied into ``buf`` and ``buf`` returned, or an array
    that already holds them. ``low`` and ``part``: scratch of the piece's length for the
    ranks below ``me``; ``part`` (default ``low``) must differ from ``low`` where
    ``fetch`` copies and ``me >= 2``.
    """
    part = low if part is None else part
    acc: np.ndarray | None = None  # x0 (op) ... (op) x(me-1), not yet in out
    if me:
        acc = fetch(0, low)
        for j in range(1, me):
            x = fetch(j, part)
            if acc is low:
                reduce_into(low, x, op)
            else:
                reduce_pair(acc, x, low, op)
                acc = low
    first = me + 1
    if mine is not None:
        if acc is None and first < n:  # rank 0 with its own values apart
            acc, first = fetch(first, low), first + 1
        _each(out, mine if acc is None else acc, mine, op)
    elif acc is not None:
        _each(out, acc, None, op)
    for j in range(first, n):
        _each(out, fetch(j, low), None, op)  # low is free again: acc is in out


def _each(out: Sequence[np.ndarray], a: np.ndarray, b: np.ndarray | None,
          op: ReduceOp) -> None:
    """``out[i] = out[i] (op) a[...]``, or with ``b``: ``out[i] = a[...] (op) b[...]``,
    over the consecutive slices of ``a`` (and ``b``) that match the views of ``out``."""
    off = 0
    for v in out:
        k = off + v.size
        if b is None:
            reduce_into(v, a[off:k], op)
        elif a is b:
            np.copyto(v, a[off:k])  # a single rank: its own values
        else:
            reduce_pair(a[off:k], b[off:k], v, op)
        off = k


def scaled_copy(dst: np.ndarray, src: np.ndarray, factor: float) -> None:
    """``dst[:] = src * factor`` in one pass (a plain copy when factor is 1).

    The arithmetic is Horovod's: integers are scaled in float64 and truncated toward
    zero, 16-bit floats (float16, bfloat16) in float32 and rounded once, other floats
    in their own dtype (the factor rounded to it first). A factor that is the
    reciprocal of a whole number (an Average's ``1/size``) divides by that number
    instead: ``x / 3`` is what a user compares an average with, and ``x * (1/3)`` can
    differ from it in the last bit (the same cost: both are bound by memory).
    """
    if factor == 1.0:
        np.copyto(dst, src, casting="unsafe")
        return
    inv = 1.0 / factor if factor else 0.0
    ufunc, by = (np.divide, inv) if inv > 1.0 and inv.is_integer() else (np.multiply, factor)
    if dst.dtype.kind in "iub":
        np.copyto(dst, ufunc(src, by), casting="unsafe")
    elif dst.dtype.itemsize == 2:
        np.copyto(dst, ufunc(src, np.float32(by), dtype=np.float32), casting="unsafe")
    else:
        ufunc(src, by, out=dst, casting="unsafe")


def scale_inplace(buf: np.ndarray, factor: float) -> None:
    """``buf *= factor`` with :func:`scaled_copy`'s arithmetic (nothing when 1)."""
    if factor != 1.0:
        scaled_copy(buf, buf, factor)
