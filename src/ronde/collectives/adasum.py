"""Adasum: adaptive summation of the ranks' tensors (Maleki et al., MLSys 2021).

Two vectors combine as ``a' = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b``:
orthogonal ones add up, parallel ones average, and in between the shared component is
counted once. The ranks' vectors combine as a binary tree over the ranks in order:
level 1 combines ranks (0, 1), (2, 3), ...; level 2 combines those results pairwise;
and so on. With a power-of-two count this is Horovod's tree (vector halving, distance
doubling, which pairs rank i with i XOR 2^k at level k: the same pairs, since the rule is
symmetric in a and b). ronde also takes other counts, by this rule: a node without a
partner at some level (the last one, when the level has an odd count) goes up
unchanged and combines at a later level (3 ranks: (r0 + r1) with r2).

Dot products and norms are taken per tensor (also inside a fused buffer: ``segments``)
in float64, whatever the dtype, on the pair scaled by its largest magnitude, so tiny
and huge magnitudes give no overflow, NaN or Inf; a zero vector contributes nothing
(the other vector's coefficient is 1).

Where it sits: the executor (``core/executor.py``) allgathers the (fused) contributions
over the set's transport and every rank runs :func:`combine` on the same rows in the
same order, so every rank gets bitwise the same result. That moves N times the data of
Horovod's vector-halving (each rank receives every contribution) and is right for the
sizes where Adasum is used with few ranks; documented in docs/adasum.md.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

def _dot(x: np.ndarray, y: np.ndarray) -> float:
    # einsum's own loop, not BLAS: a multithreaded BLAS wakes its threads for every call,
    # which cost milliseconds per call on a busy machine
    return float(np.einsum("i,i->", x, y))


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a`` and ``b`` (float64 vectors) combined by the Adasum rule. The coefficients do
    not change when both vectors are scaled alike; where a square could underflow or
    overflow float64 (magnitudes beyond 1e-100..1e100: float64 inputs only), they are
    computed on the vectors divided by their largest magnitude."""
    s = max(float(np.max(np.abs(a), initial=0.0)), float(np.max(np.abs(b), initial=0.0)))
    if s == 0.0 or not np.isfinite(s):
        return a + b
    an, bn = (a, b) if 1e-100 < s < 1e100 else (a / s, b / s)
    dot, na, nb = _dot(an, bn), _dot(an, an), _dot(bn, bn)
    ca = 1.0 - dot / (2.0 * na) if na > 0.0 else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb > 0.0 else 1.0
    return ca * a + cb * b


def tree(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """The ranks' float64 vectors (in rank order) combined by the tree of the module
    docstring."""
    level = list(vectors)
    while len(level) > 1:
        nxt = [pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])  # no partner at this level: up unchanged
        level = nxt
    return level[0]


def combine(rows: np.ndarray, segments: Sequence[tuple[int, int]], out: np.ndarray) -> None:
    """``rows`` (one row per rank, any float dtype) combined segment by segment (each
    tensor of a fused buffer on its own) into ``out`` (1-D, the rows' dtype)."""
    for lo, hi in segments:
        vecs = [rows[r, lo:hi].astype(np.float64) for r in range(rows.shape[0])]
        out[lo:hi] = tree(vecs).astype(out.dtype, copy=False)
