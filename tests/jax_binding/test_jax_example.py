"""examples/jax_mnist.py at np=2 through ronderun reaches its stated accuracy."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_jax_digits_example_trains_at_np2(tmp_path):
    ckpt = tmp_path / "ckpt.npz"
    proc = subprocess.run(
        [sys.executable, "-m", "ronde.run", "-np", "2", sys.executable,
         os.path.join(ROOT, "examples", "jax_mnist.py"), "--checkpoint", str(ckpt)],
        capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"\[0\]<stdout>:test accuracy ([0-9.]+) \(2 ranks", proc.stdout)
    assert m and float(m.group(1)) >= 0.97, proc.stdout
    assert "[1]<stdout>:test accuracy" not in proc.stdout  # only rank 0 reports
    import numpy as np

    with np.load(ckpt) as saved:
        assert int(saved["epoch"]) == 15 and saved["fc1.w"].shape == (64, 128)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tmp-ckpt-")]
