"""``hvd.callbacks`` on the TensorFlow module (as many Horovod TF2 tutorials write it).

The same callbacks as :mod:`ronde.keras.callbacks` (of the Keras that ``tf.keras`` is).
"""

from ..keras.callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,  # noqa: F401
                               LearningRateScheduleCallback, LearningRateWarmupCallback,
                               MetricAverageCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]
