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


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_equals_one_process_and_callbacks(backend):
    out = run_ranks(2, workers.fit_equivalence, timeout_s=140,
                    env={"KERAS_BACKEND": backend, "CUDA_VISIBLE_DEVICES": ""})
    for res in out:
        assert res["backend"] == backend
        assert res["diff1"] < 1e-5, res      # batch 8 per rank == batch 16
        assert res["diff2"] < 1e-5, res      # 2 passes of 8 per rank == batch 32
        assert res["metric1"] < 1e-6 and res["metric2"] < 1e-6, res
        assert res["warmup"] < 1e-6, res


@pytest.mark.timeout(120)
def test_load_model_rewraps_the_optimizer(tmp_path):
    backend = BACKENDS[0] if BACKENDS else pytest.skip("no Keras backend installed")
    assert run_ranks(2, workers.load_model_roundtrip, str(tmp_path / "m.keras"),
                     timeout_s=110, env={"KERAS_BACKEND": backend}) == ["ok", "ok"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_adasum_delta_optimizer(backend):
    out = run_ranks(2, workers.adasum_delta, timeout_s=140,
                    env={"KERAS_BACKEND": backend, "CUDA_VISIBLE_DEVICES": ""})
    for res in out:
        assert res["backend"] == backend
        assert res["apply_err"] < 1e-5, res   # the reference tree of the deltas
        assert res["fit_spread"] < 1e-6, res  # every rank holds the same weights
        assert res["moved"] > 1e-4, res       # and they did train
