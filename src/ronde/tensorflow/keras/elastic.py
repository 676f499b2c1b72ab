"""``import ronde.tensorflow.keras as hvd; hvd.elastic``: the same as :mod:`ronde.keras.elastic`,
with ``run`` translating TensorFlow op errors (:func:`ronde.tensorflow.elastic.run`)."""

from __future__ import annotations

from ...keras.elastic import *  # noqa: F401,F403
from ...keras.elastic import __all__  # noqa: F401
from ..elastic import run  # noqa: F401
