"""An elastic PyTorch training run for tests/elastic (started by ronderun's elastic driver).

Trains a tiny model over ELASTIC_N samples for ELASTIC_EPOCHS epochs with
``TorchState(model, optimizer, sampler=ElasticSampler(...))``. Every step all ranks
allgather the indices they processed and append them to ``state.seen`` (the same on
every rank, rolled back with the state), so rank 0 can check at each epoch's end that
every sample was used exactly once, however the job re-formed meanwhile. Faults are
injected by environment:

* ``ELASTIC_DIE=host:step[,host:step]``: the first worker on that host exits with code 1
  (no shutdown) at that step, after appending ``ELASTIC_DIE_ADDS`` (a host) to the
  discovery file if set (a replacement machine arriving);
* ``ELASTIC_ADD_HOST``/``ELASTIC_ADD_STEP``: rank 0 appends that host to the discovery
  file at that step (hosts join while training runs);
* ``ELASTIC_SET_HOSTS=step:host,host``: rank 0 rewrites the discovery file at that step
  (hosts removed while training runs);
* ``ELASTIC_EARLY_RETURN_HOST``: that host's worker returns from training at step 3.

Rank 0 writes ``{"epochs": [...], "sizes": [...], "resets": n}`` as JSON to ELASTIC_OUT.
"""

import json
import os
import sys
import time

import torch

import ronde.torch as hvd

N = int(os.environ.get("ELASTIC_N", "60"))
EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "2"))
BATCH = 4
COMMIT_EVERY = 2
HOST = os.environ.get("RONDE_HOSTNAME", "")
FIRST_LIFE = os.environ.get("ELASTIC_MARK", "") and not os.path.exists(
    os.environ["ELASTIC_MARK"] + "." + HOST)

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=3)
state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0, seen=[],
                               sizes=[], epochs=[])
resets = [0]


def on_reset():
    resets[0] += 1


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while state.epoch < EPOCHS:
        for idx in state.sampler.batches(BATCH):
            step = state.step
            if FIRST_LIFE and f"{HOST}:{step}" in os.environ.get("ELASTIC_DIE", "").split(","):
                open(os.environ["ELASTIC_MARK"] + "." + HOST, "w").close()
                if os.environ.get("ELASTIC_DIE_ADDS"):
                    with open(os.environ["ELASTIC_HOSTS_FILE"], "a") as f:
                        f.write(os.environ["ELASTIC_DIE_ADDS"] + "\n")
                os._exit(1)
            if HOST == os.environ.get("ELASTIC_EARLY_RETURN_HOST") and step == 3:
                return "early"
            if hvd.rank() == 0 and os.environ.get("ELASTIC_ADD_HOST") \
                    and step == int(os.environ.get("ELASTIC_ADD_STEP", "-1")):
                with open(os.environ["ELASTIC_HOSTS_FILE"], "a") as f:
                    f.write(os.environ["ELASTIC_ADD_HOST"] + "\n")
            plan = os.environ.get("ELASTIC_SET_HOSTS", "")
            if hvd.rank() == 0 and plan and step == int(plan.split(":", 1)[0]):
                with open(os.environ["ELASTIC_HOSTS_FILE"], "w") as f:
                    f.write("\n".join(plan.split(":", 1)[1].split(",")) + "\n")
            time.sleep(float(os.environ.get("ELASTIC_STEP_SLEEP", "0")))
            x = torch.tensor(idx, dtype=torch.float32).reshape(-1, 1) / N
            opt.zero_grad()
            ((model(x) - 2 * x) ** 2).sum().backward()  # an empty batch: zero gradients
            opt.step()
            got = hvd.allgather_object(list(idx), name="seen")
            state.seen.extend(i for part in got for i in part)
            state.sampler.record_indices(idx)
            state.sizes.append(hvd.size())
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()
        state.epochs.append(sorted(state.seen))
        state.seen = []
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()
    return "done"


out = train(state)
if hvd.rank() == 0 and out == "done":
    with open(os.environ["ELASTIC_OUT"], "w") as f:
        json.dump({"epochs": state.epochs, "sizes": state.sizes, "resets": resets[0],
                   "size": hvd.size()}, f)
hvd.shutdown()
sys.exit(0)
