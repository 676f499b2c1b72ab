"""Inline allreduces: reduced from the bytes every rank sent with its announcement.

A small cached allreduce travels inside the negotiation round (see negotiation.py);
when every member attached its bytes, each rank reduces them itself, in rank order, on
the thread that ran the round: no data plane, no hand-off to the executor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import RondeError
from ..collectives.ops import ReduceOp, reduce_into
from . import fusion
from .negotiation import Response
from .requests import resolve_dtype
from .timeline import now_us

if TYPE_CHECKING:
    from .engine import Engine


def run_one(eng: "Engine", resp: Response) -> None:
    """Control thread: reduce an allreduce whose every contribution came with the
    negotiation, in rank order (no data plane, no hand-off to this thread)."""
    req = eng.take(resp.names[0])
    if req is None:  # not a member of this process set
        return
    start = now_us() if eng.timeline is not None else 0.0
    try:
        meta = resp.metas[0][min(resp.metas[0])]
        dtype = resolve_dtype(meta.dtype)
        op, post = ReduceOp(meta.op), meta.postscale
        if op == ReduceOp.AVERAGE:
            op, post = ReduceOp.SUM, post / len(resp.inline or ())
        out = req.out if req.out is not None else req.allocate(meta.shape, dtype)
        flat = out.reshape(-1)
        parts = resp.inline or []
        np.copyto(flat, np.frombuffer(parts[0], dtype=dtype))
        for part in parts[1:]:
            reduce_into(flat, np.frombuffer(part, dtype=dtype), op)
        fusion.scale_inplace(flat, post)
    except BaseException as exc:  # noqa: BLE001 - the caller gets it
        req.fail(exc if isinstance(exc, RondeError) else RondeError(
            f"allreduce {req.name!r} failed: {exc!r}"))
        return
    if eng.timeline is not None:
        eng.timeline.phase(req.name, "INLINE_REDUCE", start, now_us())
    req.complete(out)


def run_batch(eng: "Engine", resps: list[Response]) -> None:
    """Control thread: :func:`run_one` for consecutive inline responses. Those
    with the same dtype, op and scale are reduced as one vector (each rank's bytes
    joined in the agreed order: per element, the same additions in the same order
    as one at a time), then copied out: a few numpy calls per tensor fewer."""
    if eng.timeline is not None:
        for resp in resps:
            run_one(eng, resp)
        return
    metas = [_any_meta(r.metas[0]) for r in resps]
    keys = [(m.dtype, m.op, m.postscale, len(r.inline or ())) for m, r in zip(metas, resps)]
    i = 0
    while i < len(resps):
        j = i + 1
        while j < len(resps) and keys[j] == keys[i]:
            j += 1
        if j - i == 1:
            run_one(eng, resps[i])
        else:
            _group(eng, resps[i:j], metas[i:j])
        i = j


def _group(eng: "Engine", group: list[Response], metas: list[Any]) -> None:
    reqs = eng.take_many([resp.names[0] for resp in group])
    meta = metas[0]
    dtype = resolve_dtype(meta.dtype)
    op, post = ReduceOp(meta.op), meta.postscale
    parts = len(group[0].inline or ())
    if op == ReduceOp.AVERAGE:
        op, post = ReduceOp.SUM, post / parts
    try:
        acc = np.frombuffer(b"".join([r.inline[0] for r in group]),  # type: ignore[index]
                            dtype=dtype).copy()
        for k in range(1, parts):
            reduce_into(acc, np.frombuffer(b"".join([r.inline[k] for r in group]),  # type: ignore[index]
                                           dtype=dtype), op)
        fusion.scale_inplace(acc, post)
    except BaseException as exc:  # noqa: BLE001 - the callers get it
        for req in reqs:
            if req is not None:
                req.fail(exc if isinstance(exc, RondeError) else RondeError(
                    f"allreduce {req.name!r} failed: {exc!r}"))
        return
    off = 0
    for m, req in zip(metas, reqs):
        n = _numel(m.shape)
        if req is not None:
            out = req.out if req.out is not None else req.allocate(m.shape, dtype)
            np.copyto(out.reshape(-1), acc[off: off + n])
            req.complete(out)
        off += n


def _any_meta(metas: dict[int, Any]) -> Any:
    return metas[min(metas)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
