"""An elastic Keras ``fit`` for tests/elastic: hosts join at the end of the first epoch.

Rank 0 appends ``ELASTIC_ADD_HOST`` to the discovery file when the first epoch begins;
epochs are slow enough (``ELASTIC_BATCH_SLEEP`` per batch) for the launcher to announce
the change before that epoch's closing commit, so every rank re-forms right at the
epoch boundary: the case of horovod#2844, where the commit saved the epoch before it
was advanced and the epoch ran again. Rank 0 writes the epochs it started (counted from
the start of training) and ``state.epoch`` at each reset to ``ELASTIC_OUT``.
"""

import json
import os
import time

import keras
import numpy as np

import ronde.keras as hvd

EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "3"))
HOST = os.environ.get("RONDE_HOSTNAME", "")
MARK = os.environ.get("ELASTIC_MARK", "/nonexistent") + "." + HOST
hvd.init()
rng = np.random.RandomState(0)
x = rng.rand(64, 4).astype("float32")
y = x.sum(axis=1, keepdims=True)
#: ELASTIC_SHARDED=1: ShardedOptimizer(Adam), every rank on the whole data in order (so
#: the average gradient is one process's): the run must end where one process's Adam does
SHARDED = bool(os.environ.get("ELASTIC_SHARDED"))
#: ELASTIC_PASSES=k: with backward_passes_per_step=k (averaged), against one process's
#: Adam with Keras' gradient_accumulation_steps=k
PASSES = int(os.environ.get("ELASTIC_PASSES", "1"))
ACCUMULATE = {"gradient_accumulation_steps": PASSES} if PASSES > 1 else {}
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
if SHARDED:
    model.compile(optimizer=hvd.ShardedOptimizer(keras.optimizers.Adam(0.05),
                                                 backward_passes_per_step=PASSES,
                                                 average_aggregated_gradients=True),
                  loss="mse")
else:
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
initial = [w.copy() for w in model.get_weights()]  # rank 0's are everyone's at the 1st sync
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
started, resets, ended = [], [], []
state.register_reset_callbacks([lambda: resets.append(state.epoch)])
epoch_cb = hvd.elastic.UpdateEpochStateCallback(state)


class Mark(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        overall = epoch_cb.initial_epoch + epoch
        started.append(overall)
        if hvd.rank() == 0 and overall == 0 and os.environ.get("ELASTIC_ADD_HOST"):
            with open(os.environ["ELASTIC_HOSTS_FILE"], "a") as f:
                f.write(os.environ["ELASTIC_ADD_HOST"] + "\n")
        # ELASTIC_DIE_AT_EPOCH=host:epoch: that host's worker dies as that epoch begins
        die = os.environ.get("ELASTIC_DIE_AT_EPOCH", "")
        if die == f"{HOST}:{overall}" and not os.path.exists(MARK):
            open(MARK, "w").close()
            os._exit(1)
        # ELASTIC_ADD_AT_EPOCH=epoch:host: rank 0 lists that host as that epoch begins
        add = os.environ.get("ELASTIC_ADD_AT_EPOCH", "")
        if add and hvd.rank() == 0 and overall == int(add.split(":", 1)[0]):
            with open(os.environ["ELASTIC_HOSTS_FILE"], "a") as f:
                f.write(add.split(":", 1)[1] + "\n")

    def on_epoch_end(self, epoch, logs=None):
        ended.append((epoch_cb.initial_epoch + epoch, hvd.size()))

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(float(os.environ.get("ELASTIC_BATCH_SLEEP", "0")))


# Horovod's examples list the commit before the update callbacks: the order that used to
# lose the epoch. Mark goes first: its epoch-end record must precede a commit that
# re-forms the job (Keras stops calling callbacks once one raises)
callbacks = [Mark(), hvd.elastic.CommitStateCallback(state, batches_per_commit=1000),
             hvd.elastic.UpdateBatchStateCallback(state), epoch_cb]


@hvd.elastic.run
def train(state):
    r, n = hvd.rank(), hvd.size()
    if SHARDED:
        state.model.fit(x, y, batch_size=4, epochs=EPOCHS - state.epoch, shuffle=False,
                        callbacks=callbacks, verbose=0)
        return
    state.model.fit(x[r::n], y[r::n], batch_size=4, epochs=EPOCHS - state.epoch,
                    callbacks=callbacks, verbose=0)


train(state)
if hvd.rank() == 0:
    found = {"started": started, "resets_at": resets, "epoch": state.epoch,
             "size": hvd.size(), "ended": ended}
    if SHARDED:  # one process, plain Adam, the same batches from the same weights
        ref = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        ref.set_weights(initial)
        ref.compile(optimizer=keras.optimizers.Adam(0.05, **ACCUMULATE), loss="mse")
        ref.fit(x, y, batch_size=4, epochs=EPOCHS, shuffle=False, verbose=0)
        found["vs_one_process"] = max(float(np.max(np.abs(a - b))) for a, b in
                                      zip(model.get_weights(), ref.get_weights()))
        found["moved"] = max(float(np.max(np.abs(a - b))) for a, b in
                             zip(model.get_weights(), initial))
        found["iterations"] = int(np.asarray(model.optimizer.iterations))
        # the inner optimizer's steps: one per k passes with accumulation
        found["updates"] = int(np.asarray(model.optimizer.inner_optimizer.iterations))
    with open(os.environ["ELASTIC_OUT"], "w") as f:
        json.dump(found, f)
hvd.shutdown()
