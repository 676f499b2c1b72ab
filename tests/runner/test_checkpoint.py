"""Checkpoints are whole or absent (issue #32): ``save_checkpoint`` writes atomically, and
a rank stopped because a peer failed finishes its save first."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest

from ronde.checkpoint import atomic_save, deferred_termination, save_checkpoint

PY = sys.executable
pytestmark = pytest.mark.timeout(60)


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temporary(tmp_path) -> None:
    path = tmp_path / "ckpt.pkl"
    assert save_checkpoint({"step": 1}, path)  # a job of one: this process is rank 0
    def broken(fh):  # noqa: E306
        fh.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_save(path, broken)
    assert pickle.loads(path.read_bytes()) == {"step": 1}
    assert os.listdir(tmp_path) == ["ckpt.pkl"]
    atomic_save(path, write_path=lambda tmp: open(tmp, "wb").write(pickle.dumps({"step": 2})))
    assert pickle.loads(path.read_bytes()) == {"step": 2}
    assert os.listdir(tmp_path) == ["ckpt.pkl"]


def test_sigterm_during_a_save_takes_effect_after_it() -> None:
    got = []
    old = signal.signal(signal.SIGTERM, lambda s, f: got.append("handler"))
    try:
        with deferred_termination():
            os.kill(os.getpid(), signal.SIGTERM)
            got.append("saved")
        assert got == ["saved", "handler"]
    finally:
        signal.signal(signal.SIGTERM, old)


#: rank 0 saves a checkpoint that takes seconds to write; rank 1 dies meanwhile
JOB = textwrap.dedent("""
    import os, sys, time, torch, ronde.torch as hvd
    hvd.init()
    path = os.environ["CKPT"]

    class Slow:
        def __reduce__(self):
            open(path + ".started", "w").close()
            time.sleep(4)  # the launcher stops this rank meanwhile
            return (str, ("slow part",))

    if hvd.rank() == 0:
        hvd.save_checkpoint({"step": 1, "w": torch.ones(1000)}, path)
    hvd.barrier()
    if hvd.rank() == 0:
        hvd.save_checkpoint({"step": 2, "w": torch.full((1000,), 2.0), "x": Slow()}, path)
        print("saved", flush=True)
        time.sleep(30)
    else:
        while not os.path.exists(path + ".started"):
            time.sleep(0.01)
        os._exit(7)
""")


def test_a_peer_dying_during_a_save_leaves_a_whole_checkpoint(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "model.pt"
    r = subprocess.run([PY, "-m", "ronde.run", "-np", "2", PY, "-c", JOB], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "CKPT": str(ckpt)})
    assert r.returncode == 7, r.stderr  # the first failure: rank 1
    assert "rank 1 (host localhost) failed first with exit code 7" in r.stderr
    state = torch.load(ckpt, weights_only=False)
    # stopped by the launcher during the save, rank 0 finished it first
    assert state["step"] == 2 and float(state["w"].sum()) == 2000.0
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.pt.started"]


@pytest.mark.slow  # imports TensorFlow
def test_keras_models_and_best_checkpoints_are_written_whole(tmp_path) -> None:
    keras = pytest.importorskip("keras")
    import numpy as np

    import ronde.keras as hvd

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    assert hvd.save_checkpoint(model, str(tmp_path / "m.keras"))
    again = keras.saving.load_model(str(tmp_path / "m.keras"))
    np.testing.assert_array_equal(again.get_weights()[0], model.get_weights()[0])
    best = hvd.callbacks.BestModelCheckpoint(str(tmp_path / "best.weights.h5"), monitor="loss",
                                             save_weights_only=True)
    x = np.ones((4, 3), np.float32)
    hvd.init()  # a job of one
    try:
        model.fit(x, x[:, :2], epochs=2, verbose=0, callbacks=[best])
    finally:
        hvd.shutdown()
    assert sorted(os.listdir(tmp_path)) == ["best.weights.h5", "m.keras"]  # no temporary
    model.load_weights(str(tmp_path / "best.weights.h5"))
