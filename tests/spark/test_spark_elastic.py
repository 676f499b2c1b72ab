"""``ronde.spark.run_elastic`` on a real ``local[2]`` Spark: a plain function (Horovod's
``test_happy_run_elastic``), a rank that raises once is replaced and the job goes on
from its last commit, a rank that always raises ends the job naming its error."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark")
if shutil.which("java") is None:
    pytest.skip("Spark needs Java (apt-get install openjdk-17-jre-headless)",
                allow_module_level=True)

import ronde.spark  # noqa: E402
from ronde import RondeError  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.spark]


def _gather_ranks():
    import ronde

    ronde.init()
    got = ronde.allgather(np.array([ronde.rank()]), name="ranks")
    return got.tolist(), ronde.rank(), ronde.local_rank(), ronde.local_size()


def test_a_plain_function_runs_on_every_slot():
    got = ronde.spark.run_elastic(_gather_ranks, num_proc=2, min_num_proc=2, max_num_proc=2,
                                  start_timeout=30)
    # both tasks on this machine (RONDE_NODE): local ranks 0 and 1 of 2
    assert got == [([0, 1], 0, 0, 2), ([0, 1], 1, 1, 2)]


def _train(marker, steps):
    import ronde
    from ronde.elastic import ObjectState, run

    ronde.init()

    @run
    def train(state):
        while state.step < steps:
            total = ronde.allreduce(np.array([1.0]), op=ronde.Sum, name="count")
            state.total += float(total[0])
            state.step += 1
            if state.step == 5 and ronde.rank() == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                raise ValueError("a one-off failure on rank 1")
            state.commit()
        return ronde.rank(), ronde.size(), state.step, state.total

    return train(ObjectState(step=0, total=0.0))


def test_a_rank_that_raises_once_is_replaced_and_the_job_goes_on(tmp_path):
    marker = str(tmp_path / "failed-once")
    got = ronde.spark.run_elastic(_train, args=(marker, 20), num_proc=2, min_num_proc=2,
                                  max_num_proc=2, start_timeout=30, elastic_timeout=60)
    assert os.path.exists(marker)
    assert [g[:3] for g in got] == [(0, 2, 20), (1, 2, 20)]
    assert all(g[3] == 40.0 for g in got)  # step 5 rolled back and redone: no double count


def _always_raises():
    import ronde
    from ronde.elastic import ObjectState, run

    ronde.init()

    @run
    def train(state):
        ronde.allreduce(np.array([1.0]), name="n")
        raise ValueError(f"user bug on rank {ronde.rank()}")

    return train(ObjectState())


def test_a_rank_that_always_raises_ends_the_job_with_its_error():
    t0 = time.monotonic()
    with pytest.raises(RondeError, match="(?s)run_elastic.*ValueError: user bug on rank"):
        ronde.spark.run_elastic(_always_raises, num_proc=2, min_num_proc=2, elastic_timeout=5)
    assert time.monotonic() - t0 < 120
