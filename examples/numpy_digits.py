"""Data-parallel training of a small MLP in plain numpy on scikit-learn's digits.

Every rank trains on its own shard; gradients are averaged with one grouped
allreduce per step; initial weights come from rank 0; metrics are averaged over
ranks weighted by sample count; rank 0 writes the checkpoint. Run it with::

    ronderun -np 2 python examples/numpy_digits.py

The 1,797 8x8 digit images ship inside scikit-learn (no download).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ronde as hvd
from ronde.checkpoint import atomic_save


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def init_params(rng: np.random.Generator, hidden: int) -> dict[str, np.ndarray]:
    return {
        "w1": (rng.standard_normal((64, hidden)) * np.sqrt(2 / 64)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 10)) * np.sqrt(2 / hidden)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def forward(p: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.maximum(x @ p["w1"] + p["b1"], 0)
    logits = h @ p["w2"] + p["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    return h, probs


def gradients(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[dict, float]:
    h, probs = forward(p, x)
    n = len(x)
    loss = float(-np.log(probs[np.arange(n), y] + 1e-9).mean())
    d = probs.copy()
    d[np.arange(n), y] -= 1
    d /= n
    dh = (d @ p["w2"].T) * (h > 0)
    return {"w1": x.T @ dh, "b1": dh.sum(0), "w2": h.T @ d, "b2": d.sum(0)}, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="base rate, scaled by size()")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--checkpoint", default="digits_checkpoint.npz")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = load_data()
    # shard by rank: every rank sees a disjoint slice of the training set
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    x_test, y_test = x_test[rank::size], y_test[rank::size]

    params = init_params(np.random.default_rng(1234 + rank), args.hidden)
    # everyone starts from rank 0's weights
    for name in sorted(params):
        params[name] = hvd.broadcast(params[name], root_rank=0, name=f"init.{name}")
    lr = args.lr * size  # the usual linear scaling with the number of ranks
    names = sorted(params)
    # equal number of steps on every rank (the shards differ by at most one sample)
    steps = int(hvd.allreduce(np.array([len(x_train) // args.batch_size]), op=hvd.Min)[0])
    rng = np.random.default_rng(rank)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))
        losses = []
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            grads, loss = gradients(params, x_train[idx], y_train[idx])
            averaged = hvd.grouped_allreduce([grads[k] for k in names], name="grads")
            for k, g in zip(names, averaged):
                params[k] -= lr * g
            losses.append(loss)
        mean_loss = float(hvd.allreduce(np.array([np.mean(losses)]), name="loss")[0])
        if rank == 0 and (epoch % 10 == 9 or epoch == args.epochs - 1):
            print(f"epoch {epoch + 1:3d}  loss {mean_loss:.4f}", flush=True)

    # exact distributed evaluation: sum correct predictions and counts over ranks
    _, probs = forward(params, x_test)
    counts = hvd.allreduce(np.array([(probs.argmax(1) == y_test).sum(), len(y_test)],
                                    dtype=np.int64), op=hvd.Sum, name="eval")
    accuracy = counts[0] / counts[1]
    elapsed = time.perf_counter() - start
    if rank == 0:
        # atomic (a temporary file, fsync, rename): a crash never leaves half a file
        atomic_save(args.checkpoint, lambda fh: np.savez(fh, **params))
        print(f"test accuracy {accuracy:.4f} on {counts[1]} images; {size} ranks, "
              f"{elapsed:.1f}s; checkpoint {args.checkpoint}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
