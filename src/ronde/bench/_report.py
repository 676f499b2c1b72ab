"""Combining rounds into points, and printing them: JSON lines and ratio tables.

A *point* is one (case, contender, size): the median over rounds of each round's
slowest-rank median (and p90) time, with algbw and busbw derived from that median.
Ratios are bandwidth ratios against a peer (``> 1`` means ronde is faster); against the
MPI peers the ratio is taken against the faster of them at each point ("best MPI"). The
fusion case's two variants are the cases ``fusion.single`` and ``fusion.tensors``; its
table gives each contender's tensors/single time ratio instead.
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
                            busbw_GBps=busbw_GBps(nbytes, med, np_, case),
                            rounds=len(per_round),
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
    if seconds < 100e-6:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e6:.0f} us" if seconds < 10e-3 else f"{seconds * 1e3:.1f} ms"


def _ratio(ours: Point | None, peer: Point | None) -> str:
    if ours is None or peer is None:
        return "-"
    r = peer.median_s / ours.median_s
    if r >= 100:
        return f"{r:.0f}"
    return f"{r:.2f}" if r >= 0.1 else f"{r:.2g}"


def points_from_json(docs: Sequence[dict[str, Any]]) -> list[Point]:
    """Points back from their JSON form (``--json-out``'s ``points``)."""
    fields = set(Point.__dataclass_fields__)
    return [Point(**{k: v for k, v in d.items() if k in fields}) for d in docs]


def _best(points: Sequence[Point | None]) -> Point | None:
    present = [p for p in points if p is not None]
    return min(present, key=lambda p: p.median_s) if present else None


def print_tables(points: Sequence[Point], ronde_impls: Sequence[str],
                 peer_impls: Sequence[str], out: TextIO,
                 mpi_impls: Sequence[str] = ()) -> None:
    """Markdown tables per case: times, busbw and ronde/peer bandwidth ratios.

    ``mpi_impls`` (a subset of ``peer_impls``) are compared as one: the faster MPI at
    each point.
    """
    impls = [*ronde_impls, *peer_impls]
    # ronde over Gloo/MPI keeps its prefix so it is not mistaken for the raw peer
    short = {i: i if i in ("ronde-gloo", "ronde-mpi") else i.removeprefix("ronde-")
             for i in impls}
    idx = {(p.case, p.impl, p.bytes): p for p in points}
    np_ = points[0].np if points else 0
    rounds = max((p.rounds for p in points), default=0)
    plain = [g for g in peer_impls if g not in mpi_impls]
    mpis = [g for g in peer_impls if g in mpi_impls]

    def against(case: str, b: int) -> list[Point | None]:
        """The points each ratio column compares with: each plain peer, then best MPI."""
        cols = [idx.get((case, g, b)) for g in plain]
        if mpis:
            cols.append(_best([idx.get((case, m, b)) for m in mpis]))
        return cols

    vs_heads = [short[g] for g in plain] + (["MPI"] if mpis else [])
    ratio_heads = [f"{short[r]}/{h}" for h in vs_heads for r in ronde_impls]

    for case in ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall"):
        sizes = sorted({p.bytes for p in points if p.case == case})
        if not sizes:
            continue
        print(f"\n{case}, np={np_}, float32{' sum' if 'reduce' in case else ''}; time = "
              f"median over {rounds} round(s) of the slowest rank's median; busbw in GB/s; "
              "ratio = ronde busbw / peer busbw (> 1: ronde faster)"
              + ("; MPI = the faster MPI at that size" if mpis else "") + "\n", file=out)
        header = ["size", *[f"{short[i]} time" for i in impls],
                  *[f"{short[i]} busbw" for i in impls], *ratio_heads]
        rows = []
        for b in sizes:
            pts = [idx.get((case, i, b)) for i in impls]
            vs = against(case, b)
            rows.append([format_bytes(b), *[_time(p.median_s if p else None) for p in pts],
                         *[f"{p.busbw_GBps:.3g}" if p else "-" for p in pts],
                         *[_ratio(idx.get((case, r, b)), g) for g in vs for r in ronde_impls]])
        _table(header, rows, out)

    lat = [idx.get(("latency", i, 4)) for i in impls]
    if any(lat):
        print(f"\nlatency, np={np_}: back-to-back blocking 4-byte allreduces, per-op time "
              f"(median over batches and {rounds} round(s)); ratio = peer time / ronde time"
              + ("; MPI = the faster MPI" if mpis else "") + "\n", file=out)
        header = ["impl", "per-op us", "p90 us", *[f"vs {h}" for h in vs_heads]]
        rows = []
        for i, p in zip(impls, lat):
            if p is None:
                continue
            rows.append([i, f"{p.median_s * 1e6:.1f}", f"{p.p90_s * 1e6:.1f}",
                         *[_ratio(p, g) for g in against("latency", 4)]])
        _table(header, rows, out)

    fused = {p.impl: p for p in points if p.case == "fusion.tensors"}
    single = {p.impl: p for p in points if p.case == "fusion.single"}
    views = {p.impl: p for p in points if p.case == "fusion.views"}
    if fused or single:
        nbytes = next(iter((fused or single).values())).bytes
        print(f"\nfusion, np={np_}: ResNet-50's 161 gradient tensors ({format_bytes(nbytes)} "
              "of float32 in all) as 161 allreduces (ronde: all submitted with "
              "allreduce_async, then waited; peers: blocking calls in a row) against one "
              f"allreduce of a single buffer of that size; median over {rounds} round(s); "
              "ratio = 161-tensor time / single time (target for ronde: <= 1.2); 'views' = "
              "the same 161 calls on views of one buffer (memory laid out like the single "
              "buffer)\n", file=out)
        header = ["impl", "161 tensors", "161 views", "single buffer", "tensors/single",
                  "views/single", "tensors busbw", "single busbw"]
        rows = []
        for i in impls:
            f, s1, v = fused.get(i), single.get(i), views.get(i)
            if f is None and s1 is None:
                continue
            rows.append([i, _time(f.median_s if f else None), _time(v.median_s if v else None),
                         _time(s1.median_s if s1 else None),
                         f"{f.median_s / s1.median_s:.2f}" if f and s1 else "-",
                         f"{v.median_s / s1.median_s:.2f}" if v and s1 else "-",
                         f"{f.busbw_GBps:.3g}" if f else "-",
                         f"{s1.busbw_GBps:.3g}" if s1 else "-"])
        _table(header, rows, out)
