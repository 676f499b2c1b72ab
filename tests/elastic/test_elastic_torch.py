"""Elastic PyTorch jobs end to end: real ronderun elastic driver, real worker processes.

Hosts are loopback addresses (127.0.0.1, .2, .3: separate hosts for ronde, no ssh).
Each job trains tests/elastic/torch_elastic_worker.py, which checks nothing itself:
rank 0 writes every epoch's processed indices, and these tests check that each epoch
used every sample exactly once, whatever happened meanwhile.
"""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

pytest.importorskip("torch")

from elastic_jobs import discovery_script
from ronde.runner.elastic import run_elastic  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.elastic]
WORKER = os.path.join(os.path.dirname(__file__), "torch_elastic_worker.py")
N = 60


def _job(tmp_path, np=None, min_np=2, max_np=None, hosts=None, discovery=None, env=None,
         reset_limit=None, timeout=150.0):
    out, err = io.StringIO(), io.StringIO()
    result_file = tmp_path / "result.json"
    variables = {"ELASTIC_OUT": str(result_file), "ELASTIC_MARK": str(tmp_path / "mark"),
                 "ELASTIC_N": str(N), "ELASTIC_HOSTS_FILE": str(tmp_path / "hosts"),
                 "RONDE_ELASTIC_POLL": "0.2", **(env or {})}
    script = discovery_script(tmp_path, discovery) if discovery is not None else None
    res = run_elastic([sys.executable, WORKER], np, min_np, max_np, hosts=hosts,
                      discovery_script=str(script) if script else None, env=variables,
                      start_timeout_s=20.0, elastic_timeout_s=30.0, reset_limit=reset_limit,
                      timeout_s=timeout, stdout=out, stderr=err)
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    return res, result, out.getvalue() + err.getvalue()


def _exactly_once(result):
    assert result is not None
    for epoch in result["epochs"]:
        assert epoch == list(range(N))  # every sample once: none repeated, none lost


def test_kill_drop_and_add_hosts_at_np_4(tmp_path):
    # The E3: -np 4 --min-np 2 --max-np 4 on localhost:2 and 127.0.0.1:2; a worker
    # of the second host is SIGKILLed at step 20 and discovery drops that host; later a
    # third host 127.0.0.2:2 appears. Every sample once per epoch, the final weights
    # bitwise equal on every rank, the learning rate following the size, a process set
    # surviving the resets.
    res, result, text = _job(
        tmp_path, np=4, min_np=2, max_np=4, discovery=["localhost:2", "127.0.0.1:2"],
        env={"ELASTIC_N": "320", "ELASTIC_EPOCHS": "3", "ELASTIC_DIE": "127.0.0.1/1:20",
             "ELASTIC_DIE_HOSTS": "localhost:2", "ELASTIC_ADD_HOST": "127.0.0.2:2",
             "ELASTIC_ADD_STEP": "34", "ELASTIC_GROW_TO": "4", "ELASTIC_STEP_SLEEP": "0.05",
             "ELASTIC_PS": "1"},
        timeout=120)
    assert res.returncode == 0, text
    assert result["epochs"] and all(e == list(range(320)) for e in result["epochs"])
    sizes = result["sizes"]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4, sizes
    assert result["weights_equal"] and result["size"] == 4
    assert result["lr"] == pytest.approx(0.01 * 4)


def test_a_preempted_worker_commits_and_leaves_as_a_removal(tmp_path):
    # SIGTERM (a preemption notice): the worker leaves at its next commit, every rank
    # re-forms there keeping the committed progress; its host is not blacklisted and its
    # exit is not a failure
    res, result, text = _job(tmp_path, np=3, min_np=2, hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                             env={"ELASTIC_TERM": "127.0.0.3/0:3"})
    assert res.returncode == 0, text
    _exactly_once(result)
    assert result["sizes"][0] == 3 and result["sizes"][-1] == 2
    assert "leaves (SIGTERM)" in text and "blacklisted" not in text and "failed" not in text


def test_survivors_go_on_without_a_worker_that_died(tmp_path):
    res, result, text = _job(tmp_path, np=3, min_np=2, hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                             env={"ELASTIC_DIE": "127.0.0.3:3"})
    assert res.returncode == 0, text
    _exactly_once(result)
    assert result["sizes"][0] == 3 and result["sizes"][-1] == 2 and result["size"] == 2
    assert result["resets"] >= 1
    assert "127.0.0.3 failed" in text and "PeerLostError" in text


def test_a_host_found_by_discovery_joins_and_gets_the_state(tmp_path):
    res, result, text = _job(tmp_path, min_np=2, discovery=["127.0.0.1", "127.0.0.2"],
                             env={"ELASTIC_ADD_HOST": "127.0.0.3", "ELASTIC_ADD_STEP": "2",
                                  "ELASTIC_GROW_TO": "3", "ELASTIC_STEP_SLEEP": "0.05"})
    assert res.returncode == 0, text
    _exactly_once(result)
    assert result["sizes"][0] == 2 and result["sizes"][-1] == 3 and result["size"] == 3
    assert "HostsUpdatedInterrupt" not in text or "resets (hosts changed)" in text


def test_two_host_changes_within_a_second_both_take_effect(tmp_path):
    # notices carry a sequence number, not a whole-second timestamp
    res, result, text = _job(tmp_path, min_np=2, discovery=["127.0.0.1", "127.0.0.2"],
                             env={"ELASTIC_ADDS": "2:127.0.0.3,3:127.0.0.4",
                                  "ELASTIC_GROW_TO": "4", "ELASTIC_STEP_SLEEP": "0.3"})
    assert res.returncode == 0, text
    _exactly_once(result)
    assert result["size"] == 4 and result["sizes"][0] == 2


