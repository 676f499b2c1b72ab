"""``RayExecutor`` on a simulated multi-node Ray cluster (``ray.cluster_utils.Cluster``:
a head and more nodes, each with its own raylet and resources): ranks placed on both
nodes with the right local and cross ranks; an elastic job that grows when a node
joins and re-forms without a node that is removed, with every step's sum correct."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from ronde import RondeError  # noqa: E402
from ronde.ray import RayExecutor  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.ray]


@pytest.fixture(scope="module")
def cluster(ray_lock):
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2,
                                                      "include_dashboard": False})
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield c
    ray.shutdown()
    c.shutdown()


def _where():
    import ronde

    ronde.init()
    try:
        total = ronde.allreduce(np.array([float(ronde.rank())]), op=ronde.Sum, name="where")
        return (ronde.rank(), ronde.local_rank(), ronde.local_size(), ronde.cross_rank(),
                ronde.cross_size(), ray.get_runtime_context().get_node_id(), float(total[0]))
    finally:
        ronde.shutdown()


def test_ranks_on_two_nodes_get_their_local_and_cross_ranks(cluster):
    node = cluster.add_node(num_cpus=2)
    try:
        ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2,
                         num_workers_per_host=2)
        ex.start()
        try:
            got = ex.run(_where)
        finally:
            ex.shutdown()
    finally:
        cluster.remove_node(node)
    assert [g[0] for g in got] == [0, 1, 2, 3]
    nodes = [g[5] for g in got]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # consecutive ranks per node
    assert [(g[1], g[2], g[3], g[4]) for g in got] == [
        (0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert all(g[6] == 6.0 for g in got)


def _elastic_train(log_dir, steps):
    import ronde
    from ronde.elastic import ObjectState, run

    ronde.init()
    state = ObjectState(step=0, sizes=[])

    @run
    def train(state):
        while state.step < steps:
            total = ronde.allreduce(np.array([1.0]), op=ronde.Sum, name="count")
            assert total[0] == ronde.size(), (total, ronde.size())
            state.sizes.append(ronde.size())
            state.step += 1
            with open(os.path.join(log_dir, f"{os.getpid()}.log"), "a") as f:
                f.write(f"{state.step} {ronde.size()}\n")
            time.sleep(0.05)
            state.commit()
        return ronde.rank(), ronde.size(), state.step, state.sizes

    return train(state)


def _sizes_seen(log_dir):
    seen = []
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            seen += [int(line.split()[1]) for line in f if line.strip()]
    return seen


def _wait_for(cond, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return False


def test_elastic_job_grows_with_a_new_node_and_survives_a_removed_one(cluster, tmp_path):
    extra = cluster.add_node(num_cpus=1)  # head 2 CPUs + 1: the job starts with 3
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=2, max_workers=4,
                     elastic_timeout=60)
    ex.start()
    out = {}

    def run():  # Ray's node handling wants the main thread: the job runs in this one
        try:
            out["results"] = ex.run(_elastic_train, args=(str(tmp_path), 150))
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    changes = {}
    if _wait_for(lambda: 3 in _sizes_seen(str(tmp_path)), 90):
        cluster.remove_node(extra)  # its worker dies: the job re-forms with 2
        changes["removed"] = extra
        if _wait_for(lambda: 2 in _sizes_seen(str(tmp_path)), 60):
            changes["added"] = cluster.add_node(num_cpus=2)  # found: 2 -> 4 (max_workers)
    t.join(timeout=150)
    if "added" in changes:
        cluster.remove_node(changes["added"])
    if "error" in out:
        raise out["error"]
    results = out["results"]
    assert set(changes) == {"removed", "added"}
    assert [r[0] for r in results] == list(range(len(results)))
    assert len(results) == 4 and all(r[1] == 4 and r[2] == 150 for r in results)
    sizes = results[0][3]  # the committed history, synced from rank 0 at each reset
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 4
    assert len(sizes) == 150  # every step counted once: the lost one was redone


def _fails_on_one_worker(log_dir):
    import ronde
    from ronde.elastic import ObjectState, run

    ronde.init()

    @run
    def train(state):
        while state.step < 5:
            ronde.allreduce(np.array([1.0]), name="n")
            state.step += 1
            state.commit()
        raise ValueError(f"user bug on rank {ronde.rank()}")

    return train(ObjectState(step=0))


def test_elastic_job_whose_every_worker_raises_names_the_error(cluster, tmp_path):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2,
                     elastic_timeout=5)
    t0 = time.monotonic()
    with pytest.raises(RondeError, match="RayExecutor \\(elastic\\).*user bug on rank"):
        ex.run(_fails_on_one_worker, args=(str(tmp_path),))
    assert time.monotonic() - t0 < 60


def _elastic_ranks():
    import ronde
    from ronde.elastic import ObjectState, run

    ronde.init()

    @run
    def train(state):
        total = ronde.allreduce(np.array([1.0]), op=ronde.Sum, name="n")
        return ronde.rank(), ronde.size(), float(total[0])

    return train(ObjectState())


def test_horovods_older_elastic_ray_executor_runs_a_worker_function(cluster):
    from ronde.ray import ElasticRayExecutor

    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=2,
                                                  timeout_s=30)
    ex = ElasticRayExecutor(settings, cpus_per_slot=1)
    ex.start()
    assert ex.run(_elastic_ranks) == [(0, 2, 2.0), (1, 2, 2.0)]
    ex.shutdown()
