"""``ronde.tensorflow.keras.callbacks``: the callbacks of :mod:`ronde.keras.callbacks`."""

from ...keras.callbacks import *  # noqa: F401,F403
from ...keras.callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,  # noqa: F401
                                LearningRateScheduleCallback, LearningRateWarmupCallback,
                                MetricAverageCallback)
