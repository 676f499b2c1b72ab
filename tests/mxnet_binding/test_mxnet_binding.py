"""ronde.mxnet: collectives, DistributedTrainer/DistributedOptimizer equivalence, misuse.

Runs in the MXNet venv (scripts/mxnet_tests.sh); skipped where mxnet is absent.
tests/mxnet_binding has no __init__.py and is not called ``mxnet`` (it would shadow it).
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("mxnet")

from ronde.testing import run_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mxnet_workers as workers  # noqa: E402

#: (optimizer, DistributedTrainer or DistributedOptimizer, compression) -> tolerance
CONFIGS = {
    ("sgd", "trainer", "none"): 1e-12,
    ("adam", "trainer", "none"): 1e-12,
    ("sgd", "optimizer", "none"): 1e-12,
    ("adam", "optimizer", "none"): 1e-12,
    ("sgd", "trainer", "fp16"): 1e-3,
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [1, 3])
def test_collectives_on_ndarrays(np_):
    assert run_ranks(np_, workers.collectives, timeout_s=80) == ["ok"] * np_


@pytest.mark.timeout(120)
def test_np2_batch_b_equals_one_process_batch_2b():
    configs = list(CONFIGS)
    for diffs in run_ranks(2, workers.equivalence, configs, timeout_s=110):
        for cfg, diff in zip(configs, diffs):
            assert diff <= CONFIGS[cfg], (cfg, diff)


@pytest.mark.timeout(60)
def test_deferred_parameters_are_broadcast_after_initialisation():
    assert run_ranks(2, workers.deferred_broadcast, timeout_s=50) == [0.0, 0.0]


@pytest.mark.timeout(60)
def test_differing_parameters_fail_every_rank_at_the_first_step():
    for msg, _elapsed in run_ranks(2, workers.mismatch, timeout_s=50):
        assert "exists on rank 1 but not on rank 0" in msg, msg
        assert "build the same model on every rank" in msg
