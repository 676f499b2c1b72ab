"""Worker of ``python -m ronde.bench.elastic`` (see there). Needs torch."""

import json
import os
import signal
import time

import torch

import ronde.torch as hvd

MODE = os.environ["BENCH_MODE"]  # "recovery" or "commit"
STEPS = int(os.environ.get("BENCH_STEPS", "60"))
COMMIT_EVERY = int(os.environ.get("BENCH_COMMIT_EVERY", "0"))  # 0: never
KILL_HOST = os.environ.get("BENCH_KILL_HOST", "")
KILL_STEP = int(os.environ.get("BENCH_KILL_STEP", "-1"))
OUT = os.environ["BENCH_OUT"]
HOST = os.environ.get("RONDE_HOSTNAME", "")
MARK = OUT + ".killed"

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
width = int(os.environ.get("BENCH_WIDTH", "1024"))
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                            torch.nn.Linear(width, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)
x = torch.randn(32, width)
y = torch.randint(0, 10, (32,))
log = []
commits = []


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        if MODE == "recovery" and HOST == KILL_HOST and state.step == KILL_STEP \
                and not os.path.exists(MARK):
            with open(MARK, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1
        if COMMIT_EVERY and state.step % COMMIT_EVERY == 0:
            t0 = time.perf_counter()
            state.commit()
            commits.append(time.perf_counter() - t0)
        log.append((time.time(), hvd.size()))


start = time.time()
train(state)
if hvd.rank() == 0:
    with open(OUT, "w") as f:
        json.dump({"log": log, "start": start, "commits": commits}, f)
hvd.shutdown()
