"""``SyncBatchNormalization``: Keras batch normalization with statistics over every rank.

Horovod's layer for TensorFlow (``hvd.SyncBatchNormalization``): in training, each
rank's batch mean and mean of squares are combined over the process set (one
allreduce of a stacked tensor), weighted by each rank's number of elements, so the
normalized output and the moving statistics are those of the whole global batch
(ranks with different batch sizes included, where Horovod's plain average would be
biased). At inference it is ``BatchNormalization``. The allreduce has a gradient (the
allreduce of the incoming gradient), so the backward pass is synchronized too, as in
``torch.nn.SyncBatchNorm``.

The layer is a ``BatchNormalization`` of the Keras that ``tf.keras`` is
(:mod:`ronde.keras._choice`): Keras 3, or Keras 2 (``tf_keras``) under
``TF_USE_LEGACY_KERAS=1``. ``fused=True`` is refused as Horovod refuses it; Keras 3
has no fused kernel to turn off, so there ``fused=False`` is simply accepted.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .._ops import ReduceOp
from ..keras._choice import keras_module, uses_tf_keras
from ..process_sets import ProcessSet, global_process_set
from ._collectives import allreduce

keras = keras_module()


def global_moments(mean: Any, variance: Any, count: Any, process_set: ProcessSet,
                   name: str) -> tuple[Any, Any]:
    """The mean and variance of the set's whole batch, from each rank's moments over
    ``count`` elements per channel (one allreduce)."""
    mean_of_square = variance + tf.square(mean)
    stacked = tf.stack([mean * count, mean_of_square * count, tf.ones_like(mean) * count])
    total = allreduce(stacked, op=ReduceOp.SUM, process_set=process_set, name=name)
    group_mean = total[0] / total[2]
    return group_mean, total[1] / total[2] - tf.square(group_mean)


def element_count(inputs: Any, axes: Any, mask: Any, mean: Any) -> Any:
    """Elements per channel on this rank (the mask, when given, counts)."""
    if mask is None:
        return tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), mean.dtype)
    m = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), mean.dtype)
    return tf.reduce_sum(m) / tf.cast(tf.size(mean), mean.dtype)


def refuse_fused(fused: bool | None) -> None:
    """Horovod's rule: ``fused=True`` (or None, which may pick it) is refused."""
    if fused in (True, None):
        raise ValueError("SyncBatchNormalization does not support fused=True.")


if uses_tf_keras():
    class SyncBatchNormalization(keras.layers.BatchNormalization):
        """Batch normalization whose training statistics span the ranks of ``process_set``
        (Keras 2: ``tf_keras``)."""

        def __init__(self, fused: bool | None = False,
                     process_set: ProcessSet = global_process_set, **kwargs: Any) -> None:
            refuse_fused(fused)
            kwargs.setdefault("name", "sync_batch_normalization")  # Horovod's default name
            super().__init__(fused=False, **kwargs)
            self._process_set = process_set

        def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Any, keep_dims: Any,
                                    mask: Any = None) -> Any:
            mean, variance = super()._calculate_mean_and_var(inputs, reduction_axes,
                                                             keep_dims, mask=mask)
            if self._process_set.size() <= 1:
                return mean, variance
            count = element_count(inputs, reduction_axes, mask, mean)
            return global_moments(mean, variance, count, self._process_set,
                                  f"{self.name}.moments")
else:
    class SyncBatchNormalization(keras.layers.BatchNormalization):  # type: ignore[no-redef]
        """Batch normalization whose training statistics span the ranks of ``process_set``."""

        def __init__(self, fused: bool | None = False,
                     process_set: ProcessSet = global_process_set, **kwargs: Any) -> None:
            refuse_fused(fused)
            super().__init__(**kwargs)
            self._process_set = process_set

        def _moments(self, inputs: Any, mask: Any) -> Any:
            mean, variance = super()._moments(inputs, mask)
            if self._process_set.size() <= 1:
                return mean, variance
            count = element_count(inputs, self._reduction_axes, mask, mean)
            return global_moments(mean, variance, count, self._process_set,
                                  f"{self.name}.moments")

        def get_config(self) -> dict[str, Any]:
            config = super().get_config()
            config["fused"] = False
            return config
