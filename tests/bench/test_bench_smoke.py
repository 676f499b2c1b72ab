"""The benchmark commands run end to end (numbers are not checked: no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.timeout(180)
def test_allreduce_and_latency_cases_run_through_ronderun():
    out = subprocess.run(
        [sys.executable, "-m", "ronde.bench", "allreduce,latency,fusion", "--sizes",
         "4B,1MiB", "--rounds", "1", "--transports", "shm", "--peers", "none",
         "--target-s", "0.05", "--latency-ops", "200"],
        capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    points = _json_lines(out.stdout)
    cases = {(p["case"], p["bytes"]) for p in points}
    assert ("allreduce", 4) in cases and ("allreduce", 1 << 20) in cases
    assert any(p["case"] == "latency" for p in points)
    assert {p["case"] for p in points if p["case"].startswith("fusion")} == {
        "fusion.single", "fusion.tensors", "fusion.views"}
    assert all(p["median_s"] > 0 for p in points)


@pytest.mark.timeout(120)
def test_memory_bandwidth_context_runs():
    out = subprocess.run([sys.executable, "-m", "ronde.bench._membw", "--mib", "8",
                          "--repeats", "4"], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    ops = {p["op"] for p in _json_lines(out.stdout) + _json_lines(out.stderr)}
    assert {"copy", "add"} <= ops
    assert "process_vm_readv" in out.stdout  # the page-size table (Linux)
    assert "process_vm_writev" in out.stdout


@pytest.mark.timeout(120)
def test_torch_fusion_runs_through_ronderun():
    pytest.importorskip("torch")
    import os

    ronderun = os.path.join(os.path.dirname(sys.executable), "ronderun")
    out = subprocess.run([ronderun, "-np", "2", sys.executable, "-m", "ronde.bench.torch_fusion",
                          "--iters", "2"], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line.split(":", 1)[1] for line in out.stdout.splitlines() if '"torch_fusion"' in line]
    point = json.loads(lines[0])
    assert point["tensors"] == 161 and point["single_ms"] > 0 and point["tensors_ms"] > 0


@pytest.mark.timeout(120)
def test_fusion_stages_runs_through_ronderun():
    import os

    ronderun = os.path.join(os.path.dirname(sys.executable), "ronderun")
    out = subprocess.run([ronderun, "-np", "2", sys.executable, "-m",
                          "ronde.bench.fusion_stages", "--iters", "2", "--warmup", "1"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    points = [json.loads(line.split(":", 1)[1]) for line in out.stdout.splitlines()
              if '"fusion_stages"' in line]
    assert sorted((p["fusion_stages"], p["rank"]) for p in points) == [
        ("single", 0), ("single", 1), ("tensors", 0), ("tensors", 1), ("views", 0), ("views", 1)]
    for p in points:
        ms = p["ms_per_op"]
        assert ms["total"] >= ms["submit"] > 0 and ms["wait"] > 0
        if p["tensors"] == 161:  # the 161 calls go through a negotiation round
            assert "round.build" in ms and "execute" in ms


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["host", "device"])
def test_cuda_benchmark_runs_on_cpu_tensors(path):
    # the GPU benchmark's measurement, on CPU tensors: ronde's host path against a Gloo
    # group of its own, or its device path (RONDE_TORCH_DEVICE_PATH=always) against the
    # torch.distributed group it reduces through
    pytest.importorskip("torch")
    import os

    ronderun = os.path.join(os.path.dirname(sys.executable), "ronderun")
    env = dict(os.environ, RONDE_TORCH_DEVICE_PATH="always" if path == "device" else "auto")
    out = subprocess.run([ronderun, "-np", "2", sys.executable, "-m", "ronde.bench.cuda",
                          "--device", "cpu", "--sizes", "4B,64KiB", "--iters", "2",
                          "--warmup", "1"], capture_output=True, text=True, timeout=110, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line.split(":", 1)[1]) for line in out.stdout.splitlines()
            if line.split(":", 1)[-1].startswith("{")]
    assert [r["case"] for r in rows] == ["allreduce 4 B", "allreduce 65536 B",
                                         "fusion 161 tensors"]
    assert {r["ronde_path"] for r in rows} == {"host" if path == "host" else "gloo"}
    assert all(r["ronde_us"] > 0 and r["peer_us"] > 0 for r in rows)


@pytest.mark.timeout(180)
def test_recommend_runs_the_search_and_compares(tmp_path):
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps([[64, 3, 3, 3], 64, [1000, 512], 1000]))
    out = subprocess.run(
        [sys.executable, "-m", "ronde.bench", "recommend", "--np", "2", "--sizes", str(sizes),
         "--compute-ms", "2", "--steps-per-sample", "2", "--max-samples", "4", "--steps", "3",
         "--rounds", "1"], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    (point,) = _json_lines(out.stdout)
    assert point["case"] == "recommend" and point["configured_step_ms"] > 0
    assert set(point["values"]) == {"RONDE_FUSION_THRESHOLD", "RONDE_CYCLE_TIME",
                                    "RONDE_INLINE_BYTES", "RONDE_SPIN_TIME"}
    assert "recommendation:" in out.stdout


def test_control_case_measures_each_side_of_a_round(capsys):
    from ronde.bench import control

    assert control.main(["--np", "4,64", "--tensors", "8", "--repeats", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 ")]
    work, path = rows  # the Python work of each side; rank 0's round and the model
    assert len(work.split("|")) == 12 and len(path.split("|")) == 10
    assert path.split("|")[2:4] == [" 126 ", " 12 "]  # frames at rank 0: star, tree


@pytest.mark.timeout(240)
def test_training_throughput_reports_samples_and_extra_cpu_for_every_contender():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-m", "ronde.bench", "train", "--np", "2",
                          "--models", "cnn", "--steps", "2", "--warmup", "1",
                          "--batch", "4"], capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stderr[-2000:]
    points = {p["contender"]: p for p in _json_lines(out.stdout)}
    assert set(points) == {"single", "ronde", "ddp"}, out.stdout
    assert all(p["samples_per_s"] > 0 and p["cpu_ms_per_step"] > 0 for p in points.values())
    row = [line for line in out.stdout.splitlines() if line.startswith("| cnn | 2 |")]
    assert len(row) == 1 and row[0].count("|") == 23, out.stdout
    assert points["ronde"]["rounds_per_step"] > 0  # a count of the timed steps' rounds
    # ronde's own threads' CPU, a part of its process's
    assert 0 < points["ronde"]["engine_threads_cpu_ms_per_step"] \
        < points["ronde"]["cpu_ms_per_step"], out.stdout
    # the paired extra CPU was measured in every contender (a figure, not a NaN)
    assert all(p["paired_extra_cpu_ms_per_step"] == p["paired_extra_cpu_ms_per_step"]
               for p in points.values()), out.stdout
    # the GIL probe ran in every contender (issue #34 item 3's measure)
    assert all(p["gil_wait_ms_per_step"] >= 0 for p in points.values()), out.stdout


@pytest.mark.timeout(180)
def test_memory_case_measures_the_sharded_optimizer_against_its_formula():
    out = subprocess.run([sys.executable, "-m", "ronde.bench", "memory", "--np", "2",
                          "--contenders", "distributed,stage2", "--steps", "1", "--warmup",
                          "2"], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    points = {p["contender"]: p for p in _json_lines(out.stdout)}
    assert set(points) == {"distributed", "stage2"}, out.stdout
    params = points["stage2"]["params"]
    # fp32 Adam: 8 bytes of state a parameter, half of it per rank at np=2 (counts, not times)
    assert abs(points["distributed"]["state_bytes"] - 8 * params) <= 0.02 * 8 * params
    assert abs(points["stage2"]["state_bytes"] - 4 * params) <= 0.02 * 4 * params
    # the inner optimizer's temporaries: two of the largest tensor it steps on, a
    # parameter (1024 x 2304, 4 bytes an element) whole; sharded, a piece of one (a
    # bucket's half may hold a whole parameter)
    assert points["distributed"]["temp_bytes"] == 2 * 4 * 1024 * 2304
    assert 0 < points["stage2"]["temp_bytes"] <= points["distributed"]["temp_bytes"]
    assert "| stage2 | 2 |" in out.stdout and "within bound" in out.stdout


def test_steady_malloc_reaches_every_contender_and_keeps_the_users_tunables(monkeypatch):
    from ronde.bench import train

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert train._worker_env("default") == {"OMP_NUM_THREADS": "1"}
    assert train._worker_env("steady")["GLIBC_TUNABLES"] == train.STEADY_MALLOC
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
    assert train._worker_env("steady")["GLIBC_TUNABLES"] == \
        "glibc.pthread.rseq=0:" + train.STEADY_MALLOC
