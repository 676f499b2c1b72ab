"""An elastic PyTorch training run for tests/elastic (started by ronderun's elastic driver).

Trains a tiny model over ELASTIC_N samples for ELASTIC_EPOCHS epochs with
``TorchState(model, optimizer, sampler=ElasticSampler(...))``. Every step all ranks
allgather the indices they processed and append them to ``state.seen`` (the same on
every rank, rolled back with the state), so rank 0 can check at each epoch's end that
every sample was used exactly once, however the job re-formed meanwhile. Faults are
injected by environment:

* ``ELASTIC_DIE=host:step[,host/slot:step]``: the first worker on that host (or that
  slot) dies at that step: SIGKILL, after adding ``ELASTIC_DIE_ADDS`` (a host) to the
  discovery file's pending list (a replacement machine arriving 2 s later) or rewriting it with
  ``ELASTIC_DIE_HOSTS`` (comma-separated: its host leaves discovery) if set;
* ``ELASTIC_TERM=host/slot:step``: that worker gets SIGTERM (preemption) at that step;
* ``ELASTIC_PS=1``: a process set of ranks 0 and 1 is added at start; every step
  allreduces on it too (it must survive resets);
* ``ELASTIC_ADD_HOST``/``ELASTIC_ADD_STEP``: rank 0 appends that host to the discovery
  file at that step (hosts join while training runs); ``ELASTIC_ADDS=step:host,...``
  for several. With ``ELASTIC_GROW_TO=n`` every rank then waits (committing) at that
  step, the last one of several, until the job re-formed, while it is smaller than n;
* ``ELASTIC_SET_HOSTS=step:host,host``: rank 0 rewrites the discovery file at that step
  (hosts removed while training runs);
* ``ELASTIC_EARLY_RETURN_HOST``: that host's worker returns from training at step 3.

Rank 0 writes ``{"epochs": [...], "sizes": [...], "resets": n, "size": n, "lr": x,
"weights_equal": bool}`` as JSON to ELASTIC_OUT (``weights_equal``: every rank's final
parameters are bitwise rank 0's).
"""

import json
import os
import signal
import sys
import time

import torch

import ronde.torch as hvd
from elastic_jobs import list_host, wait_to_grow

N = int(os.environ.get("ELASTIC_N", "60"))
EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "2"))
BATCH = 4
COMMIT_EVERY = 2
HOST = os.environ.get("RONDE_HOSTNAME", "")
SLOT = os.environ.get("RONDE_SLOT", "0")
FIRST_LIFE = os.environ.get("ELASTIC_MARK", "") and not os.path.exists(
    os.environ["ELASTIC_MARK"] + "." + HOST)
LR = 0.01

hvd.init()
torch.manual_seed(0)
SHARDED = bool(os.environ.get("ELASTIC_SHARDED"))
if SHARDED:  # 25 elements: every rank owns some at 3 and 4 ranks
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=LR * hvd.size()),
                               named_parameters=model.named_parameters())
else:
    model = torch.nn.Linear(1, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR * hvd.size()),
                                   named_parameters=model.named_parameters())
checks = []  # ELASTIC_SHARDED: after each reset, the whole optimizer state == the commit's


def full_state():
    """The sharded optimizer's state assembled whole (a collective): {name: {key: list}}."""
    local = [(name, a, b, {k: (v.tolist() if v.dim() else float(v)) for k, v in
                           opt.state.get(t, {}).items()})
             for name, a, b, t, _ in opt.shard_layout.shard_pieces()]
    whole = {}
    for part in hvd.allgather_object(local, name="full_state"):
        for name, a, b, st in part:
            for k, v in st.items():
                if isinstance(v, list):
                    whole.setdefault(name, {}).setdefault(k, {})[a] = v
                else:
                    whole.setdefault(name, {})[k] = v
    return {name: {k: ([x for a in sorted(v) for x in v[a]] if isinstance(v, dict) else v)
                   for k, v in st.items()} for name, st in whole.items()}
pair = hvd.add_process_set([0, 1]) if os.environ.get("ELASTIC_PS") else None
sampler = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=3)
state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0, seen=[],
                               sizes=[], epochs=[], opt_full=None)
resets = [0]


def on_reset():
    resets[0] += 1
    for group in opt.param_groups:  # the learning rate follows the size
        group["lr"] = LR * hvd.size()


state.register_reset_callbacks([on_reset])


def commit():
    if SHARDED:
        state.opt_full = full_state()
    state.commit()


@hvd.elastic.run
def train(state):
    if SHARDED and state.opt_full is not None:  # the same on every rank (synced)
        now = full_state()
        checks.append({"size": hvd.size(), "equal": now == state.opt_full,
                       "elements": sum(len(v) for st in now.values() for v in st.values()
                                       if isinstance(v, list))})
    while state.epoch < EPOCHS:
        for idx in state.sampler.batches(BATCH):
            step = state.step
            plans = os.environ.get("ELASTIC_DIE", "").split(",")
            if FIRST_LIFE and (f"{HOST}:{step}" in plans or f"{HOST}/{SLOT}:{step}" in plans):
                open(os.environ["ELASTIC_MARK"] + "." + HOST, "w").close()
                if os.environ.get("ELASTIC_DIE_ADDS"):  # listed 2 s later (elastic_jobs)
                    with open(os.environ["ELASTIC_HOSTS_FILE"] + ".pending", "a") as f:
                        f.write(os.environ["ELASTIC_DIE_ADDS"] + "\n")
                if os.environ.get("ELASTIC_DIE_HOSTS"):
                    with open(os.environ["ELASTIC_HOSTS_FILE"], "w") as f:
                        f.write(os.environ["ELASTIC_DIE_HOSTS"].replace(",", "\n") + "\n")
                os.kill(os.getpid(), signal.SIGKILL)
            if f"{HOST}/{SLOT}:{step}" in os.environ.get("ELASTIC_TERM", "").split(","):
                os.kill(os.getpid(), signal.SIGTERM)  # preempted: leaves at the next commit
            if pair is not None and pair.included():
                hvd.allreduce(torch.ones(1), name="pair", process_set=pair)
            if HOST == os.environ.get("ELASTIC_EARLY_RETURN_HOST") and step == 3:
                return "early"
            adds = [item.split(":", 1) for item in
                    filter(None, os.environ.get("ELASTIC_ADDS", "").split(","))]
            if os.environ.get("ELASTIC_ADD_HOST"):
                adds.append((os.environ.get("ELASTIC_ADD_STEP", "-1"),
                             os.environ["ELASTIC_ADD_HOST"]))
            for at, host in adds:
                if hvd.rank() == 0 and step == int(at):
                    list_host(os.environ["ELASTIC_HOSTS_FILE"], host)
            if adds and step == max(int(at) for at, _ in adds) \
                    and hvd.size() < int(os.environ.get("ELASTIC_GROW_TO", "0")):
                wait_to_grow(commit)
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
                commit()
        state.epochs.append(sorted(state.seen))
        state.seen = []
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        commit()
    return "done"


out = train(state)
if out == "done":
    mine = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().tobytes()
    every = hvd.allgather_object(mine, name="final.weights")
    if hvd.rank() == 0:
        with open(os.environ["ELASTIC_OUT"], "w") as f:
            json.dump({"epochs": state.epochs, "sizes": state.sizes, "resets": resets[0],
                       "size": hvd.size(), "lr": opt.param_groups[0]["lr"],
                       "weights_equal": all(w == every[0] for w in every),
                       "checks": checks}, f)
hvd.shutdown()
sys.exit(0)
