"""Horovod's MXNet Gluon MNIST recipe on ronde, with scikit-learn's 8x8 digits.

The only change a Horovod script needs is the import (``import ronde.mxnet as
hvd``). Every rank trains on its shard, the learning rate is scaled by the number
of ranks, rank 0's initial parameters are broadcast (the first layer's shape is
inferred at the first forward pass; its broadcast happens then), and
``hvd.DistributedTrainer`` averages the gradients in one fused allreduce per step.
Metrics are summed over ranks, and rank 0 alone saves the parameters. Run it in the
MXNet venv (``scripts/mxnet_tests.sh`` builds it) with::

    build/venv-mxnet/bin/python -m ronde.run -np 2 build/venv-mxnet/bin/python \
        examples/mxnet_mnist.py

The 1,797 digit images ship inside scikit-learn (no download). Expect a test
accuracy of about 0.98 after 10 epochs (>= 0.95), in a few seconds at np=2.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)  # mxnet 1.9 on numpy 1.23

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import ronde.mxnet as hvd  # noqa: E402


def build_net() -> gluon.nn.HybridSequential:
    """A small CNN for 1x8x8 images (input shapes inferred at the first forward)."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
            gluon.nn.Conv2D(32, 3, padding=1, activation="relu"),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Flatten(),
            gluon.nn.Dense(64, activation="relu"),
            gluon.nn.Dropout(0.25),
            gluon.nn.Dense(10))
    return net


def load_digits_split(seed: int = 0) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The digits as (N, 1, 8, 8) floats in [0, 1]; a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x = (x[order] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = y[order].astype(np.float32)
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def evaluate(net: gluon.Block, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Exact loss and accuracy over the whole set: each rank scores its own rows."""
    xs, ys = mx.nd.array(x[hvd.rank()::hvd.size()]), mx.nd.array(y[hvd.rank()::hvd.size()])
    out = net(xs)
    loss_sum = gluon.loss.SoftmaxCrossEntropyLoss()(out, ys).sum().asscalar()
    correct = (out.argmax(axis=1) == ys).sum().asscalar()
    totals = hvd.allreduce(mx.nd.array([loss_sum, correct, len(ys)], dtype="float64"),
                           op=hvd.Sum, name="eval.totals").asnumpy()
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def main() -> None:
    """Train, evaluate, report and save on rank 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by size()")
    ap.add_argument("--checkpoint", default=None, help="rank 0 saves the parameters here")
    args = ap.parse_args()

    hvd.init()
    mx.random.seed(hvd.rank())  # different initial weights everywhere: the broadcast fixes it
    (x_train, y_train), (x_test, y_test) = load_digits_split()
    net = build_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": args.lr * hvd.size(),
                                                     "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    steps = (len(x_train) // hvd.size()) // args.batch_size  # the same on every rank
    start = time.monotonic()
    for epoch in range(1, args.epochs + 1):
        order = np.random.default_rng(epoch).permutation(len(x_train))  # same on every rank
        mine = order[hvd.rank()::hvd.size()]
        for s in range(steps):
            idx = mine[s * args.batch_size:(s + 1) * args.batch_size]
            data, label = mx.nd.array(x_train[idx]), mx.nd.array(y_train[idx])
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(len(idx))
        if epoch % 5 == 0 or epoch == args.epochs:
            test_loss, test_acc = evaluate(net, x_test, y_test)
            if hvd.rank() == 0:
                print(f"epoch {epoch}: test loss {test_loss:.4f} accuracy {test_acc:.4f}",
                      flush=True)
    test_loss, test_acc = evaluate(net, x_test, y_test)
    if hvd.rank() == 0:
        print(f"test accuracy {test_acc:.4f} ({hvd.size()} ranks, "
              f"{time.monotonic() - start:.1f} s)", flush=True)
        if args.checkpoint:  # atomically: write a temporary file, then rename
            fd, tmp = tempfile.mkstemp(prefix="tmp-ckpt-", suffix=".params",
                                       dir=os.path.dirname(os.path.abspath(args.checkpoint)))
            os.close(fd)
            net.save_parameters(tmp)
            os.replace(tmp, args.checkpoint)
    hvd.shutdown()


if __name__ == "__main__":
    main()