def test_a_host_removed_by_discovery_leaves_cleanly(tmp_path):
    # the removed host's worker ends with code 0 at the commit where every rank sees
    # the change; rank 0 moves to the remaining host, which has the state already
    res, result, text = _job(tmp_path, min_np=1, discovery=["127.0.0.1", "127.0.0.2"],
                             env={"ELASTIC_SET_HOSTS": "2:127.0.0.2", "ELASTIC_STEP_SLEEP": "0.3"})
    assert res.returncode == 0, text
    _exactly_once(result)
    assert result["sizes"][0] == 2 and result["sizes"][-1] == 1 and result["size"] == 1
    assert "this worker ends" in text


def test_below_min_np_the_survivor_waits_and_recovers(tmp_path):
    # horovod#3494: a survivor left below --min-np must wait for the job to re-form and
    # then agree with the newcomer on syncing (a deadlock in Horovod)
    res, result, text = _job(tmp_path, min_np=2, max_np=2, discovery=["127.0.0.1", "127.0.0.2"],
                             env={"ELASTIC_DIE": "127.0.0.2:3", "ELASTIC_DIE_ADDS": "127.0.0.3"})
    assert res.returncode == 0, text
    _exactly_once(result)
    assert result["size"] == 2 and "waiting up to" in text


def test_the_reset_limit_ends_the_job(tmp_path):
    res, result, text = _job(tmp_path, np=3, min_np=1, hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                             env={"ELASTIC_DIE": "127.0.0.3:3,127.0.0.2:5"}, reset_limit=1)
    assert res.returncode != 0 and result is None
    assert "--reset-limit" in text


def test_every_host_blacklisted_ends_with_its_message(tmp_path):
    res, result, text = _job(tmp_path, np=2, min_np=2, hosts="127.0.0.1:1,127.0.0.2:1",
                             env={"ELASTIC_DIE": "127.0.0.1:2,127.0.0.2:2"}, timeout=90)
    assert res.returncode != 0 and result is None
    assert "no worker is left" in text or "fewer than --min-np" in text


def test_min_np_unreachable_ends_with_its_message(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    res = run_elastic([sys.executable, WORKER], 3, 3, None, hosts="127.0.0.1:1,127.0.0.2:1",
                      elastic_timeout_s=2.0, timeout_s=60.0, stdout=out, stderr=err)
    assert res.returncode != 0
    assert "only 2 slot(s) available after 2s, --min-np needs 3" in err.getvalue()


def test_a_rank_returning_early_fails_the_job_with_its_name(tmp_path):
    # horovod#3852: one rank leaving the training function must neither hang the job nor
    # end it silently: the others' next collective fails, naming the rank
    res, result, text = _job(tmp_path, np=2, min_np=2, hosts="127.0.0.1:1,127.0.0.2:1",
                             env={"ELASTIC_EARLY_RETURN_HOST": "127.0.0.2"}, timeout=90)
    assert res.returncode != 0 and result is None, text
    assert "shut down" in text


def test_the_elastic_example_survives_a_killed_worker(tmp_path):
    pytest.importorskip("sklearn")
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                           "pytorch_digits_elastic.py")
    out, err = io.StringIO(), io.StringIO()
    res = run_elastic([sys.executable, example, "--kill-host", "127.0.0.3"], 3, 1, None,
                      hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1", start_timeout_s=20.0,
                      elastic_timeout_s=30.0, timeout_s=150.0, stdout=out, stderr=err)
    text = out.getvalue() + err.getvalue()
    assert res.returncode == 0, text
    assert "epoch 2: 3 rank(s)" in text and "epoch 8: 2 rank(s)" in text
    accuracy = float(text.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.9, text


def test_a_sharded_optimizer_reshards_in_memory_when_a_rank_dies_and_a_host_joins(tmp_path):
    # np=4 with ShardedOptimizer(Adam) in TorchState: the worker of 127.0.0.3 is
    # SIGKILLed at step 5 and leaves discovery (4 -> 3: its slice of Adam's moments comes
    # from rank 1's neighbour copy), then 127.0.0.5 joins after step 9 (3 -> 4: a new rank
    # gets its slice from the survivors). After each reset the whole optimizer state,
    # assembled from the new slices, equals the one at the last commit; nothing is read
    # from disk; every sample once per epoch; every rank's weights equal.
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
    res, result, text = _job(
        tmp_path, np=4, min_np=3, max_np=4, discovery=hosts,
        env={"ELASTIC_SHARDED": "1", "ELASTIC_N": "96", "ELASTIC_EPOCHS": "3",
             "ELASTIC_DIE": "127.0.0.3:5", "ELASTIC_DIE_HOSTS": "127.0.0.1,127.0.0.2,127.0.0.4",
             "ELASTIC_ADD_HOST": "127.0.0.5", "ELASTIC_ADD_STEP": "9", "ELASTIC_GROW_TO": "4",
             "ELASTIC_STEP_SLEEP": "0.2"}, timeout=150)
    assert res.returncode == 0, text
    assert all(e == list(range(96)) for e in result["epochs"]), result["epochs"]
    sizes = result["sizes"]
    assert sizes[0] == 4 and 3 in sizes and sizes[-1] == 4, (sizes, result["checks"])
    checks = result["checks"]
    assert [c["size"] for c in checks] == [3, 4], checks  # one check per reset
    # Adam's two moments over 25 elements, whole, after each reshard
    assert all(c["equal"] and c["elements"] == 50 for c in checks), checks
    assert result["weights_equal"] and result["size"] == 4
    assert not list(tmp_path.glob("**/optim.*")), "nothing is written to disk"
