"""examples/mxnet_mnist.py at np=2 through ronderun reaches its stated accuracy."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("mxnet")
pytest.importorskip("sklearn")

from ronde.testing import rank0_metric, run_script  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_mxnet_digits_example_trains_at_np2(tmp_path):
    ckpt = tmp_path / "net.params"
    out = run_script(2, os.path.join(ROOT, "examples", "mxnet_mnist.py"),
                     "--checkpoint", str(ckpt))
    assert "(2 ranks" in out
    assert rank0_metric(out, "test accuracy") >= 0.95
    assert ckpt.stat().st_size > 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tmp-ckpt-")]
