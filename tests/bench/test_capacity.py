"""``python -m ronde.bench memory --capacity``: the search, the formula, the per-rank cgroup
(on a fake hierarchy and on the real one), and one small run end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ronde.bench import _cgroup, capacity


def _fake_fits(threshold: int, calls: list[int]):
    def fits(k: int) -> bool:
        calls.append(k)
        return k <= threshold
    return fits


@pytest.mark.parametrize("first", [None, 1, 2, 7, 13, 40, 64, 65, 99])
def test_largest_fitting_finds_the_threshold_without_probing_the_known_ends(first):
    for threshold in range(1, 65):
        calls: list[int] = []
        assert capacity.largest_fitting(_fake_fits(threshold, calls), 1, 65, first) \
            == threshold, (threshold, first, calls)
        assert 1 not in calls and 65 not in calls
        assert len(calls) == len(set(calls))  # no probe twice
        assert len(calls) <= 7  # log2(64) halvings, plus the guess
    calls = []
    # a guess at the threshold: one probe to confirm it, then the halvings above it
    assert capacity.largest_fitting(_fake_fits(30, calls), 1, 33, 30) == 30
    assert calls == [30, 31]


def test_bytes_per_parameter_are_zeros_formula_and_the_capacity_follows():
    assert capacity.bytes_per_param("distributed", 4) == 16
    assert capacity.bytes_per_param("stage1", 2) == 12 and capacity.bytes_per_param(
        "stage1", 4) == 10
    assert capacity.bytes_per_param("stage2", 2) == 10 and capacity.bytes_per_param(
        "stage2", 4) == 7
    assert capacity.bytes_per_param("zero", 4) == capacity.bytes_per_param("zero-views", 4) == 10
    assert capacity.bytes_per_param("fsdp2", 4) == 4
    with pytest.raises(ValueError, match="unknown contender 'ddp'; choose from distributed"):
        capacity.bytes_per_param("ddp", 2)
    mib = 1 << 20
    # 1536 MiB, 300 MiB fixed, stage 2 at np=4: 1236 MiB / 7 bytes
    assert capacity.formula_params(1536 * mib, 300 * mib, 7) == pytest.approx(1236 * mib / 7)
    assert capacity.formula_params(100, 200, 16) == 0.0
    assert capacity.LAYER_PARAMS == 4_196_352


def test_cgroup_v1_child_on_a_fake_hierarchy(tmp_path):
    mount = tmp_path / "cgroup"
    own = mount / "memory" / "jobs" / "me"
    own.mkdir(parents=True)
    proc = tmp_path / "proc_cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/jobs/me\n0::/\n")
    hierarchy = _cgroup.find_hierarchy(str(mount), str(proc))
    # under this process's own cgroup, not the root
    assert hierarchy == _cgroup.Hierarchy(str(own), 1)
    cap = _cgroup.create(hierarchy, "ronde-bench-1-1-0", 700 << 20)
    path = own / "ronde-bench-1-1-0"
    assert cap == _cgroup.Cap(str(path), 1, 700 << 20)
    assert (path / "memory.limit_in_bytes").read_text() == str(700 << 20)
    assert (path / "memory.memsw.limit_in_bytes").read_text() == str(700 << 20)  # no swap
    _cgroup.join(cap.path, 4242)
    assert (path / "cgroup.procs").read_text() == "4242"
    (path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    (path / "memory.max_usage_in_bytes").write_text("123\n")
    assert _cgroup.oom_kills(cap) == 1 and _cgroup.peak_bytes(cap) == 123
    assert _cgroup.usage_bytes(cap) is None  # not there: unknown, not 0


def test_cgroup_v2_child_on_a_fake_hierarchy(tmp_path):
    mount = tmp_path / "cgroup"
    mount.mkdir()
    (mount / "cgroup.controllers").write_text("cpu memory pids\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")  # at the root: children are made there
    hierarchy = _cgroup.find_hierarchy(str(mount), str(proc))
    assert hierarchy == _cgroup.Hierarchy(str(mount), 2)
    assert (mount / "cgroup.subtree_control").read_text() == "+memory"
    cap = _cgroup.create(hierarchy, "ronde-bench-1-2-1", 1536 << 20)
    path = mount / "ronde-bench-1-2-1"
    assert (path / "memory.max").read_text() == str(1536 << 20)
    assert (path / "memory.swap.max").read_text() == "0"
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    (path / "memory.current").write_text("4096\n")
    assert _cgroup.oom_kills(cap) == 1 and _cgroup.usage_bytes(cap) == 4096


def test_no_cgroup_hierarchy_means_no_tree(tmp_path):
    assert _cgroup.find_hierarchy(str(tmp_path), str(tmp_path / "missing")) is None


@pytest.mark.timeout(60)
def test_a_real_cap_kills_a_process_over_it_and_leaves_no_cgroup(tmp_path):
    hierarchy = _cgroup.find_hierarchy()
    if hierarchy is None:  # not root, or no writable hierarchy: the bench says so when asked
        out = subprocess.run([sys.executable, "-m", "ronde.bench", "memory", "--capacity",
                              "--cap", "cgroup"], capture_output=True, text=True, timeout=50)
        assert out.returncode == 2 and "no memory cgroup can be made here" in out.stderr
        return
    caps = [_cgroup.create(hierarchy, f"{capacity.cgroup_prefix()}test-{i}", 64 << 20)
            for i in range(2)]
    try:
        for cap, mib in zip(caps, (256, 16)):
            code = (f"from ronde.bench import _cgroup; _cgroup.join({cap.path!r}); "
                    f"b = bytearray({mib} << 20); print(len(b))")
            run = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                 timeout=50)
            if mib > 64:
                assert run.returncode == -9 and _cgroup.oom_kills(cap) == 1
            else:
                assert run.returncode == 0 and _cgroup.oom_kills(cap) == 0
                assert (_cgroup.peak_bytes(cap) or 0) >= 16 << 20
    finally:
        for cap in caps:
            _cgroup.remove(cap)
    assert not [c for c in caps if os.path.exists(c.path)]


@pytest.mark.timeout(180)
def test_capacity_mode_searches_each_contender_and_leaves_no_cgroup():
    # 480 MiB a rank: one layer fits (charged at most ~440 MiB when written); two layers of
    # DistributedOptimizer (16 bytes a parameter) do not (~520). One contender: each probe
    # starts two ranks that import torch (the suite's time)
    out = subprocess.run([sys.executable, "-m", "ronde.bench", "memory", "--capacity",
                          "--np", "2", "--budget-mib", "480", "--contenders",
                          "distributed", "--steps", "2", "--max-layers", "2"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    points = {p["contender"]: p for p in
              (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    assert set(points) == {"distributed"}, out.stdout
    for p in points.values():
        assert p["method"] in ("cgroup v1", "cgroup v2", "peak RSS")
        fitting = [k for k, reason in p["probes"] if reason == "fits"]
        failing = [k for k, reason in p["probes"] if reason != "fits"]
        assert p["layers"] == max(fitting, default=0)
        assert not failing or max(fitting, default=0) < min(failing), p
        assert p["params_m"] == round(p["layers"] * capacity.LAYER_PARAMS / 1e6, 1)
        if p["layers"]:
            assert p["fixed_mib"] > 0 and p["formula_params_m"] > 0 and p["of_formula"] > 0
            assert p["peak_rss_mib"] > 0
    assert points["distributed"]["layers"] >= 1 and points["distributed"]["bytes_per_param"] == 16
    assert "| distributed | 2 |" in out.stdout
    found = re.search(r"cgroups (\S+)/(ronde-bench-\d+-)\*", out.stderr)
    if points["distributed"]["method"] != "peak RSS":
        # the kernel's kill was seen and counted as "does not fit", not as an error
        assert [k for k, reason in points["distributed"]["probes"] if reason == "oom"], \
            out.stderr[-2000:]
        assert found, out.stderr[-2000:]
        parent, prefix = found.groups()
        assert not [d for d in os.listdir(parent) if d.startswith(prefix)]
