"""The TF and Keras examples at np=2 through ronderun reach their stated accuracy."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("keras")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script: str, *args: str, backend: str = "tensorflow") -> str:
    env = dict(os.environ, KERAS_BACKEND=backend, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "ronde.run", "-np", "2", sys.executable,
                           os.path.join(ROOT, "examples", script), *args],
                          capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _accuracy(stdout: str) -> float:
    m = re.search(r"\[0\]<stdout>:.*test accuracy ([0-9.]+)", stdout)
    assert m, stdout[-2000:]
    assert "[1]<stdout>:" not in "".join(l for l in stdout.splitlines() if "accuracy" in l)
    return float(m.group(1))


@pytest.mark.timeout(160)
def test_tensorflow2_gradient_tape_example():
    pytest.importorskip("tensorflow")
    assert _accuracy(_run("tensorflow2_mnist.py")) >= 0.93


@pytest.mark.timeout(160)
def test_keras_fit_example_with_callbacks_and_rank0_checkpoint(tmp_path):
    pytest.importorskip("tensorflow")
    ckpt = tmp_path / "best.keras"
    assert _accuracy(_run("keras_mnist.py", "--checkpoint", str(ckpt))) >= 0.93
    assert ckpt.exists()


@pytest.mark.timeout(160)
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_multibackend_example(backend):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    out = _run("keras3_multibackend.py", backend=backend)
    assert f"backend {backend} ranks 2 weights identical True" in out, out[-2000:]
    assert _accuracy(out) >= 0.90
