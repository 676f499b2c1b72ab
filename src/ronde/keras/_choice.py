"""Which Keras the bindings use: TensorFlow's own rule, read once per process.

TensorFlow >= 2.16 makes ``tf.keras`` Keras 2 (the ``tf_keras`` package) when
``TF_USE_LEGACY_KERAS`` is ``1``, ``true`` or ``True`` and ``tf_keras`` imports, and
Keras 3 (``keras``) otherwise. ronde's Keras bindings (``ronde.keras``,
``ronde.tensorflow.keras``, the callbacks, ``SyncBatchNormalization``, ``load_model``,
the elastic callbacks) follow the same rule, so their classes are of the Keras that
the user's ``tf.keras`` model is made of. ``DistributedOptimizer`` looks at the
optimizer it is given instead (a ``tf_keras`` optimizer is wrapped the Keras 2 way
whatever the rule says).

Where TensorFlow would fail (the variable set, ``tf_keras`` missing), importing
``ronde.keras`` fails with an ``ImportError`` that names the fix.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

#: the Keras 2 (tf_keras) distributed optimizers' mixin: :mod:`.keras2_optimizer` adds it
#: when imported (with TensorFlow), for ``is_distributed`` to know its optimizers
KERAS2_MIXINS: list[type] = []

#: the values of ``TF_USE_LEGACY_KERAS`` that TensorFlow reads as "use tf_keras"
LEGACY_VALUES = ("1", "true", "True")


def legacy_requested() -> bool:
    """True when the environment asks TensorFlow for Keras 2 (``TF_USE_LEGACY_KERAS``)."""
    return os.environ.get("TF_USE_LEGACY_KERAS") in LEGACY_VALUES


@functools.lru_cache(maxsize=None)
def keras_module() -> ModuleType:
    """The Keras package the bindings use: ``tf_keras`` or ``keras`` (Keras 3).

    Raises:
        ImportError: ``TF_USE_LEGACY_KERAS`` asks for Keras 2 and ``tf_keras`` does not
            import, or Keras 3 is asked for and ``keras`` does not import (or is not 3.x).
    """
    if legacy_requested():
        try:
            import tf_keras
        except ImportError as exc:
            raise ImportError(
                f"TF_USE_LEGACY_KERAS={os.environ.get('TF_USE_LEGACY_KERAS')} asks for Keras 2 "
                "(tf.keras = the tf_keras package), which is not installed: pip install "
                "tf_keras (the release matching your TensorFlow, e.g. tf_keras~=2.21.0 for "
                "TensorFlow 2.21), or unset TF_USE_LEGACY_KERAS to use Keras 3") from exc
        return tf_keras
    try:
        import keras
    except ImportError as exc:
        raise ImportError("ronde.keras needs Keras 3 and a backend: pip install 'keras>=3' "
                          "and one of tensorflow-cpu, jax or torch (or, for Keras 2 with "
                          "TensorFlow, pip install tf_keras and set "
                          "TF_USE_LEGACY_KERAS=1)") from exc
    if not str(getattr(keras, "__version__", "3")).startswith("3."):
        raise ImportError(f"ronde.keras needs Keras 3, found keras {keras.__version__}: pip "
                          "install 'keras>=3' (for Keras 2, install tf_keras and set "
                          "TF_USE_LEGACY_KERAS=1)")
    return keras


def uses_tf_keras() -> bool:
    """True when the bindings use Keras 2 (``tf_keras``, TensorFlow only)."""
    return keras_module().__name__ == "tf_keras"
