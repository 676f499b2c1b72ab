"""examples/pytorch_mnist.py at np=2 through ronderun reaches its stated accuracy."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from ronde.testing import rank0_metric, run_script  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_pytorch_digits_example_trains_at_np2(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    out = run_script(2, os.path.join(ROOT, "examples", "pytorch_mnist.py"),
                     "--checkpoint", str(ckpt))
    assert rank0_metric(out, "test accuracy") >= 0.95
    import torch

    state = torch.load(ckpt)
    assert state["epoch"] == 10 and "fc2.weight" in state["model"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tmp-ckpt-")]
