"""Stall inspector: a collective that some ranks never submit ends in a StallError."""

from __future__ import annotations

import pytest

from ronde.testing import run_ranks

from . import workers


@pytest.mark.timeout(60)
def test_stall_names_tensor_ranks_and_what_the_missing_rank_does():
    out = run_ranks(2, workers.stall, timeout_s=50,
                    env={"RONDE_STALL_CHECK_TIME": "1", "RONDE_STALL_SHUTDOWN_TIME": "3"})
    assert out == ["stalled", "late"]
