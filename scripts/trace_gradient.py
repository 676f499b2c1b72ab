"""Follow one PyTorch gradient from its hook to the wire: which ronde files it crosses.

    ronderun -np 2 python scripts/trace_gradient.py

One ``DistributedOptimizer`` step of a 512x512 linear layer (a 1 MiB float32 gradient)
after 5 warm-up steps, with a profile function in every thread (installed before
``init()``, so the engine's threads have it too). Rank 0 prints the number of Python
calls into ronde, of distinct functions and files, of changes of file from one call to
the next, and the calls per file. Polling loops (mailbox, shm waits) make the call
counts vary from run to run; the files do not. docs/architecture.md quotes a run.
"""

import sys, threading, collections, os, json
import torch
import ronde.torch as hvd
ON = [False]
calls = collections.Counter(); seq = []
root = os.path.dirname(hvd.__file__).rsplit("/", 1)[0]
def prof(frame, event, arg):
    if ON[0] and event == "call":
        f = frame.f_code.co_filename
        if f.startswith(root):
            rel = f[len(root) + 1:]
            calls[(rel, frame.f_code.co_name)] += 1
            if not seq or seq[-1] != rel:
                seq.append(rel)
threading.setprofile(prof); sys.setprofile(prof)
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(512, 512, bias=False)  # 1 MiB gradient
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
x = torch.randn(4, 512)
def step():
    opt.zero_grad(); model(x).sum().backward(); opt.step()
for _ in range(5): step()
import time
time.sleep(0.5)
ON[0] = True
step()
ON[0] = False
if hvd.rank() == 0:
    fs = collections.Counter(f for f, _ in calls.elements())
    print(json.dumps({"calls": sum(calls.values()), "functions": len(calls), "files": len(fs),
                      "switches": len(seq) - 1, "by_file": fs.most_common()}))
hvd.shutdown()
