"""The steady lane (core/lane.py) with real processes on the shm transport: gradient
buckets skip negotiation once agreed twice, every rank checks the others brought the
same one, and any difference sends them back to the general path on every rank, which
fails or proceeds exactly as it would have. One launch runs every scenario (each starts
and stops ronde: a broken lane stays broken for its engine); the lane-workers docstring
says what each does."""

from __future__ import annotations

import pytest

from ronde.testing import run_ranks_many

from . import lane_workers as w

pytestmark = pytest.mark.timeout(200)

ENV = {"RONDE_TRANSPORT": "shm"}


@pytest.mark.parametrize("np_", [2, 3])
def test_buckets_skip_the_round_and_fall_back_on_every_rank_alike(np_):
    steady, swapped, changed, interleaved, joined, late, resident = run_ranks_many(
        np_, [w.steady, w.swapped, w.changed_shape, w.interleaved, w.joined, w.late,
              w.resident], timeout_s=180, env=ENV)
    for res in resident:  # 5 steps of 2 buckets laned, all but two reduced in place
        assert res == {"exact": True, "laned": 10, "resident": 8, "breaks": 0}, resident
    for res in steady:  # 6 steps of 2 buckets through the lane, no negotiation rounds
        # (a periodic check, under load, may start a round of its own: not one a step)
        assert res["laned"] == 12 and res["breaks"] == 0 and res["rounds"] <= 2, steady
    for res in swapped:  # broken at the first swapped meeting, values exact (the worker);
        # agreed again in a new epoch: the last two steps' buckets went through the lane
        assert res == {"breaks": 1, "laned": 4, "epoch": 1}, swapped
    for res in changed:  # the general path's error, on every rank, for that bucket only
        assert len(res["errors"]) == 1 and res["breaks"] == 1, changed
        assert "m.bucket0.3" in res["errors"][0] and "shape" in res["errors"][0], changed
    for res in interleaved:  # the other collective in another order: no wait, no break
        assert res == {"laned": 6, "breaks": 0}, interleaved
    want = (np_ - 1) * (np_ - 2) / 2 + 3 * (np_ - 1)  # the joined rank adds nothing
    for r, res in enumerate(joined):
        assert res["broken"] and res["breaks"] == 1, joined
        assert res["got"] == (None if r == np_ - 1 else [want, want]), joined
        assert res["laned"] == 2 and res["epoch"] == 1, joined
    for res in late:  # waited for at the meeting: still the lane
        assert res == {"laned": 4, "breaks": 0}, late


def test_a_timeline_shows_the_lanes_steps(tmp_path):
    # the lane once recorded nothing: every figure of the summary read 0
    got = run_ranks_many(2, [(w.timeline, str(tmp_path / "tl.{rank}.json"))], timeout_s=60,
                         env=ENV)[0]
    for res in got:
        assert res["laned"] == 8 and res["comm_p50_positive"], got
        assert ("NEGOTIATE", True) in res["phases"] and ("QUEUE", False) in res["phases"] \
            and ("ALLREDUCE", False) in res["phases"], got


@pytest.mark.parametrize("env", [{"RONDE_STEADY_LANE": "0", "RONDE_TRANSPORT": "shm"},
                                 {"RONDE_TRANSPORT": "tcp"}])
def test_without_the_knob_or_shared_memory_buckets_are_negotiated(env):
    assert run_ranks_many(2, [w.lane_state], timeout_s=60, env=env) == \
        [[{"enabled": False, "laned": 0, "table": 0}] * 2]
