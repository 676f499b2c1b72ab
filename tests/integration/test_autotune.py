"""Autotune on 2 real ranks: rank 0 tunes, both apply the same values at the same
negotiation round, every result exact throughout."""

from __future__ import annotations

import pytest

from ronde.testing import run_ranks

from . import workers


@pytest.mark.timeout(120)
def test_two_ranks_apply_the_same_values_at_the_same_round():
    env = {"RONDE_AUTOTUNE": "1", "RONDE_AUTOTUNE_WARMUP_SAMPLES": "1",
           "RONDE_AUTOTUNE_STEPS_PER_SAMPLE": "3", "RONDE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "5"}
    results = run_ranks(2, workers.autotuned_training, 90, timeout_s=100, env=env)
    (h0, final0, verdict0), (h1, final1, verdict1) = results
    assert verdict0 == (True, 5 + 4) and verdict1 is None  # rank 0 tunes, alone
    assert h0 == h1 and len(h0) >= 5, (h0, h1)
    assert final0 == final1
    assert tuple(h0[-1][1])[0] == final0[0]
