"""The numpy digits example at np=2 through ronderun."""

from __future__ import annotations

import os

import pytest

from ronde.testing import rank0_metric, run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_digits_example_trains_at_np2(tmp_path):
    pytest.importorskip("sklearn")
    out = run_script(2, os.path.join(ROOT, "examples", "numpy_digits.py"), "--epochs", "15",
                     "--checkpoint", str(tmp_path / "ckpt.npz"))
    assert rank0_metric(out, "test accuracy") > 0.9
    assert (tmp_path / "ckpt.npz").exists()
