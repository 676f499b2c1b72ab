"""A ShardedOptimizer's whole state_dict() (issue #52: Lightning's and Hugging Face
Trainer's own checkpoints of a sharded optimizer): refused on one rank alone with the
fix, gathered by consolidate_state_dict() into one process's Adam state, saved at three
ranks and resumed at two as one process on the global batches. Real processes through
ronde's launcher (ronde.testing.run_ranks)."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch")

from ronde.testing import run_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sharded_state_workers as workers  # noqa: E402


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [1, 2])
def test_the_whole_state_dict_saves_at_three_ranks_and_resumes_at_two(tmp_path, stage):
    path = str(tmp_path / "optimizer.pt")
    saved = run_ranks(3, workers.whole_state, path, "save", stage, timeout_s=70)
    for rank, res in enumerate(saved):
        assert res["empty"] and res["same"] and res["diff"] <= 1e-12, (rank, res)
        assert res["unconsolidated"].startswith("RondeError") \
            and "consolidate_state_dict()" in res["unconsolidated"], res["unconsolidated"]
        assert res["reloaded"] and res["lr_reloaded"] == 0.01, (rank, res)
        if rank:
            assert res["not_root"].startswith("RondeError"), res["not_root"]
    root = saved[0]
    assert root["keys"] and root["state_diff"] <= 1e-12, root
    assert root["bad_shape"].startswith("RondeError") and "'a.weight'" in root["bad_shape"] \
        and "(2, 2)" in root["bad_shape"], root["bad_shape"]
    assert root["bad_groups"].startswith("RondeError") \
        and "one rank's part" in root["bad_groups"], root["bad_groups"]
    resumed = run_ranks(2, workers.whole_state, path, "resume", stage, timeout_s=70)
    for rank, res in enumerate(resumed):
        assert res["empty"] and res["lr_loaded"] == 0.01, (rank, res)
        assert res["same"] and res["diff"] <= 1e-12, (rank, res)
