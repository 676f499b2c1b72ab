"""``python -m ronde.timeline summary trace.json [more.json ...]``: what a timeline says.

Reads the Chrome-trace timelines that ``RONDE_TIMELINE`` / ``--timeline-filename`` write
(``core/timeline.py``; one file per rank with ``{rank}`` in the path, or rank 0's
alone; files cut short by a crash too) and works out, per rank and per training step:

* **steps**: a step starts each time the first tensor the rank ever submitted is
  submitted again (a training loop submits its gradients in the same order each step);
* **compute**: the step's time except its *waiting*, the stretch from its last
  submission to the end of its last collective (the rank had nothing to compute);
* **communication**: the union of the collectives' executor phases in the step, how
  much of it ran *before* the last submission (overlapped with compute) and how much
  after it (*exposed*: the rank only waited);
* **negotiation**: the union of the ``NEGOTIATE`` phases (waiting for every rank to
  announce a tensor);
* **late rank** (two files or more, ranks on one host, whose clocks agree): per step,
  the rank that announced its tensors last, by how much on average;
* **slowest tensors**: by the total duration of their collective.

It prints one screen: per rank the totals (s) and the p50/p90/p99/max per step (ms) of
each of these, the five longest steps, how often each rank was the late one, the ten
slowest tensors. ``--steps`` adds the per-step rows (``--steps A:B`` those of steps A
to B-1). ``--json FILE`` writes every number, ``--html FILE`` a page with the summary,
every step's row (and the plot where matplotlib is installed), ``--png FILE`` a plot
of communication over time per rank (``pip install matplotlib``).

The work is linear in the events (after one sort): each phase is put in the steps it
overlaps by bisection on the step starts, and each step's interval arithmetic sees only
its own phases.
"""

from __future__ import annotations

import argparse
import base64
import heapq
import html
import io
import json
import sys
from bisect import bisect_right
from typing import Any, Sequence

from .core.timeline import load

#: phases that are not communication (waiting to be announced, to be agreed)
_WAITS = ("QUEUE", "NEGOTIATE")
#: the per-step figures: (name in the report, key of a step's row)
_METRICS = (("wall", "wall_us"), ("compute", "compute_us"), ("waiting", "waiting_us"),
            ("communication", "comm_us"), ("overlapped", "overlapped_us"),
            ("exposed", "exposed_us"), ("negotiation", "negotiate_us"))
