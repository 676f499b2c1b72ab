"""Threads as ranks (``ronde.testing.threads.run_threads``): each thread its own runtime
and real engine, joined by socket pairs; no process starts."""

from __future__ import annotations

import numpy as np
import pytest

import ronde
from ronde import RondeError
from ronde.process_sets import global_process_set
from ronde.testing.threads import run_threads

pytestmark = pytest.mark.timeout(60)


def _collectives() -> dict:
    ronde.init()  # the harness made this thread's runtime: a no-op here
    r, n = ronde.rank(), ronde.size()
    out = {"rank": r, "size": n, "ps": (global_process_set.rank(),
                                        global_process_set.included())}
    out["sum"] = ronde.allreduce(np.full(3, r + 1.0), op=ronde.Sum).tolist()
    out["gather"] = ronde.allgather(np.array([r, r])).tolist()
    out["bcast"] = ronde.broadcast(np.array([r * 10.0]), root_rank=1).tolist()
    out["objects"] = ronde.allgather_object({"r": r})
    # unnamed collectives count per rank's runtime, so every rank's i-th has one name
    out["unnamed"] = [float(ronde.allreduce(np.array([float(i + r)]), op=ronde.Sum)[0])
                      for i in range(5)]
    ronde.shutdown()  # a no-op as well: the harness stops the engines
    return out


def test_each_thread_is_a_rank_with_its_own_runtime():
    out = run_threads(3, _collectives)
    for r, res in enumerate(out):
        assert res["rank"] == r and res["size"] == 3 and res["ps"] == (r, True)
        assert res["sum"] == [6.0, 6.0, 6.0]
        assert res["gather"] == [0, 0, 1, 1, 2, 2]
        assert res["bcast"] == [10.0]
        assert res["objects"] == [{"r": 0}, {"r": 1}, {"r": 2}]
        assert res["unnamed"] == [3.0 * i + 3 for i in range(5)]
    assert ronde.is_initialized() is False  # nothing left behind in the process


def _one_raises() -> str:
    if ronde.rank() == 1:
        raise ValueError("rank one's own error")
    ronde.allreduce(np.ones(2), name="never.complete")
    return "finished"


def test_a_rank_that_raises_fails_the_run_naming_it_and_the_others_do_not_hang():
    with pytest.raises(RondeError) as info:
        run_threads(2, _one_raises, timeout_s=30)
    text = str(info.value)
    assert "rank 1 raised" in text and "rank one's own error" in text
    assert "rank 0 raised" in text  # its allreduce failed instead of waiting forever


def test_torch_binding_scenarios_run_as_threads():
    pytest.importorskip("torch")
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "torch"))
    import torch_workers as workers

    # SyncBatchNorm with uneven batches equals BatchNorm on the concatenation; the
    # broadcasts of parameters and optimizer state; misuse errors and synchronize()
    # patterns (moved here from test_torch_optimizer's two-rank launch: these scenarios
    # draw from their own torch.Generator, and the global RNG is one per process, not
    # one per rank, so a scenario that seeds it cannot run as threads)
    assert max(run_threads(2, workers.syncbn_uneven, timeout_s=50)) < 1e-12
    assert run_threads(2, workers.broadcast_state, timeout_s=50) == ["ok", "ok"]
    assert run_threads(2, workers.local_misuse, timeout_s=50) == ["ok", "ok"]
