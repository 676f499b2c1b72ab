"""An elastic JAX loop for tests/elastic: ``JaxState`` keeps params (a pytree) across a
lost rank. Rank 0 writes the final params and the sizes it trained at to ELASTIC_OUT."""

import json
import os

import jax.numpy as jnp
import numpy as np

import ronde.jax as hvd

hvd.init()
HOST = os.environ.get("RONDE_HOSTNAME", "")
MARK = os.environ["ELASTIC_MARK"] + "." + HOST
state = hvd.elastic.JaxState(params={"w": jnp.zeros(3)}, step=0, sizes=[])


@hvd.elastic.run
def train(state):
    while state.step < 8:
        if HOST == os.environ.get("ELASTIC_DIE_HOST") and state.step == 3 \
                and not os.path.exists(MARK):
            open(MARK, "w").close()
            os._exit(1)
        grad = hvd.allreduce(jnp.ones(3) * (hvd.rank() + 1), name="g", op=hvd.Sum)
        state.params = {"w": state.params["w"] + grad}
        state.sizes.append(hvd.size())
        state.step += 1
        state.commit()


train(state)
if hvd.rank() == 0:
    with open(os.environ["ELASTIC_OUT"], "w") as f:
        json.dump({"w": np.asarray(state.params["w"]).tolist(), "sizes": state.sizes}, f)
hvd.shutdown()
