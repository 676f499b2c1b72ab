"""``Compression.none``, ``Compression.fp16``, ``Compression.bf16`` for TensorFlow tensors.

The policy (which dtypes are cast, the float16 overflow warning) is framework-neutral
(:mod:`ronde.frameworks.compression`). ``DistributedGradientTape``,
``DistributedOptimizer`` and ``allreduce`` apply the cast on the host, right before
the bytes go on the wire; ``compress``/``decompress`` also work on tf tensors.
"""

from __future__ import annotations

import tensorflow as tf

from ..frameworks import compression as _neutral
from ..frameworks.compression import CompressionContext, Compressor
from ._bridge import dtype_name

__all__ = ["Compression", "Compressor", "CompressionContext"]


class _TFAdapter:
    def dtype_name(self, tensor: tf.Tensor) -> str:
        return dtype_name(tensor.dtype)

    def cast(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        return tf.cast(tensor, tf.as_dtype(name))

    def all_finite(self, tensor: tf.Tensor) -> bool:
        if not tf.executing_eagerly():  # a symbolic tensor has no value to check yet
            return True
        return bool(tf.reduce_all(tf.math.is_finite(tensor)))


#: the built-in compressors for TensorFlow tensors
Compression: _neutral.Compression[tf.Tensor] = _neutral.Compression(_TFAdapter())
