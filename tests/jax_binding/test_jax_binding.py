"""ronde.jax: collectives eager and under jit, gradients, optax equivalence, misuse.

tests/jax_binding has no __init__.py and is not called ``jax``: a package of that
name on sys.path would shadow the real jax.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from ronde.testing import run_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax_workers as workers  # noqa: E402

#: (optimizer, backward_passes_per_step, compression, jit) -> tolerance (float64 params)
CONFIGS = {
    ("sgd", 1, "none", True): 1e-12,
    ("adam", 1, "none", True): 1e-12,
    ("sgd", 2, "none", True): 1e-12,
    ("adam", 2, "none", False): 1e-12,
    ("sgd", 1, "fp16", True): 1e-3,
    ("adam", 1, "bf16", True): 2e-3,
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [1, 3])
def test_collectives_eager_and_under_jit(np_):
    assert run_ranks(np_, workers.collectives, timeout_s=80) == ["ok"] * np_


@pytest.mark.timeout(90)
def test_gradients_flow_through_collectives():
    assert run_ranks(2, workers.gradients, timeout_s=80) == ["ok", "ok"]


@pytest.mark.timeout(120)
def test_np2_batch_b_equals_one_process_batch_2b():
    configs = list(CONFIGS)
    per_rank = run_ranks(2, workers.equivalence, configs, timeout_s=110)
    for diffs in per_rank:
        for cfg, diff in zip(configs, diffs):
            assert diff <= CONFIGS[cfg], (cfg, diff)


@pytest.mark.timeout(60)
def test_differing_parameters_fail_every_rank_at_init():
    for msg, _elapsed in run_ranks(2, workers.mismatch, timeout_s=50):
        assert "['extra']['w']" in msg and "exists on rank 1 but not on rank 0" in msg, msg
        assert "same structure, shapes and dtypes" in msg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_sharded_optimizer_equals_one_process_with_a_share_of_the_state(np_):
    out = run_ranks(np_, workers.sharded, timeout_s=110)
    params = 6 * 8 + 8 + 8 * 3 + 3  # 83
    for res in out:
        assert list(res) == ["sgd.jit", "adam", "adamw.jit", "adam.jit.x2"]
        for case, r in res.items():
            assert r["diff"] <= 1e-12, (case, r)
            per_rank = -(-params // np_)  # elements of this rank's slice
            moments = 1 if case.startswith("sgd") else 2  # momentum; adam's mu and nu
            assert r["held"] == moments * per_rank, (case, r)
