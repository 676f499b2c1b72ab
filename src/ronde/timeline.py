"""``python -m ronde.timeline summary trace.json [more.json ...]``: what a timeline says.

Reads the Chrome-trace timelines that ``RONDE_TIMELINE`` / ``--timeline-filename`` write
(``core/timeline.py``; one file per rank with ``{rank}`` in the path, or rank 0's
alone; files cut short by a crash too) and reports, per rank and per training step:

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
* **slowest tensors**: by the mean duration of their collective.

``--json FILE`` writes the numbers, ``--html FILE`` a page with the tables (and the plot
where matplotlib is installed), ``--png FILE`` a plot of communication over time per
rank (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from typing import Any, Sequence

from .core.timeline import load

#: phases that are not communication (waiting to be announced, to be agreed)
_WAITS = ("QUEUE", "NEGOTIATE")


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


def summarize(paths: Sequence[str]) -> dict[str, Any]:
    """The numbers of the report (microseconds), from one or more timeline files."""
    events: list[dict[str, Any]] = []
    for path in paths:
        events.extend(load(path))
    ranks = _by_rank(events)
    out: dict[str, Any] = {"ranks": {}, "slowest": [], "late": []}
    durations: dict[str, list[float]] = {}
    announces: dict[int, list[dict[str, float]]] = {}  # rank -> per step: name -> time
    for rank, info in sorted(ranks.items()):
        phases = info["phases"]
        comm = [(lo, hi) for _, ph, lo, hi in phases if ph not in _WAITS]
        nego = [(lo, hi) for _, ph, lo, hi in phases if ph == "NEGOTIATE"]
        rows = []
        announces[rank] = []
        for lo, hi in _steps(phases):
            submits = [q for name, ph, q, _ in phases if ph == "QUEUE" and lo <= q < hi]
            last = max(submits) if submits else lo
            in_step = _clip(comm, lo, hi)
            total = _union(in_step)
            exposed = _union(_clip(in_step, last, hi))
            comm_end = max((b for _, b in in_step), default=last)
            waiting = max(0.0, comm_end - last)  # after its last submission: only waits
            rows.append({"start_us": lo, "wall_us": hi - lo, "compute_us": hi - lo - waiting,
                         "waiting_us": waiting, "comm_us": total,
                         "overlapped_us": total - exposed, "exposed_us": exposed,
                         "negotiate_us": _union(_clip(nego, lo, hi))})
            seen: dict[str, float] = {}
            for name, ph, q, e in phases:
                if ph == "QUEUE" and lo <= q < hi and name not in seen:
                    seen[name] = e  # announced at the end of its queue phase
            announces[rank].append(seen)
        out["ranks"][rank] = rows
        for name, ph, lo, hi in phases:
            if ph not in _WAITS and not ph.startswith(("MEMCPY", "TRANSFER", "SCALE")):
                durations.setdefault(name, []).append(hi - lo)
    out["slowest"] = sorted(({"tensor": n, "mean_us": sum(d) / len(d), "count": len(d)}
                             for n, d in durations.items()),
                            key=lambda row: -row["mean_us"])[:10]
    if len(announces) > 1:
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
            out["late"].append({"step": k, "rank": worst, "mean_late_us": lateness[worst]})
    return out


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def format_text(summary: dict[str, Any]) -> str:
    lines = []
    for rank, rows in summary["ranks"].items():
        lines.append(f"rank {rank}: {len(rows)} step(s) (ms)")
        lines.append("| step | wall | compute | waiting | communication | overlapped | "
                     "exposed | negotiation |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for i, s in enumerate(rows):
            lines.append(f"| {i} | {_ms(s['wall_us'])} | {_ms(s['compute_us'])} | "
                         f"{_ms(s['waiting_us'])} | {_ms(s['comm_us'])} | "
                         f"{_ms(s['overlapped_us'])} | {_ms(s['exposed_us'])} | "
                         f"{_ms(s['negotiate_us'])} |")
        lines.append("")
    if summary["late"]:
        lines.append("late rank per step (announced its tensors last, mean lateness ms)")
        lines.append("| step | rank | late by |")
        lines.append("|---|---|---|")
        lines += [f"| {x['step']} | {x['rank']} | {_ms(x['mean_late_us'])} |"
                  for x in summary["late"]]
        lines.append("")
    lines.append("slowest tensors (mean duration of their collective, ms)")
    lines.append("| tensor | mean | count |")
    lines.append("|---|---|---|")
    lines += [f"| {x['tensor']} | {_ms(x['mean_us'])} | {x['count']} |"
              for x in summary["slowest"]]
    return "\n".join(lines) + "\n"


def plot(paths: Sequence[str], target: Any) -> bool:
    """Communication over time per rank (PNG into ``target``, a path or a file); False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    events: list[dict[str, Any]] = []
    for path in paths:
        events.extend(load(path))
    ranks = _by_rank(events)
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ronde.timeline",
                                description="Summarise ronde timelines.")
    p.add_argument("command", choices=["summary"])
    p.add_argument("paths", nargs="+", help="timeline files (one per rank, or rank 0's)")
    p.add_argument("--json", default=None, help="write the numbers here")
    p.add_argument("--html", default=None, help="write a page with the tables (and plot)")
    p.add_argument("--png", default=None, help="plot communication over time per rank")
    args = p.parse_args(argv)
    summary = summarize(args.paths)
    text = format_text(summary)
    sys.stdout.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.png and not plot(args.paths, args.png):
        print("--png needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    if args.html:
        buf = io.BytesIO()
        img = (f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'
               if plot(args.paths, buf) else "<p>(pip install matplotlib for the plot)</p>")
        with open(args.html, "w") as f:
            f.write(f"<!doctype html><title>ronde timeline</title><h1>ronde timeline</h1>"
                    f"{img}<pre>{html.escape(text)}</pre>\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
