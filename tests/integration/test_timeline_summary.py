"""``python -m ronde.timeline summary`` on the timelines of a real 2-rank run: steps found
from the repeating first tensor, compute and communication per step, rank 1 (which
computes 30 ms longer each step) named as the late rank, the slowest tensor; and a
file cut short, as a crash leaves it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ronde import timeline
from ronde.testing import run_ranks

from . import workers


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("tl")
    pattern = str(d / "tl-{rank}.json")
    run_ranks(2, workers.timeline_training_steps, timeout_s=60,
              env={"RONDE_TIMELINE": pattern, "RONDE_FUSION_THRESHOLD": "0"})
    return [str(d / f"tl-{r}.json") for r in (0, 1)]


@pytest.mark.timeout(90)
def test_steps_compute_and_communication_per_rank(traces):
    s = timeline.summarize(traces)
    assert sorted(s["ranks"]) == [0, 1]
    for rank, steps in s["ranks"].items():
        assert len(steps) == 6, steps
        for st in steps[1:-1]:
            assert st["comm_us"] > 0 and st["wall_us"] >= st["compute_us"]
            assert abs(st["overlapped_us"] + st["exposed_us"] - st["comm_us"]) < 1.0
            assert abs(st["compute_us"] + st["waiting_us"] - st["wall_us"]) < 1.0
            # each step "computes" 10 ms (rank 0) or 40 ms (rank 1) between steps
            assert st["compute_us"] > (8_000 if rank == 0 else 35_000), st
    # rank 0 waits for rank 1 every step: its negotiation waits are the long ones
    wait0 = sum(st["negotiate_us"] for st in s["ranks"][0][1:])
    wait1 = sum(st["negotiate_us"] for st in s["ranks"][1][1:])
    assert wait0 > wait1, (wait0, wait1)


@pytest.mark.timeout(90)
def test_the_late_rank_and_the_slowest_tensor_are_named(traces):
    s = timeline.summarize(traces)
    late = [x["rank"] for x in s["late"][1:]]
    assert late and late.count(1) >= len(late) - 1, s["late"]
    assert s["slowest"][0]["tensor"] == "grad.2", s["slowest"]  # the largest gradient


@pytest.mark.timeout(90)
def test_the_command_line_and_a_file_cut_short(traces, tmp_path):
    cut = tmp_path / "cut.json"
    lines = open(traces[0]).read().splitlines()
    cut.write_text("\n".join(lines[: len(lines) * 2 // 3]) + "\n")  # as a SIGKILL leaves it
    out = subprocess.run([sys.executable, "-m", "ronde.timeline", "summary", str(cut),
                          traces[1], "--json", str(tmp_path / "s.json"),
                          "--html", str(tmp_path / "s.html")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| 0 | wall |" in out.stdout and "| 1 | wall |" in out.stdout, out.stdout
    assert "slowest" in out.stdout and "| step | wall |" not in out.stdout  # one screen
    assert (tmp_path / "s.json").exists() and "<pre>" in (tmp_path / "s.html").read_text()
    assert "| step | wall |" in (tmp_path / "s.html").read_text()  # every step's row
