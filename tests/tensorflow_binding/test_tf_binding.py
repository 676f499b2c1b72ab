"""ronde.tensorflow: collectives (eager, tf.function, gradients) and the TF2 training loop."""

from __future__ import annotations

import os
import sys

import pytest

from ronde.testing.installed import skip_unless_installed

skip_unless_installed("tensorflow", "keras")  # without importing them (ronde.testing.installed)

from ronde.testing import run_ranks, run_ranks_many  # noqa: E402

# no __init__.py here on purpose: a package named like a framework would shadow it
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tf_workers as workers  # noqa: E402

ENV = {"KERAS_BACKEND": "tensorflow", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.timeout(90)
def test_collectives_eager_graph_and_gradients_in_one_process():
    assert run_ranks(1, workers.collectives, timeout_s=80, env=ENV) == ["ok"]


@pytest.mark.timeout(150)
def test_at_two_ranks_collectives_and_horovods_tf2_pattern_equal_one_process():
    # one launch for both (importing TensorFlow is most of a launch's cost)
    collectives, out = run_ranks_many(2, [workers.collectives, workers.horovod_tf2_pattern],
                                      timeout_s=140, env=ENV)
    assert collectives == ["ok"] * 2  # eager, in graphs, and their gradients
    for res in out:  # Horovod's TF2 pattern equals one process on the full batch
        assert res["diff"] < 1e-5, res
        assert res["iterations"] == 6, res


def test_xla_is_refused_with_the_fix():
    tf = pytest.importorskip("tensorflow")
    from ronde.tensorflow._bridge import host_call

    @tf.function(jit_compile=True)
    def f(x):
        return host_call(lambda a: [a], [x], [x.dtype], [x.shape], "probe")[0]

    # autograph re-raises it as a StagingError that carries the message
    with pytest.raises(Exception, match="XLA-compiled.*jit_compile=False"):
        f(tf.constant([1.0]))


def test_facades_export_horovods_names_and_keras_skips_tensorflow():
    import subprocess

    import ronde.tensorflow as hvd
    import ronde.tensorflow.keras as hvdk

    for name in ("allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall",
                 "reducescatter", "join", "barrier", "broadcast_object", "allgather_object",
                 "broadcast_variables", "DistributedGradientTape", "DistributedOptimizer",
                 "Compression", "ProcessSet", "add_process_set", "rank_op", "size_op"):
        assert hasattr(hvd, name), name
    assert hvd.callbacks.BroadcastGlobalVariablesCallback is \
        hvdk.callbacks.BroadcastGlobalVariablesCallback
    assert set(hvd.__all__) <= set(dir(hvd)) | {"callbacks"}
    code = ("import sys, ronde.keras; print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, KERAS_BACKEND="numpy"), check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
