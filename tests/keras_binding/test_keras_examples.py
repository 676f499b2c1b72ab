"""The TF and Keras examples at np=2 through ronderun reach their stated accuracy."""

from __future__ import annotations

import importlib.util
import os

import pytest

from ronde.testing.installed import skip_unless_installed

skip_unless_installed("keras", "sklearn")  # without importing them (ronde.testing.installed)

from ronde.testing import rank0_metric, run_script  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script: str, *args: str, backend: str = "tensorflow") -> str:
    return run_script(2, os.path.join(ROOT, "examples", script), *args, timeout_s=150,
                      env={"KERAS_BACKEND": backend, "CUDA_VISIBLE_DEVICES": ""})


def _accuracy(stdout: str) -> float:
    return rank0_metric(stdout, "test accuracy")


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