#: those on the screen (overlapped is communication minus exposed)
_SHOWN = tuple(m for m in _METRICS if m[0] != "overlapped")
#: more ranks than this get one line each instead of one line per figure
_DETAILED_RANKS = 3
#: ranks listed at most in the one-line-per-rank table
_LISTED_RANKS = 8
_WORST_STEPS = 5
_SLOWEST_TENSORS = 10
_LATE_RANKS = 3


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float
          ) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _by_rank(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per rank: tensor names of its rows, and its phase events as (name, phase, lo, hi)."""
    ranks: dict[int, dict[str, Any]] = {}
    for e in events:
        pid = e.get("pid")
        if not isinstance(pid, int):
            continue
        r = ranks.setdefault(pid, {"rows": {}, "phases": []})
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            r["rows"][e.get("tid")] = str((e.get("args") or {}).get("name"))
        elif e.get("ph") == "X":
            lo = float(e.get("ts", 0.0))
            r["phases"].append((e.get("tid"), str(e.get("name")), lo,
                                lo + float(e.get("dur", 0.0))))
    for r in ranks.values():
        r["phases"] = [(r["rows"].get(tid, f"row {tid}"), ph, lo, hi)
                       for tid, ph, lo, hi in r["phases"]]
    return ranks


def _steps(phases: list[tuple[str, str, float, float]]) -> list[tuple[float, float]]:
    queue = sorted((lo, name) for name, ph, lo, _ in phases if ph == "QUEUE")
    if not queue:
        return []
    first = queue[0][1]
    starts = [lo for lo, name in queue if name == first]
    end = max(hi for _, _, _, hi in phases)
    return [(s, starts[i + 1] if i + 1 < len(starts) else end) for i, s in enumerate(starts)]


def _buckets(intervals: list[tuple[float, float]], steps: list[tuple[float, float]],
             starts: list[float]) -> list[list[tuple[float, float]]]:
    """Per step, the intervals that overlap it: each interval visits only the steps it
    overlaps (found by bisection), not every step."""
    out: list[list[tuple[float, float]]] = [[] for _ in steps]
    for a, b in intervals:
        j = max(0, bisect_right(starts, a) - 1)
        while j < len(steps) and steps[j][0] < b:
            if a < steps[j][1]:
                out[j].append((a, b))
            j += 1
    return out


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not ordered:
        return 0.0
    pos = q / 100 * (len(ordered) - 1)
    i = int(pos)
    if i + 1 >= len(ordered):
        return ordered[-1]
    return ordered[i] + (ordered[i + 1] - ordered[i]) * (pos - i)


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    total = sum(ordered)
    return {"count": len(ordered), "total_us": total,
            "mean_us": total / len(ordered) if ordered else 0.0,
            "p50_us": _percentile(ordered, 50), "p90_us": _percentile(ordered, 90),
            "p99_us": _percentile(ordered, 99), "max_us": ordered[-1] if ordered else 0.0}


def _rank_steps(phases: list[tuple[str, str, float, float]]
                ) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """One rank's per-step rows, and per step when each tensor was announced."""
    steps = _steps(phases)
    starts = [lo for lo, _ in steps]
    comm = _buckets([(lo, hi) for _, ph, lo, hi in phases if ph not in _WAITS], steps, starts)
    nego = _buckets([(lo, hi) for _, ph, lo, hi in phases if ph == "NEGOTIATE"], steps,
                    starts)
    last = list(starts)  # the step's last submission
    seen: list[dict[str, float]] = [{} for _ in steps]
    for name, ph, q, e in phases:
        if ph != "QUEUE":
            continue
        j = bisect_right(starts, q) - 1
        if j < 0 or q >= steps[j][1]:
            continue
        last[j] = max(last[j], q)
        seen[j].setdefault(name, e)  # announced at the end of its first queue phase
    rows = []
    for j, (lo, hi) in enumerate(steps):
        in_step = _clip(comm[j], lo, hi)
        total = _union(in_step)
        exposed = _union(_clip(in_step, last[j], hi))
        comm_end = max((b for _, b in in_step), default=last[j])
        waiting = max(0.0, comm_end - last[j])  # after its last submission: only waits
        rows.append({"start_us": lo, "wall_us": hi - lo, "compute_us": hi - lo - waiting,
                     "waiting_us": waiting, "comm_us": total,
                     "overlapped_us": total - exposed, "exposed_us": exposed,
                     "negotiate_us": _union(_clip(nego[j], lo, hi))})
    return rows, seen


def _late(announces: dict[int, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """Per step, the rank that announced the tensors all ranks share last."""
    late = []
    steps = min(len(v) for v in announces.values())
    for k in range(steps):
        names = set.intersection(*(set(v[k]) for v in announces.values()))
        if not names:
            continue
        lateness = {r: 0.0 for r in announces}
        for name in names:
            first = min(announces[r][k][name] for r in announces)
            for r in announces:
                lateness[r] += (announces[r][k][name] - first) / len(names)
        worst = max(lateness, key=lambda r: lateness[r])
        late.append({"step": k, "rank": worst, "mean_late_us": lateness[worst]})
    return late


def _worst_steps(out: dict[str, Any], t0: float) -> list[dict[str, Any]]:
    """The longest steps: per step number, the rank with the longest one."""
    longest: dict[int, tuple[int, dict[str, float]]] = {}
    for rank, rows in out["ranks"].items():
        for k, row in enumerate(rows):
            if k not in longest or row["wall_us"] > longest[k][1]["wall_us"]:
                longest[k] = (rank, row)
    late = {x["step"]: x for x in out["late"]}
    top = heapq.nsmallest(_WORST_STEPS, longest.items(),
                          key=lambda kv: (-kv[1][1]["wall_us"], kv[0]))
    return [{"step": k, "rank": rank, "at_s": (row["start_us"] - t0) / 1e6, **row,
             "late_rank": late[k]["rank"] if k in late else None,
             "late_by_us": late[k]["mean_late_us"] if k in late else None}
            for k, (rank, row) in top]


def _late_ranks(late: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_rank: dict[int, list[float]] = {}
    for x in late:
        by_rank.setdefault(x["rank"], []).append(x["mean_late_us"])
    rows = [{"rank": r, "steps": len(v), "of_steps": len(late),
             "mean_late_us": sum(v) / len(v), "p90_late_us": _percentile(sorted(v), 90)}
            for r, v in by_rank.items()]
    return sorted(rows, key=lambda x: (-x["steps"], x["rank"]))


def _summarize(ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"ranks": {}, "stats": {}, "slowest": [], "late": [],
                           "late_ranks": [], "worst_steps": []}
    durations: dict[str, list[float]] = {}
    announces: dict[int, list[dict[str, float]]] = {}  # rank -> per step: name -> time
    t0, t1 = float("inf"), float("-inf")
    for rank, info in sorted(ranks.items()):
        phases = info["phases"]
        rows, announces[rank] = _rank_steps(phases)
        out["ranks"][rank] = rows
        out["stats"][rank] = {name: _stats([row[key] for row in rows])
                              for name, key in _METRICS}
        for name, ph, lo, hi in phases:
            t0, t1 = min(t0, lo), max(t1, hi)
            if ph not in _WAITS and not ph.startswith(("MEMCPY", "TRANSFER", "SCALE")):
                durations.setdefault(name, []).append(hi - lo)
    slowest = [{"tensor": n, "total_us": sum(d), "mean_us": sum(d) / len(d),
                "max_us": max(d), "count": len(d)} for n, d in durations.items()]
    out["slowest"] = sorted(slowest, key=lambda x: (-x["total_us"], x["tensor"])
                            )[:_SLOWEST_TENSORS]
    if len(announces) > 1:
        out["late"] = _late(announces)
        out["late_ranks"] = _late_ranks(out["late"])
    out["span_s"] = (t1 - t0) / 1e6 if t1 >= t0 else 0.0
    out["worst_steps"] = _worst_steps(out, t0)
    return out


def summarize(paths: Sequence[str]) -> dict[str, Any]:
    """The numbers of the report (microseconds), from one or more timeline files."""
    events: list[dict[str, Any]] = []
    for path in paths:
        events.extend(load(path))
    return _summarize(_by_rank(events))


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def _s(us: float) -> str:
    return f"{us / 1e6:.3f}"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def _per_rank(summary: dict[str, Any]) -> list[str]:
    stats = summary["stats"]
    if len(stats) <= _DETAILED_RANKS:
        lines = ["per rank: total (s), share of the wall time, per step (ms)",
                 "| rank | per step | total s | share | p50 | p90 | p99 | max |",
                 "|---|---|---|---|---|---|---|---|"]
        for rank, st in stats.items():
            wall = st["wall"]["total_us"]
            lines += [f"| {rank} | {name} | {_s(x['total_us'])} | "
                      f"{_share(x['total_us'], wall)} | {_ms(x['p50_us'])} | "
                      f"{_ms(x['p90_us'])} | {_ms(x['p99_us'])} | {_ms(x['max_us'])} |"
                      for name, x in ((n, st[n]) for n, _ in _SHOWN)]
        return lines
    # many ranks: a line each (the ones computing longest: the stragglers), then the
    # per-step percentiles of all ranks' steps together
    shown = sorted(heapq.nlargest(_LISTED_RANKS, stats,
                                  key=lambda r: stats[r]["compute"]["total_us"]))
    lines = ["per rank: totals (s), wall per step (ms)",
             "| rank | steps | " + " | ".join(n for n, _ in _SHOWN)
             + " | wall p50 | p90 | p99 |", "|---" * (len(_SHOWN) + 5) + "|"]
    for rank in shown:
        st = stats[rank]
        lines.append(f"| {rank} | {st['wall']['count']} | "
                     + " | ".join(_s(st[n]["total_us"]) for n, _ in _SHOWN)
                     + f" | {_ms(st['wall']['p50_us'])} | {_ms(st['wall']['p90_us'])} | "
                     f"{_ms(st['wall']['p99_us'])} |")
    if len(stats) > len(shown):
        lines.append(f"({len(stats) - len(shown)} more ranks, computing less: --json FILE "
                     "has them all)")
    lines += ["", "all ranks, per step (ms)", "| per step | p50 | p90 | p99 | max |",
              "|---|---|---|---|---|"]
    for name, key in _SHOWN:
        x = _stats([row[key] for rows in summary["ranks"].values() for row in rows])
        lines.append(f"| {name} | {_ms(x['p50_us'])} | {_ms(x['p90_us'])} | "
                     f"{_ms(x['p99_us'])} | {_ms(x['max_us'])} |")
    return lines


def _step_rows(summary: dict[str, Any], window: slice) -> list[str]:
    lines = []
    for rank, rows in summary["ranks"].items():
        picked = range(*window.indices(len(rows)))
        if not picked:
            lines += [f"rank {rank}: no step in the window (steps 0 to {len(rows) - 1})"
                      if rows else f"rank {rank}: no steps", ""]
            continue
        lines.append(f"rank {rank}: steps {picked[0]} to {picked[-1]} of {len(rows)} (ms)")
        lines.append("| step | wall | compute | waiting | communication | overlapped | "
                     "exposed | negotiation |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for i in picked:
            s = rows[i]
            lines.append(f"| {i} | {_ms(s['wall_us'])} | {_ms(s['compute_us'])} | "
                         f"{_ms(s['waiting_us'])} | {_ms(s['comm_us'])} | "
                         f"{_ms(s['overlapped_us'])} | {_ms(s['exposed_us'])} | "
                         f"{_ms(s['negotiate_us'])} |")
        lines.append("")
    most = max((len(rows) for rows in summary["ranks"].values()), default=0)
    picked = range(*window.indices(most))
    late = [x for x in summary["late"] if x["step"] in picked]
    if late:
        lines.append("late rank per step (announced its tensors last, mean lateness ms)")
        lines.append("| step | rank | late by |")
        lines.append("|---|---|---|")
        lines += [f"| {x['step']} | {x['rank']} | {_ms(x['mean_late_us'])} |"
                  for x in late]
        lines.append("")
    return lines


def format_text(summary: dict[str, Any], steps: slice | None = None) -> str:
    """The report: one screen; with ``steps`` (a slice of step numbers) the per-step
    rows of those steps after it."""
    counts = sorted({len(rows) for rows in summary["ranks"].values()}) or [0]
    n = len(summary["ranks"])
    lines = [f"ronde timeline: {n} rank{'s' if n != 1 else ''}, "
             + (f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}")
             + f" steps, {summary['span_s']:.1f} s; totals in s, per step in ms", ""]
    if any(counts):
        lines += _per_rank(summary) + [""]
        lines += ["longest steps (of the rank with the longest; at: s from the start)",
                  "| step | at s | rank | wall | compute | waiting | exposed | "
                  "negotiation | late rank |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {w['step']} | {w['at_s']:.3f} | {w['rank']} | {_ms(w['wall_us'])} | "
                  f"{_ms(w['compute_us'])} | {_ms(w['waiting_us'])} | "
                  f"{_ms(w['exposed_us'])} | {_ms(w['negotiate_us'])} | "
                  + (f"{w['late_rank']} by {_ms(w['late_by_us'])} |"
                     if w["late_rank"] is not None else "- |")
                  for w in summary["worst_steps"]]
        lines.append("")
    if summary["late_ranks"]:
        lines += ["late rank: the one that announced its tensors last (lateness ms)",
                  "| rank | late in steps | share | mean | p90 |", "|---|---|---|---|---|"]
        lines += [f"| {x['rank']} | {x['steps']} of {x['of_steps']} | "
                  f"{_share(x['steps'], x['of_steps'])} | {_ms(x['mean_late_us'])} | "
                  f"{_ms(x['p90_late_us'])} |"
                  for x in summary["late_ranks"][:_LATE_RANKS]]
    elif n == 1:
        lines.append("late rank: needs every rank's timeline ('{rank}' in the path)")
    lines.append("")
    lines += ["slowest tensors (their collective: total s, per call ms)",
              "| tensor | total s | count | mean | max |", "|---|---|---|---|---|"]
    lines += [f"| {x['tensor']} | {_s(x['total_us'])} | {x['count']} | {_ms(x['mean_us'])} | "
              f"{_ms(x['max_us'])} |" for x in summary["slowest"]]
    lines.append("")
    if steps is None:
        lines.append("per-step rows: --steps (all) or --steps A:B; every number: --json FILE")
    else:
        lines += _step_rows(summary, steps)
    return "\n".join(lines) + "\n"


def _plot(ranks: dict[int, dict[str, Any]], target: Any) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t0 = min((lo for r in ranks.values() for _, _, lo, _ in r["phases"]), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(ranks)))
    for i, (rank, info) in enumerate(sorted(ranks.items())):
        for kind, color in (("NEGOTIATE", "tab:orange"), (None, "tab:blue")):
            bars = [((lo - t0) / 1000, (hi - lo) / 1000) for _, ph, lo, hi in info["phases"]
                    if (ph == kind if kind else ph not in _WAITS)]
            ax.broken_barh(bars, (i - 0.3 if kind else i, 0.3), color=color)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in sorted(ranks)])
    ax.set_xlabel("ms (blue: collectives, orange: negotiation)")
    fig.tight_layout()
    fig.savefig(target, format="png", dpi=90)
    plt.close(fig)
    return True


def plot(paths: Sequence[str], target: Any) -> bool:
    """Communication over time per rank (PNG into ``target``, a path or a file); False
    without matplotlib."""
    events: list[dict[str, Any]] = []
    for path in paths:
        events.extend(load(path))
    return _plot(_by_rank(events), target)


def _window(text: str) -> slice:
    """``A:B`` (steps A to B-1), ``A:``, ``:B`` or ``N`` (step N alone)."""
    try:
        if ":" not in text:
            k = int(text)
            return slice(k, k + 1 if k != -1 else None)
        a, b = text.split(":", 1)
        return slice(int(a) if a.strip() else None, int(b) if b.strip() else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a step window; give A:B (steps A to B-1), A:, :B or N, "
            "or --steps alone for every step") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ronde.timeline",
                                description="Summarise ronde timelines.")
    p.add_argument("command", choices=["summary"])
    p.add_argument("paths", nargs="+", help="timeline files (one per rank, or rank 0's)")
    p.add_argument("--steps", nargs="?", const=slice(None), default=None, type=_window,
                   metavar="A:B", help="also print the per-step rows: all, or of steps A "
                   "to B-1 (A:B, A:, :B or N)")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--html", default=None,
                   help="write a page with the summary, every step's row (and plot)")
    p.add_argument("--png", default=None, help="plot communication over time per rank")
    args = p.parse_args(argv)
    events: list[dict[str, Any]] = []
    for path in args.paths:
        events.extend(load(path))
    ranks = _by_rank(events)
    del events
    summary = _summarize(ranks)
    sys.stdout.write(format_text(summary, args.steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.png and not _plot(ranks, args.png):
        print("--png needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    if args.html:
        buf = io.BytesIO()
        img = (f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'
               if _plot(ranks, buf) else "<p>(pip install matplotlib for the plot)</p>")
        text = format_text(summary, args.steps or slice(None))
        with open(args.html, "w") as f:
            f.write(f"<!doctype html><title>ronde timeline</title><h1>ronde timeline</h1>"
                    f"{img}<pre>{html.escape(text)}</pre>\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
