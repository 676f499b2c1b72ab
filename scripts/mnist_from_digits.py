"""Write mnist.zip (MNIST idx files) from scikit-learn's digits, padded to 28x28.

    python scripts/mnist_from_digits.py data-0/mnist.zip

Stands in for MNIST where nothing can be downloaded (Horovod's MXNet example reads it).
"""
from __future__ import annotations

import struct
import sys
import zipfile

import numpy as np
from sklearn.datasets import load_digits


def idx_images(a: np.ndarray) -> bytes:
    return struct.pack(">IIII", 2051, len(a), 28, 28) + a.tobytes()


def idx_labels(a: np.ndarray) -> bytes:
    return struct.pack(">II", 2049, len(a)) + a.tobytes()


d = load_digits()
x = np.pad(np.kron(d.images, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2))) * (255 / 16)
x = x.astype(np.uint8)
y = d.target.astype(np.uint8)
with zipfile.ZipFile(sys.argv[1], "w") as z:
    z.writestr("train-images-idx3-ubyte", idx_images(x[:1500]))
    z.writestr("train-labels-idx1-ubyte", idx_labels(y[:1500]))
    z.writestr("t10k-images-idx3-ubyte", idx_images(x[1500:]))
    z.writestr("t10k-labels-idx1-ubyte", idx_labels(y[1500:]))
