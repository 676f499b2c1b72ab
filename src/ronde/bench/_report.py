"""Combining rounds into points, and printing them: JSON lines and ratio tables.

A *point* is one (case, contender, size): the median over rounds of each round's
slowest-rank median (and p90) time, with algbw and busbw derived from that median.
Ratios are bandwidth ratios against a peer (``> 1`` means ronde is faster).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Sequence, TextIO

from ._stats import algbw_GBps, busbw_GBps, format_bytes, median


@dataclass
class Point:
    """One measured point after combining rounds."""

    case: str
    impl: str
    transport: str
    np: int
    bytes: int
    median_s: float
    p90_s: float
    algbw_GBps: float
    busbw_GBps: float
    rounds: int
    iters: int
    round_median_s: list[float]

    def json_line(self) -> str:
        """The point as one JSON line (``per_op_us`` added for the latency case)."""
        doc: dict[str, Any] = asdict(self)
        if self.case == "latency":
            doc["per_op_us"] = self.median_s * 1e6
        return json.dumps(doc)


def combine(case: str, impl: str, transport: str, np_: int,
            rounds: Sequence[Sequence[dict[str, Any]]]) -> list[Point]:
    """Points of one contender and case from its per-round worker summaries."""
    by_size: dict[int, list[dict[str, Any]]] = {}
    for summaries in rounds:
        for s in summaries:
            by_size.setdefault(int(s["bytes"]), []).append(s)
    points = []
    for nbytes, per_round in sorted(by_size.items()):
        med = median([s["median_s"] for s in per_round])
        points.append(Point(case=case, impl=impl, transport=transport, np=np_, bytes=nbytes,
                            median_s=med, p90_s=median([s["p90_s"] for s in per_round]),
                            algbw_GBps=algbw_GBps(nbytes, med),
                            busbw_GBps=busbw_GBps(nbytes, med, np_), rounds=len(per_round),
                            iters=sum(int(s["iters"]) for s in per_round),
                            round_median_s=[s["median_s"] for s in per_round]))
    return points


def _table(header: list[str], rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"
    print(line, file=out)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=out)
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |", file=out)


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.0f} us" if seconds < 10e-3 else f"{seconds * 1e3:.1f} ms"


def _ratio(ours: Point | None, peer: Point | None) -> str:
    if ours is None or peer is None:
        return "-"
    return f"{peer.median_s / ours.median_s:.2f}"


def print_tables(points: Sequence[Point], ronde_impls: Sequence[str],
                 peer_impls: Sequence[str], out: TextIO) -> None:
    """Markdown tables per case: times, busbw and ronde/peer bandwidth ratios."""
    impls = [*ronde_impls, *peer_impls]
    short = {i: i.removeprefix("ronde-") for i in impls}
    idx = {(p.case, p.impl, p.bytes): p for p in points}
    np_ = points[0].np if points else 0
    rounds = max((p.rounds for p in points), default=0)
    ratio_heads = [f"{short[r]}/{short[g]}" for g in peer_impls for r in ronde_impls]

    sizes = sorted({p.bytes for p in points if p.case == "allreduce"})
    if sizes:
        print(f"\nallreduce, np={np_}, float32 sum; time = median over {rounds} round(s) of "
              "the slowest rank's median; busbw in GB/s; ratio = ronde busbw / peer busbw "
              "(> 1: ronde faster)\n", file=out)
        header = ["size", *[f"{short[i]} time" for i in impls],
                  *[f"{short[i]} busbw" for i in impls], *ratio_heads]
        rows = []
        for b in sizes:
            pts = [idx.get(("allreduce", i, b)) for i in impls]
            rows.append([format_bytes(b), *[_time(p.median_s if p else None) for p in pts],
                         *[f"{p.busbw_GBps:.3g}" if p else "-" for p in pts],
                         *[_ratio(idx.get(("allreduce", r, b)), idx.get(("allreduce", g, b)))
                           for g in peer_impls for r in ronde_impls]])
        _table(header, rows, out)

    lat = [idx.get(("latency", i, 4)) for i in impls]
    if any(lat):
        print(f"\nlatency, np={np_}: back-to-back blocking 4-byte allreduces, per-op time "
              f"(median over batches and {rounds} round(s)); ratio = peer time / ronde time\n",
              file=out)
        header = ["impl", "per-op us", "p90 us", *[f"vs {short[g]}" for g in peer_impls]]
        rows = []
        for i, p in zip(impls, lat):
            if p is None:
                continue
            rows.append([i, f"{p.median_s * 1e6:.0f}", f"{p.p90_s * 1e6:.0f}",
                         *[_ratio(p, idx.get(("latency", g, 4))) for g in peer_impls]])
        _table(header, rows, out)
