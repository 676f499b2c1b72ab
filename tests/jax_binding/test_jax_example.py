"""examples/jax_mnist.py at np=2 through ronderun reaches its stated accuracy."""

from __future__ import annotations

import os

import pytest

from ronde.testing.installed import skip_unless_installed

skip_unless_installed("jax", "optax", "sklearn")  # without importing them (ronde.testing.installed)

from ronde.testing import rank0_metric, run_script  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_jax_digits_example_trains_at_np2(tmp_path):
    ckpt = tmp_path / "ckpt.pkl"
    out = run_script(2, os.path.join(ROOT, "examples", "jax_mnist.py"),
                     "--checkpoint", str(ckpt))
    assert "(2 ranks" in out
    assert rank0_metric(out, "test accuracy") >= 0.97
    import pickle

    with open(ckpt, "rb") as fh:  # hvd.save_checkpoint: the pytree as numpy arrays
        saved = pickle.load(fh)
    assert saved["epoch"] == 15 and saved["params"]["fc1"]["w"].shape == (64, 128)
    assert os.listdir(tmp_path) == ["ckpt.pkl"]  # no temporary left
