"""``python -m ronde.timeline summary`` on synthetic timelines with known numbers.

The timelines are written by the real writer (:class:`ronde.core.timeline.Timeline`)
with made-up clocks: a training loop of two gradients, ``grad.0`` (small, through the
fusion buffer) and ``grad.1`` (large), every rank submitting them in the same order
each step, the last rank submitting ``late_us`` later than the others. Per step ``k``
(times from the step's start on rank 0, microseconds; ``L`` the rank's lateness):

| event | rank r |
|---|---|
| QUEUE grad.0 | ``L`` .. ``L + 100`` |
| NEGOTIATE grad.0 | ``L + 100`` .. ``late + 200`` |
| ALLREDUCE grad.0 | ``late + 300`` .. ``late + 2300`` (fusion in 200, transfer 1600, out 200) |
| QUEUE grad.1 | ``L + 6000`` .. ``L + 6100`` |
| NEGOTIATE grad.1 | ``L + 6100`` .. ``late + 6200`` |
| ALLREDUCE grad.1 | ``late + 6300`` .. ``late + 12300 + jitter`` (memcpy 500, transfer the rest) |

and the next step starts ``period_us + slow_us.get(k, 0)`` after this one.

Run as a script, it writes a large one for measuring the summary::

    python tests/test_timeline_report.py /tmp/tl 8300   # /tmp/tl/tl-0.json, tl-1.json
    python -m ronde.timeline summary /tmp/tl/tl-0.json /tmp/tl/tl-1.json
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Sequence

import numpy as np
import pytest

from ronde import timeline
from ronde.core.timeline import Timeline


def synthetic_timeline(folder: str, steps: int, ranks: int = 2, late_us: float = 3000.0,
                       period_us: float = 20_000.0, slow_us: dict[int, float] | None = None,
                       jitter_us: float = 0.0, seed: int = 0) -> list[str]:
    """Write ``tl-{rank}.json`` per rank under ``folder`` (see the module docstring);
    return their paths."""
    slow_us = slow_us or {}
    rng = random.Random(seed)
    starts, t = [], 5e8  # a perf_counter-like clock, in microseconds
    for k in range(steps):
        starts.append(t)
        t += period_us + slow_us.get(k, 0.0)
    jitter = [rng.uniform(0.0, jitter_us) for _ in range(steps)]
    paths = []
    for rank in range(ranks):
        path = os.path.join(folder, f"tl-{rank}.json")
        tl = Timeline(path, rank)
        lag = late_us if rank == ranks - 1 else 0.0
        for k, s in enumerate(starts):
            tl.phase("grad.0", "QUEUE", s + lag, s + lag + 100)
            tl.phase("grad.0", "NEGOTIATE", s + lag + 100, s + late_us + 200)
            a = s + late_us + 300
            tl.phase("grad.0", "MEMCPY_IN_FUSION_BUFFER", a, a + 200)
            tl.phase("grad.0", "TRANSFER", a + 200, a + 1800)
            tl.phase("grad.0", "MEMCPY_OUT_FUSION_BUFFER", a + 1800, a + 2000)
            tl.phase("grad.0", "ALLREDUCE", a, a + 2000)
            tl.phase("grad.1", "QUEUE", s + lag + 6000, s + lag + 6100)
            tl.phase("grad.1", "NEGOTIATE", s + lag + 6100, s + late_us + 6200)
            b, e = s + late_us + 6300, s + late_us + 12300 + jitter[k]
            tl.phase("grad.1", "MEMCPY_IN", b, b + 500)
            tl.phase("grad.1", "TRANSFER", b + 500, e)
            tl.phase("grad.1", "ALLREDUCE", b, e)
        tl.close()
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[str]:
    # 20 steps of 20 ms; steps 7 and 13 compute 9 and 5 ms longer
    return synthetic_timeline(str(tmp_path_factory.mktemp("tl")), 20,
                              slow_us={7: 9000.0, 13: 5000.0})


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ronde.timeline", "summary", *args],
                          capture_output=True, text=True, timeout=60)


def test_per_step_figures(two_ranks):
    s = timeline.summarize(two_ranks)
    r0, r1 = s["ranks"][0], s["ranks"][1]
    assert len(r0) == len(r1) == 20
    # rank 0: submits grad.1 at 6 ms; collectives end at 15.3 ms; negotiation waits
    # 3.1 ms twice for rank 1; grad.0's allreduce (2 ms) ran before the last submission
    assert r0[0] == {"start_us": 5e8, "wall_us": 20_000.0, "compute_us": 10_700.0,
                     "waiting_us": 9300.0, "comm_us": 8000.0, "overlapped_us": 2000.0,
                     "exposed_us": 6000.0, "negotiate_us": 6200.0}
    assert r0[7]["wall_us"] == 29_000.0 and r0[7]["compute_us"] == 19_700.0
    # rank 1: submits 3 ms later, so waits less and barely negotiates
    assert r1[1] == {"start_us": 5e8 + 23_000.0, "wall_us": 20_000.0,
                     "compute_us": 13_700.0, "waiting_us": 6300.0, "comm_us": 8000.0,
                     "overlapped_us": 2000.0, "exposed_us": 6000.0, "negotiate_us": 200.0}
    # the last step ends with its last event, not with a next step
    assert r0[-1]["wall_us"] == 15_300.0 and r1[-1]["wall_us"] == 12_300.0


def test_totals_percentiles_worst_steps_late_rank_and_tensors(two_ranks):
    s = timeline.summarize(two_ranks)
    for rank in (0, 1):
        stats = s["stats"][rank]
        for key, name in (("wall_us", "wall"), ("compute_us", "compute"),
                          ("waiting_us", "waiting"), ("comm_us", "communication"),
                          ("exposed_us", "exposed"), ("negotiate_us", "negotiation")):
            values = [row[key] for row in s["ranks"][rank]]
            st = stats[name]
            assert st["total_us"] == pytest.approx(sum(values))
            for q in (50, 90, 99):
                assert st[f"p{q}_us"] == pytest.approx(np.percentile(values, q)), (name, q)
            assert st["max_us"] == max(values)
    assert s["stats"][0]["wall"]["total_us"] == 17 * 20_000 + 29_000 + 25_000 + 15_300
    assert [(w["step"], w["wall_us"]) for w in s["worst_steps"]] == [
        (7, 29_000.0), (13, 25_000.0), (0, 20_000.0), (1, 20_000.0), (2, 20_000.0)]
    assert s["worst_steps"][0]["rank"] in (0, 1)
    assert s["worst_steps"][0]["late_rank"] == 1
    assert s["worst_steps"][0]["late_by_us"] == pytest.approx(3000.0)
    assert s["late_ranks"] == [{"rank": 1, "steps": 20, "of_steps": 20,
                                "mean_late_us": pytest.approx(3000.0),
                                "p90_late_us": pytest.approx(3000.0)}]
    assert [(x["tensor"], x["count"]) for x in s["slowest"]] == [("grad.1", 40),
                                                                  ("grad.0", 40)]
    assert s["slowest"][0]["total_us"] == pytest.approx(40 * 6000.0)
    assert s["slowest"][0]["mean_us"] == pytest.approx(6000.0)


def test_the_default_output_is_one_screen(two_ranks):
    out = _cli(*two_ranks)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) < 60, out.stdout
    text = out.stdout
    assert "2 ranks, 20 steps" in text
    # rank 0's wall: 20 steps, 0.409 s in all; p50 20 ms, max 29 ms
    assert "| 0 | wall | 0.409 | 100% | 20.00 | 20.50 | 28.24 | 29.00 |" in text, text
    assert "| 1 | negotiation | 0.004 | 1% | 0.20 | 0.20 | 0.20 | 0.20 |" in text, text
    assert "| 7 |" in text and "| 13 |" in text  # the worst steps
    assert "| 1 | 20 of 20 | 100% | 3.00 | 3.00 |" in text, text  # the late rank
    assert "| grad.1 | 0.240 | 40 | 6.00 | 6.00 |" in text, text
    assert "step | wall | compute" not in text  # no per-step rows without --steps


def test_steps_all_and_a_window(two_ranks):
    every = _cli(*two_ranks, "--steps").stdout
    assert every.count("| 19 | ") >= 3  # step 19 of both ranks and of the late table
    assert "| 7 | 29.00 | 19.70 | 9.30 | 8.00 | 2.00 | 6.00 | 6.20 |" in every, every
    window = _cli(*two_ranks, "--steps", "5:8").stdout
    rows = [ln for ln in window.splitlines() if ln.startswith("| 5 | 20.00")]
    assert len(rows) == 2, window  # step 5 of rank 0 and rank 1
    assert "| 7 | 29.00 | 19.70 |" in window and "| 8 | 20.00 |" not in window
    assert "| 4 | 20.00 |" not in window
    bad = _cli(*two_ranks, "--steps", "x:y")
    assert bad.returncode == 2 and "--steps" in bad.stderr


def test_json_and_html_keep_every_step(two_ranks, tmp_path):
    out = _cli(*two_ranks, "--json", str(tmp_path / "s.json"), "--html",
               str(tmp_path / "s.html"))
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "s.json").read_text())
    assert len(data["ranks"]["0"]) == 20 and data["stats"]["1"]["wall"]["count"] == 20
    page = (tmp_path / "s.html").read_text()
    assert "<pre>" in page and "| 19 | 15.30 |" in page


def test_png_as_before(two_ranks, tmp_path):
    pytest.importorskip("matplotlib")
    out = _cli(*two_ranks, "--png", str(tmp_path / "s.png"), "--html", str(tmp_path / "s.html"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in (tmp_path / "s.html").read_text()


def test_many_ranks_still_fit_one_screen(tmp_path):
    paths = synthetic_timeline(str(tmp_path), 30, ranks=12)
    out = _cli(*paths)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) < 60, out.stdout
    assert "12 ranks, 30 steps" in out.stdout and "| 11 | 30 of 30 |" in out.stdout


def _count_work(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the intervals handed to the per-step interval arithmetic."""
    seen = [0]
    clip, union = timeline._clip, timeline._union

    def counted_clip(intervals, lo, hi):
        seen[0] += len(intervals)
        return clip(intervals, lo, hi)

    def counted_union(intervals):
        seen[0] += len(intervals)
        return union(intervals)

    monkeypatch.setattr(timeline, "_clip", counted_clip)
    monkeypatch.setattr(timeline, "_union", counted_union)
    return seen


def test_thousands_of_steps_take_work_linear_in_the_events(tmp_path, monkeypatch):
    """3,000 steps: a summary that scanned every phase for each step (as it once did)
    handles about 3,000 x 66,000 intervals; a linear one a small multiple of 66,000."""
    seen = _count_work(monkeypatch)
    paths = synthetic_timeline(str(tmp_path), 3000, jitter_us=2000.0)
    s = timeline.summarize(paths)
    events = 2 * 3000 * 11
    assert len(s["ranks"][0]) == 3000 and len(s["late"]) == 3000
    assert 0 < seen[0] < 4 * events, seen[0]
    assert [x["rank"] for x in s["late_ranks"]] == [1]
    text = timeline.format_text(s)
    assert len(text.splitlines()) < 60


def main(argv: Sequence[str]) -> int:
    folder, steps = argv[0], int(argv[1]) if len(argv) > 1 else 8300
    os.makedirs(folder, exist_ok=True)
    paths = synthetic_timeline(folder, steps, jitter_us=4000.0,
                               slow_us={k: 15_000.0 for k in range(500, steps, 1000)})
    for p in paths:
        print(p, os.path.getsize(p), "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
