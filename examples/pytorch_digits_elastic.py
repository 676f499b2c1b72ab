"""Elastic PyTorch training on ronde: the digits CNN, surviving a lost worker.

Horovod's elastic recipe (``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``) on
scikit-learn's 8x8 digits (no download). Run it elastically, e.g. on three loopback
"hosts" of this machine, and kill one worker while it trains::

    ronderun -np 3 --min-np 1 -H 127.0.0.1:1,127.0.0.2:1,127.0.0.3:1 \
        python examples/pytorch_digits_elastic.py --kill-host 127.0.0.3

The other two restore the last commit, re-form as a job of two (the learning rate
follows the new size), and finish; every training sample of each epoch is used
exactly once. Expect a test accuracy of about 0.95. See docs/elastic.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import ronde.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_mnist import Net, load_digits_split  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batches-per-commit", type=int, default=4)
    p.add_argument("--kill-host", default="",
                   help="the worker on this host exits abruptly in epoch 2 (a demo fault)")
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train_set, test_set = load_digits_split()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=0)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0)

    def on_reset() -> None:  # the job re-formed: follow its new size
        for group in opt.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_reset])
    doomed = args.kill_host and os.environ.get("RONDE_HOSTNAME") == args.kill_host

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            model.train()
            for i, idx in enumerate(state.sampler.batches(args.batch_size)):
                if doomed and state.epoch == 2 and i == 3:
                    os._exit(1)  # no shutdown: a lost worker, as a crash would be
                x, y = train_set[idx] if idx else (torch.zeros(0, 1, 8, 8),
                                                   torch.zeros(0, dtype=torch.long))
                opt.zero_grad()
                # a sum over the batch, scaled: an empty last batch contributes nothing
                loss = F.cross_entropy(model(x), y, reduction="sum") / args.batch_size
                loss.backward()
                opt.step()
                state.sampler.record_indices(idx)
                if (i + 1) % args.batches_per_commit == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: {hvd.size()} rank(s)", flush=True)

    train(state)
    model.eval()
    with torch.no_grad():
        x, y = test_set[:]
        correct = (model(x).argmax(1) == y).float().mean().item()
    if hvd.rank() == 0:
        print(f"test accuracy {correct:.4f} on {hvd.size()} rank(s)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
