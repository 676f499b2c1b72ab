"""Horovod's PyTorch MNIST example on ronde, with scikit-learn's 8x8 digits.

The only change a Horovod script needs is the import (``import ronde.torch as
hvd``). Everything else is the classic recipe: a ``DistributedSampler`` shards the
training set, the learning rate is scaled by the number of ranks, rank 0's initial
weights and optimizer state are broadcast, gradients are averaged by
``DistributedOptimizer`` while backward runs, metrics are averaged over ranks
weighted by sample count (no padded samples), and rank 0 alone writes the checkpoint
(atomically). Where torch sees a GPU, each process pins one by its local rank
(``--no-cuda`` keeps it on the CPU). Run it with::

    ronderun -np 2 python examples/pytorch_mnist.py

The 1,797 digit images ship inside scikit-learn (no download). Expect a test
accuracy of about 0.98 after 10 epochs (>= 0.95), in a few seconds at np=2.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ronde.torch as hvd


class Net(nn.Module):
    """A small CNN for 1x8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def load_digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The digits as (N, 1, 8, 8) float tensors in [0, 1]; a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x = torch.from_numpy((x[order] / 16.0).astype(np.float32)).view(-1, 1, 8, 8)
    y = torch.from_numpy(y[order].astype(np.int64))
    split = int(0.8 * len(x))
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def averaged(values: list[float], name: str) -> list[float]:
    """Sum ``values`` (e.g. [loss_sum, correct, count]) over ranks."""
    return hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Sum,
                         name=name).tolist()


def evaluate(model: nn.Module, data: TensorDataset, batch_size: int,
             device: torch.device) -> tuple[float, float]:
    """Exact test loss and accuracy: each sample is counted once across ranks."""
    shard = Subset(data, range(hvd.rank(), len(data), hvd.size()))  # no padding
    model.eval()
    loss_sum = correct = count = 0.0
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=batch_size):
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
            correct += float((out.argmax(1) == y).sum())
            count += len(y)
    loss_sum, correct, count = averaged([loss_sum, correct, count], "test.metrics")
    return loss_sum / count, correct / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="base rate, scaled by size()")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression")
    parser.add_argument("--use-adasum", action="store_true",
                        help="combine the steps with Adasum (no LR scaling by size())")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--no-cuda", action="store_true", help="stay on the CPU")
    parser.add_argument("--checkpoint", default="pytorch_digits_checkpoint.pt")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)  # one core per rank
    if not args.no_cuda and torch.cuda.is_available():
        # one GPU per process (NCCL needs that; ranks that must share one stage through host
        # memory, and ronde says so once)
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)
    train_set, test_set = load_digits_split()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = Net().to(device)
    lr_scaler = 1 if args.use_adasum else hvd.size()  # Adasum adapts: as Horovod's examples
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    run_model = torch.compile(model) if args.compile else model
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression,
                                   op=hvd.Adasum if args.use_adasum else hvd.Average)
    # LR schedulers work on the wrapped optimizer (it is still a torch.optim.SGD)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        run_model.train()
        loss_sum = count = 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = F.cross_entropy(run_model(x), y)
            loss.backward()
            opt.step()
            schedule.step()
            loss_sum += float(loss.detach()) * len(y)
            count += len(y)
        train_loss, total = averaged([loss_sum, count], "train.metrics")
        test_loss, test_acc = evaluate(run_model, test_set, 256, device)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: train loss {train_loss / total:.4f} "
                  f"test loss {test_loss:.4f} test acc {test_acc:.4f}", flush=True)
            # atomic: the file holds the previous checkpoint or this one, never half
            hvd.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                 "epoch": epoch + 1}, args.checkpoint)
    if hvd.rank() == 0:
        print(f"test accuracy {test_acc:.4f} ({time.perf_counter() - start:.1f}s, "
              f"{hvd.size()} ranks on {device.type})", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
