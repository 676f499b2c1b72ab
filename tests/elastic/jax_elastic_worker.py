"""An elastic JAX loop for tests/elastic: ``JaxState`` keeps params and an optax state
(pytrees) across a lost rank and a joining one. Rank 0 writes the final params, the
sizes it trained at and whether every rank ended with rank 0's params to ELASTIC_OUT.

``ELASTIC_DIE_HOST``: that host's worker dies at step 3 (once); ``ELASTIC_ADD_AT``
(``step:host``): at that step, while the job is smaller than ``ELASTIC_GROW_TO``, rank 0
lists that host in the discovery file and every rank waits for it to join."""

import json
import os

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ronde.jax as hvd
from elastic_jobs import list_host, wait_to_grow

hvd.init()
HOST = os.environ.get("RONDE_HOSTNAME", "")
MARK = os.environ["ELASTIC_MARK"] + "." + HOST
STEPS = int(os.environ.get("ELASTIC_STEPS", "8"))
SHARDED = bool(os.environ.get("ELASTIC_SHARDED"))
#: ELASTIC_SHARDED=2: stage 2 with two passes a step (the same gradients twice, averaged:
#: the same steps as stage 1), so that the accumulator's slices are resharded too
PASSES = 2 if os.environ.get("ELASTIC_SHARDED") == "2" else 1
if SHARDED:  # 10 elements: slices of 5, 4 or 10 at 2, 3 or 1 ranks. AdamW (it reads
    # this rank's slice of the parameters) under jax.jit: a rank that comes back to a
    # size it had at another place must not run its old trace (the old slice baked in)
    tx = hvd.ShardedOptimizer(optax.adamw(0.1, weight_decay=0.5), stage=PASSES,
                              backward_passes_per_step=PASSES,
                              average_aggregated_gradients=True)
    update = jax.jit(tx.update)
    params = {"w": jnp.ones(7), "b": jnp.ones(3)}
else:
    tx = optax.sgd(0.1, momentum=0.9)
    params = {"w": jnp.zeros(3)}
state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), step=0, sizes=[])


def sharded_grads(t):
    """Step t's gradients, the same on every rank (so their average is them, at any
    size): the run must end where one process's Adam does on the same sequence."""
    return {"w": jnp.sin(t + jnp.arange(7.0)), "b": jnp.cos(t + jnp.arange(3.0))}


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        if HOST == os.environ.get("ELASTIC_DIE_HOST") and state.step == 3 \
                and not os.path.exists(MARK):
            open(MARK, "w").close()
            os._exit(1)
        add = os.environ.get("ELASTIC_ADD_AT", "")
        if add and state.step == int(add.split(":", 1)[0]) \
                and hvd.size() < int(os.environ["ELASTIC_GROW_TO"]):
            if hvd.rank() == 0:
                list_host(os.environ["ELASTIC_HOSTS_FILE"], add.split(":", 1)[1])
            wait_to_grow(state.commit)
        time.sleep(float(os.environ.get("ELASTIC_STEP_SLEEP", "0")))
        if SHARDED:
            for _ in range(PASSES):
                updates, state.opt_state = update(sharded_grads(state.step),
                                                  state.opt_state, state.params)
                state.params = optax.apply_updates(state.params, updates)
            state.sizes.append(hvd.size())
            state.step += 1
            state.commit()
            continue
        grad = hvd.allreduce(jnp.ones(3) * (hvd.rank() + 1), name="g", op=hvd.Sum)
        if os.environ.get("ELASTIC_OPTAX"):
            updates, state.opt_state = tx.update({"w": grad}, state.opt_state, state.params)
            state.params = optax.apply_updates(state.params, updates)
        else:
            state.params = {"w": state.params["w"] + grad}
        state.sizes.append(hvd.size())
        state.step += 1
        state.commit()


train(state)
mine = np.asarray(state.params["w"]).tobytes()
every = hvd.allgather_object(mine, name="final")
out = {"w": np.asarray(state.params["w"]).tolist(), "sizes": state.sizes,
       "equal": all(x == every[0] for x in every)}
if SHARDED:  # one process's AdamW over the same gradients
    ref_tx = optax.adamw(0.1, weight_decay=0.5)
    ref = {"w": jnp.ones(7), "b": jnp.ones(3)}
    ref_state = ref_tx.init(ref)
    for t in range(STEPS):
        u, ref_state = ref_tx.update(sharded_grads(t), ref_state, ref)
        ref = optax.apply_updates(ref, u)
    out["vs_one_process"] = max(float(jnp.max(jnp.abs(state.params[k] - ref[k])))
                                for k in ref)
    out["count"] = int(state.opt_state.inner[0][0].count)
if hvd.rank() == 0:
    with open(os.environ["ELASTIC_OUT"], "w") as f:
        json.dump(out, f)
hvd.shutdown()
