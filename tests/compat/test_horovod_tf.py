"""Horovod's TensorFlow semantics, as its own test suite relies on them (real processes)."""

from __future__ import annotations

import importlib.util

import pytest

from ronde.testing.installed import skip_unless_installed

skip_unless_installed("tensorflow")  # without importing them (ronde.testing.installed)

from ronde.testing import run_ranks  # noqa: E402

from . import cases, tf_workers as workers  # noqa: E402

CASES = [workers.errors_are_tf_errors, workers.ops_and_return_forms,
         workers.graph_ops_run_in_build_order, workers.gradient_rules,
         workers.sync_bn_and_local_layers]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_tensorflow_semantics(np_):
    # every case in one launch per size (cases.run_all): a failing case shows its own
    # traceback, the others still run
    names = [case.__name__ for case in CASES]
    for got in run_ranks(np_, cases.run_all, workers.__name__, names, timeout_s=220):
        assert got == {name: "ok" for name in names}, got


@pytest.mark.timeout(150)
@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                    reason="needs tf_keras (pip install tf_keras)")
def test_horovod_keras2_semantics_under_tf_use_legacy_keras():
    # tf.keras = tf_keras, as for most Horovod TF users (TensorFlow's rule)
    env = {"TF_USE_LEGACY_KERAS": "1", "CUDA_VISIBLE_DEVICES": ""}
    assert run_ranks(2, workers.keras2_semantics, timeout_s=130, env=env) == ["ok"] * 2


def test_tf_errors_pickle_as_the_plain_ronde_error():
    # ronde.testing, multiprocessing and Ray pickle exceptions across processes
    import pickle

    import tensorflow as tf

    from ronde import TensorMismatchError
    from ronde.tensorflow._bridge import as_tf_error

    err = as_tf_error(TensorMismatchError("allreduce 'x': dtype differs"))
    assert isinstance(err, tf.errors.FailedPreconditionError)
    assert as_tf_error(err) is err  # not wrapped twice
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is TensorMismatchError and str(back) == "allreduce 'x': dtype differs"
