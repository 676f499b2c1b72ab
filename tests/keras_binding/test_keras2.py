"""Keras 2 (tf_keras) under TF_USE_LEGACY_KERAS=1: TensorFlow's rule picks it (np=2).

The workers run with ``TF_USE_LEGACY_KERAS=1``, so ``tf.keras`` is ``tf_keras``; ronde's
callbacks, ``DistributedOptimizer`` and ``load_model`` must follow. Without ``tf_keras``
the import fails with an error naming the fix.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from ronde.testing import run_ranks_many

# no __init__.py here on purpose: a package named like a framework would shadow it
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras2_workers as workers  # noqa: E402

HAS_TF_KERAS = (importlib.util.find_spec("tensorflow") is not None
                and importlib.util.find_spec("tf_keras") is not None)
needs_tf_keras = pytest.mark.skipif(not HAS_TF_KERAS, reason="needs tensorflow and tf_keras "
                                    "(pip install tf_keras)")
ENV = {"TF_USE_LEGACY_KERAS": "1", "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"}


@needs_tf_keras
@pytest.mark.timeout(200)
def test_fit_equals_one_process_and_load_model_rewraps_the_keras2_optimizer(tmp_path):
    # one launch for both (importing TensorFlow is most of a launch's cost)
    out, loaded = run_ranks_many(2, [workers.fit_equivalence,
                                     (workers.load_model_roundtrip, str(tmp_path))],
                                 timeout_s=190, env=ENV)
    assert list(out[0]) == [label for label, _, _, _ in workers.OPTIMIZERS]
    for res in out:  # fit equals one process on the global batch
        for label, r in res.items():
            assert r["vs_one_process"] < 1e-5, (label, r)
            assert r["across_ranks"] == 0.0, (label, r)
            assert r["loss"] < 1e-5, (label, r)
            assert r["loss_across_ranks"] == 0.0, (label, r)
    for rank, res in enumerate(loaded):  # load_model re-wraps the Keras 2 optimizer
        assert res.pop("files") == ["best-m.h5", "best-m.keras", "m.h5", "m.keras"], res
        for name, r in res.items():
            assert r["wrote"] == (rank == 0), (name, r)
            assert r["distributed"] and r["class"] == "Adam", (name, r)
            assert r["iterations"] == workers.S and r["state"], (name, r)
            assert r["across_ranks"] == 0.0, (name, r)


def test_without_tf_keras_the_error_names_the_fix(tmp_path):
    # tf_keras made unimportable by a module of that name that raises ImportError
    (tmp_path / "tf_keras.py").write_text("raise ImportError('No module named tf_keras')\n")
    modules = ["ronde.keras"] + (["ronde.tensorflow.keras"]
                                 if importlib.util.find_spec("tensorflow") else [])
    code = ("import importlib\n"
            f"for m in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except ImportError as e:\n"
            "        print(m, '|', e)\n"
            "    else:\n"
            "        print(m, '| imported')\n")
    path = os.pathsep.join([str(tmp_path)] + [p for p in sys.path if p])
    env = {**os.environ, "PYTHONPATH": path, **ENV}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if " | " in line]
    assert [line.split(" | ")[0] for line in lines] == modules, proc.stdout + proc.stderr
    for line in lines:
        assert "TF_USE_LEGACY_KERAS=1" in line and "pip install tf_keras" in line, line
