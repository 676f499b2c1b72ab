"""Horovod's torch semantics, as its own test suite relies on them (real processes, and
threads as ranks at np=2).

Horovod's ``test/parallel/test_torch.py`` is the specification; these tests check the
same facts in ronde's own way (docs/compat.md lists where ronde differs on purpose).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from ronde.testing import run_ranks  # noqa: E402
from ronde.testing.threads import run_threads  # noqa: E402

from . import cases, torch_workers as workers  # noqa: E402

CASES = [workers.scaling_arithmetic, workers.join_average,
         workers.grouped_allgather_and_reducescatter, workers.gradients,
         workers.errors_and_handles, workers.optimizer_attributes_and_process_sets,
         workers.optimizer_state_and_sparse]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_,as_threads", [(2, True), (3, False)])
def test_horovod_torch_semantics(np_, as_threads):
    # every case in one launch per size (cases.run_all): a failing case shows its own
    # traceback, the others still run. At np=2 the ranks are threads of this process
    # (ronde.testing.threads: an engine each, no process to start, 1 s instead of 15);
    # at np=3 real processes over shared memory
    names = [case.__name__ for case in CASES]
    if as_threads:
        out = run_threads(np_, cases.run_all, workers.__name__, names, timeout_s=120)
    else:
        out = run_ranks(np_, cases.run_all, workers.__name__, names, timeout_s=180)
    for got in out:
        assert got == {name: "ok" for name in names}, got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_crossed_collectives_fail_on_every_rank_and_the_job_goes_on(np_):
    assert run_ranks(np_, workers.crossed_collectives, timeout_s=50,
                     env={"RONDE_DEADLOCK_TIME": "1"}) == ["ok"] * np_


@pytest.mark.timeout(60)
def test_a_rank_still_computing_is_not_taken_for_a_deadlock():
    assert run_ranks(2, workers.busy_rank_is_not_a_deadlock, timeout_s=50,
                     env={"RONDE_DEADLOCK_TIME": "1"}) == ["ok"] * 2
