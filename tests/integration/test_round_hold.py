"""Holding a round back between ranks of one host (core/holding.py: the mailboxes'
``WANT`` word), with real processes. The hold is set to a minute: a round held that
should have started shows as a timeout, never as a slower pass (the crossed-collective
check, whose "only waiting" report would end it after 5 s, is off). The coordinator's hold
is tested with threads as ranks in tests/core/test_holding.py."""

from __future__ import annotations

import pytest

from ronde.testing import run_ranks

from . import workers

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_arriving_apart_agree_each_step_in_one_round(np_):
    env = {"RONDE_SHM_CONTROL": "1", "RONDE_ROUND_HOLD": "60000", "RONDE_TRANSPORT": "shm",
           "RONDE_DEADLOCK_TIME": "0"}
    got = run_ranks(np_, workers.held_rounds, 10, timeout_s=90, env=env)
    # each step one round; each completion scenario two: "x" with the early ranks' "g",
    # then the late rank's "g", which completes it and so is not held
    assert got == [(True, 10, 2 * np_)] * np_, got


def test_without_the_hold_every_early_rank_starts_a_round():
    # RONDE_ROUND_HOLD=0, Horovod's way: what the hold saves (the test above can fail)
    env = {"RONDE_SHM_CONTROL": "1", "RONDE_ROUND_HOLD": "0", "RONDE_TRANSPORT": "shm"}
    got = run_ranks(3, workers.held_rounds, 10, timeout_s=90, env=env)
    assert all(m for m, _, _ in got) and got[0][1] > 10, got
