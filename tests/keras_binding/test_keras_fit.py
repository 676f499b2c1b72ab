"""Keras 3 model.fit with ronde.keras on every backend: equivalence and callbacks (np=2)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytest.importorskip("keras")

from ronde.testing import run_ranks  # noqa: E402

# no __init__.py here on purpose: a package named like a framework would shadow it
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras_workers as workers  # noqa: E402

BACKENDS = [b for b, mod in [("tensorflow", "tensorflow"), ("jax", "jax"), ("torch", "torch")]
            if importlib.util.find_spec(mod) is not None]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_load_model_and_adasum(backend, tmp_path):
    # one launch per backend for the three scenarios (keras_workers.fit_scenarios)
    out = run_ranks(2, workers.fit_scenarios, str(tmp_path / "m.keras"), timeout_s=190,
                    env={"KERAS_BACKEND": backend, "CUDA_VISIBLE_DEVICES": ""})
    for both in out:
        res = both["fit"]  # model.fit with DistributedOptimizer; callbacks
        assert res["backend"] == backend
        assert res["diff1"] < 1e-5, res      # batch 8 per rank == batch 16
        assert res["diff2"] < 1e-5, res      # 2 passes of 8 per rank == batch 32
        assert res["metric1"] < 1e-6 and res["metric2"] < 1e-6, res
        assert res["warmup"] < 1e-6, res
        # a saved model comes back (hvd.load_model) with a DistributedOptimizer
        assert both["load"] == "ok"
        res = both["adasum"]  # DistributedOptimizer(op=Adasum)
        assert res["backend"] == backend
        assert res["apply_err"] < 1e-5, res   # the reference tree of the deltas
        assert res["fit_spread"] < 1e-6, res  # every rank holds the same weights
        assert res["moved"] > 1e-4, res       # and they did train
