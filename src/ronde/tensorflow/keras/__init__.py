"""``import ronde.tensorflow.keras as hvd``: Horovod's ``horovod.tensorflow.keras`` spelling.

Everything is :mod:`ronde.keras` (Keras 3 on the TensorFlow backend, or Keras 2 =
``tf_keras`` under ``TF_USE_LEGACY_KERAS=1``, as ``tf.keras`` is), plus the TensorFlow
collectives' ``broadcast_variables``.
"""

from __future__ import annotations

from ... import _facade
from ...keras import *  # noqa: F401,F403
from ...keras import callbacks  # noqa: F401
from ..compression import Compression  # noqa: F401
from ..functions import broadcast_variables  # noqa: F401

from . import elastic  # noqa: F401,E402 - TensorFlow's run (its op errors translated)

__all__ = list(_facade.FACADES[__name__])
