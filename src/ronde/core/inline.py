"""Inline allreduces: reduced from the bytes every rank sent with its announcement.

A small cached allreduce travels inside the negotiation round (see negotiation.py);
when every member attached its bytes, each rank reduces them itself, in rank order, on
the thread that ran the round (``dispatch.py``, which gave each response its
requests): no data plane, no hand-off to the executor.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..collectives.ops import ReduceOp, as_sum, reduce_into
from ..collectives import fusion
from .negotiation import Response, any_meta
from .requests import fail_all, resolve_dtype
from .timeline import now_us

if TYPE_CHECKING:
    from .timeline import Timeline


def run_batch(resps: list[Response], timeline: "Timeline | None") -> None:
    """Reduce a round's consecutive inline responses (on the thread that ran the round).
    Those with the same dtype, op and scale are reduced as one vector: each rank's bytes
    joined in the agreed order, so per element the same additions in the same order as
    one at a time, then copied out."""
    metas = [any_meta(r.metas[0]) for r in resps]
    keys = [(m.dtype, m.op, m.postscale, len(r.inline or ())) for m, r in zip(metas, resps)]
    i = 0
    while i < len(resps):
        j = i + 1
        while j < len(resps) and keys[j] == keys[i]:
            j += 1
        _group(resps[i:j], metas[i:j], timeline)
        i = j


def _group(group: list[Response], metas: list[Any], timeline: "Timeline | None") -> None:
    reqs = [resp.reqs[0] for resp in group]  # None: not a member
    if not any(reqs):
        return
    start = now_us() if timeline is not None else 0.0
    meta = metas[0]
    dtype = resolve_dtype(meta.dtype)
    parts = len(group[0].inline or ())
    op, post = as_sum(ReduceOp(meta.op), meta.postscale, parts)
    try:
        acc = np.frombuffer(b"".join([r.inline[0] for r in group]),  # type: ignore[index]
                            dtype=dtype).copy()
        for k in range(1, parts):
            reduce_into(acc, np.frombuffer(b"".join([r.inline[k] for r in group]),  # type: ignore[index]
                                           dtype=dtype), op)
        fusion.scale_inplace(acc, post)
    except BaseException as exc:  # noqa: BLE001 - the callers get it
        fail_all(reqs, exc, "allreduce")
        return
    end = now_us() if timeline is not None else 0.0
    off = 0
    for m, req in zip(metas, reqs):
        n = math.prod(m.shape)
        if req is not None:
            out = req.out if req.out is not None else req.allocate(m.shape, dtype)
            np.copyto(out.reshape(-1), acc[off: off + n])
            if timeline is not None:
                timeline.phase(req.name, "INLINE_REDUCE", start, end)
            req.complete(out)
        off += n
