"""``SyncBatchNormalization``: Keras batch normalization with statistics over every rank.

Horovod's layer for TensorFlow (``hvd.SyncBatchNormalization``), on Keras 3: in
training, each rank's batch mean and mean of squares are combined over the
process set (one allreduce of a stacked tensor), weighted by each rank's number of
elements, so the normalized output and the moving statistics are those of the
whole global batch (ranks with different batch sizes included, where Horovod's
plain average would be biased). At inference it is ``BatchNormalization``. The
allreduce has a gradient (the allreduce of the incoming gradient), so the
backward pass is synchronized too, as in ``torch.nn.SyncBatchNorm``.

``fused=True`` is refused as Horovod refuses it (Keras 3 has no fused kernel to
turn off, so ``fused=False`` is simply accepted).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from .._ops import ReduceOp
from ..process_sets import ProcessSet, global_process_set
from ._collectives import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose training statistics span the ranks of ``process_set``."""

    def __init__(self, fused: bool | None = False,
                 process_set: ProcessSet = global_process_set, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)
        self._process_set = process_set

    def _moments(self, inputs: Any, mask: Any) -> Any:
        mean, variance = super()._moments(inputs, mask)
        if self._process_set.size() <= 1:
            return mean, variance
        # elements per channel on this rank (the mask, when given, counts)
        if mask is None:
            shape = tf.shape(inputs)
            count = tf.cast(tf.reduce_prod(tf.gather(shape, self._reduction_axes)),
                            mean.dtype)
        else:
            m = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), mean.dtype)
            count = tf.reduce_sum(m) / tf.cast(tf.size(mean), mean.dtype)
        mean_of_square = variance + tf.square(mean)
        stacked = tf.stack([mean * count, mean_of_square * count,
                            tf.ones_like(mean) * count])
        total = allreduce(stacked, op=ReduceOp.SUM, process_set=self._process_set,
                          name=f"{self.name}.moments")
        group_count = total[2]
        group_mean = total[0] / group_count
        group_variance = total[1] / group_count - tf.square(group_mean)
        return group_mean, group_variance

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["fused"] = False
        return config
