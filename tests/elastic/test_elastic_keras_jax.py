"""Elastic Keras ``fit`` and JAX loops end to end (real elastic driver and processes)."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

from elastic_jobs import discovery_script
from ronde.runner.elastic import run_elastic

pytestmark = [pytest.mark.timeout(300), pytest.mark.elastic]
HERE = os.path.dirname(__file__)


def _job(tmp_path, worker, hosts=None, discovery=None, min_np=1, env=None, timeout=200.0,
         max_np=None):
    out, err = io.StringIO(), io.StringIO()
    result_file = tmp_path / "result.json"
    variables = {"ELASTIC_OUT": str(result_file), "ELASTIC_MARK": str(tmp_path / "mark"),
                 "ELASTIC_HOSTS_FILE": str(tmp_path / "hosts"), "RONDE_ELASTIC_POLL": "0.2",
                 "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
    script = discovery_script(tmp_path, discovery) if discovery is not None else None
    res = run_elastic([sys.executable, os.path.join(HERE, worker)], None, min_np, max_np,
                      hosts=hosts, discovery_script=str(script) if script else None,
                      env=variables, start_timeout_s=60.0, elastic_timeout_s=60.0,
                      timeout_s=timeout, stdout=out, stderr=err)
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    return res, result, out.getvalue() + err.getvalue()


def test_keras_fit_reformed_at_an_epoch_end_goes_on_with_the_next_epoch(tmp_path):
    pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    res, result, text = _job(tmp_path, "keras_elastic_worker.py",
                             discovery=["127.0.0.1", "127.0.0.2"], min_np=2,
                             env={"ELASTIC_ADD_HOST": "127.0.0.3", "ELASTIC_BATCH_SLEEP": "0.3"})
    assert res.returncode == 0, text
    assert result["size"] == 3 and result["epoch"] == 3
    assert result["resets_at"] == [1]  # re-formed once, after epoch 0 was done and counted
    assert result["started"] == [0, 1, 2]  # no epoch twice (horovod#2844)


def test_jax_state_survives_a_lost_rank(tmp_path):
    pytest.importorskip("jax")
    res, result, text = _job(tmp_path, "jax_elastic_worker.py", hosts="127.0.0.1:1,127.0.0.2:1",
                             env={"ELASTIC_DIE_HOST": "127.0.0.2"})
    assert res.returncode == 0, text
    # 3 committed steps at size 2 (each adds 1 + 2), then 5 at size 1 (each adds 1)
    assert result["sizes"] == [2, 2, 2, 1, 1, 1, 1, 1]
    assert result["w"] == [3 * 3 + 5] * 3


@pytest.mark.parametrize("backend,passes,die_at", [("jax", 1, 1), ("tensorflow", 2, 0)])
def test_keras_fit_with_a_sharded_optimizer_across_2_1_2_ranks(tmp_path, backend, passes,
                                                                 die_at):
    # Adam's state sharded over the ranks, resharded in memory at each resize: 127.0.0.2
    # dies as epoch 1 begins (its slice comes from the copy rank 0 kept at the last
    # commit), 127.0.0.3 joins at epoch 2's end (the whole state, on rank 0 at size 1,
    # split again). Every rank trains on the same batches in order, so the run must end
    # where one process's plain Adam does: a lost or misplaced moment shows in the weights.
    # On the JAX backend, whose fit empties the variables while it runs and wraps a lost
    # peer in a ValueError; and on TensorFlow with backward_passes_per_step=2 (the
    # accumulated shards and the inner step count carried), against one process's Adam
    # with Keras' gradient_accumulation_steps=2, the worker dying as epoch 0 begins:
    # before any commit, so the survivor starts over from the first weights with a
    # fresh state laid out for its size (every rank decides alike to lay out again)
    pytest.importorskip("keras")
    pytest.importorskip(backend)
    res, result, text = _job(tmp_path, "keras_elastic_worker.py",
                             discovery=["127.0.0.1", "127.0.0.2"], min_np=1,
                             env={"ELASTIC_EPOCHS": "4", "ELASTIC_BATCH_SLEEP": "0.1",
                                  "ELASTIC_SHARDED": "1", "KERAS_BACKEND": backend,
                                  "ELASTIC_PASSES": str(passes),
                                  "ELASTIC_DIE_AT_EPOCH": f"127.0.0.2:{die_at}",
                                  "ELASTIC_ADD_AT_EPOCH": "2:127.0.0.3"})
    assert res.returncode == 0, text
    ended = result["ended"]
    assert [e for e, _ in ended] == [0, 1, 2, 3]  # every epoch completed once
    assert ended[0][1] == (2 if die_at else 1) and 1 in [n for _, n in ended]
    assert result["size"] == 2
    assert result["epoch"] == 4
    assert result["vs_one_process"] < 1e-5 and result["moved"] > 1e-2, result
    assert result["iterations"] == 4 * 16, result  # 16 batches an epoch, none twice
    assert result["updates"] == 4 * 16 // passes, result


def test_jax_optax_loop_across_a_resize(tmp_path):
    pytest.importorskip("optax")
    res, result, text = _job(tmp_path, "jax_elastic_worker.py",
                             discovery=["127.0.0.1", "127.0.0.2"], min_np=1, max_np=3,
                             env={"ELASTIC_OPTAX": "1", "ELASTIC_STEPS": "8",
                                  "ELASTIC_ADD_AT": "4:127.0.0.3", "ELASTIC_GROW_TO": "3"})
    assert res.returncode == 0, text
    assert result["sizes"][0] == 2 and result["sizes"][-1] == 3 and result["equal"]


def _tf_state_worker():
    import tensorflow as tf

    import ronde.tensorflow as hvd

    hvd.init()
    v = tf.Variable([float(hvd.rank())] * 2)
    state = hvd.elastic.TensorFlowState([v], epoch=hvd.rank())
    v.assign([5.0, 5.0])
    state.epoch = 9
    state.restore()  # back to what was saved at construction
    restored = (v.numpy().tolist(), state.epoch)
    state.sync()  # rank 0's everywhere
    synced = (v.numpy().tolist(), state.epoch)

    hvd.shutdown()
    return restored, synced


def test_tensorflow_state_restores_and_syncs():
    pytest.importorskip("tensorflow")
    from ronde.testing import run_ranks

    out = run_ranks(2, _tf_state_worker, timeout_s=120)
    assert list(out[0]) == [([0.0, 0.0], 0), ([0.0, 0.0], 0)]
    assert list(out[1]) == [([1.0, 1.0], 1), ([0.0, 0.0], 0)]


def test_tensorflow_run_turns_op_errors_of_a_lost_peer_into_peer_lost_error(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    import ronde.elastic.loop as loop
    from ronde.tensorflow.elastic import run

    calls = []
    monkeypatch.setattr(loop, "_agree_on_sync", lambda mine: False)
    monkeypatch.setattr("ronde._api.rank", lambda: 0)
    monkeypatch.setattr(loop, "reset", lambda: calls.append("reset"))

    class St:
        def restore(self):
            calls.append("restore")

        def on_reset(self):
            calls.append("on_reset")

    tries = iter([tf.errors.UnknownError(None, None, "PeerLostError: rank 1 lost"), None])

    def train(state):
        exc = next(tries)
        if exc is not None:
            raise exc
        return "ok"

    assert run(train)(St()) == "ok"
    assert calls == ["restore", "reset", "on_reset"]
    other = tf.errors.UnknownError(None, None, "something else")
    with pytest.raises(tf.errors.UnknownError):
        run(lambda s: (_ for _ in ()).throw(other))(St())


def test_jax_sharded_optimizer_state_is_resharded_in_memory_across_a_lost_and_a_new_rank(
        tmp_path):
    # np=3 with ronde.jax.ShardedOptimizer(adamw) in a JaxState, its update under
    # jax.jit: the worker of 127.0.0.2 dies at step 3 (3 -> 2: its slice of the moments
    # comes from its neighbour's copy), 127.0.0.4 joins at step 6 (2 -> 3: 127.0.0.3,
    # rank 2 at the start, is rank 1 now); every rank's gradients are the same, so the
    # run must end where one process's AdamW does on the same steps: any lost or
    # misplaced moment shows in the weights. (JAX kept 127.0.0.3's first trace of the
    # size-3 update, rank 2's slice of the parameters baked in: 0.27 off, silently,
    # until a relayout cleared JAX's caches.) At stage 2 with two passes a step (ELASTIC_SHARDED=2),
    # so that the accumulator's slices (1/N of the gradients) take the new size too
    pytest.importorskip("optax")
    res, result, text = _job(tmp_path, "jax_elastic_worker.py",
                             discovery=["127.0.0.1", "127.0.0.2", "127.0.0.3"], min_np=2,
                             max_np=3,
                             env={"ELASTIC_SHARDED": "2", "ELASTIC_STEPS": "12",
                                  "ELASTIC_DIE_HOST": "127.0.0.2",
                                  "ELASTIC_ADD_AT": "6:127.0.0.4", "ELASTIC_GROW_TO": "3"})
    assert res.returncode == 0, text
    sizes = result["sizes"]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    assert result["equal"], result
    assert result["vs_one_process"] < 1e-5, result
    assert result["count"] == 12, result
