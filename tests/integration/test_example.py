"""The README's main job: the numpy digits example at np=2 through ronderun."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_digits_example_trains_at_np2(tmp_path):
    pytest.importorskip("sklearn")
    proc = subprocess.run(
        [sys.executable, "-m", "ronde.run", "-np", "2", sys.executable,
         os.path.join(ROOT, "examples", "numpy_digits.py"), "--epochs", "15",
         "--checkpoint", str(tmp_path / "ckpt.npz")],
        capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"\[0\]<stdout>:test accuracy ([0-9.]+)", proc.stdout)
    assert m and float(m.group(1)) > 0.9, proc.stdout
    assert "[1]<stdout>:test accuracy" not in proc.stdout  # only rank 0 reports
    assert (tmp_path / "ckpt.npz").exists()
