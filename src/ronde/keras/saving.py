"""``load_model``: load a Keras model and make its optimizer distributed again; atomic saves.

Keras 3, or Keras 2 (``tf_keras``) where TensorFlow's rule picks it (:mod:`._choice`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..frameworks.compression import Compresses
from ..process_sets import ProcessSet, global_process_set
from ._choice import keras_module, uses_tf_keras
from .optimizer import DistributedOptimizer, is_distributed, with_options

logger = logging.getLogger(__name__)


def load_model(filepath: str, custom_optimizers: list[type] | None = None,
               custom_objects: dict[str, Any] | None = None, compression: Compresses | None = None,
               backward_passes_per_step: int = 1, op: Any = None,
               process_set: ProcessSet = global_process_set, **kwargs: Any) -> Any:
    """Load a model saved with ``model.save`` and wrap its optimizer in ``DistributedOptimizer``.

    The optimizer keeps the state it was saved with (it is converted in place).
    Save on rank 0 only; every rank loads the same file.

    Args:
        filepath: a ``.keras`` file (with Keras 2 also ``.h5`` or a SavedModel folder).
        custom_optimizers: custom optimizer classes used by the model (registered as
            custom objects).
        custom_objects: other custom objects, as for ``keras.saving.load_model``.
        compression: compression of the distributed optimizer.
        backward_passes_per_step: as for ``DistributedOptimizer`` (must match what the
            optimizer was saved with when it is larger than 1).
        op: ``Average`` (default) or ``Sum``.
        process_set: the ranks that average their gradients.
        **kwargs: passed to ``keras.saving.load_model`` (``tf_keras.models.load_model``).
    """
    keras = keras_module()
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects or None, **kwargs)
    opt = getattr(model, "optimizer", None)
    if opt is None:
        logger.info("load_model(%r): the model has no optimizer (not compiled); nothing to "
                    "wrap", filepath)
        return model
    if is_distributed(opt):
        with_options(opt, compression=compression)
        return model
    from .._ops import ReduceOp

    wrapped = DistributedOptimizer(opt, compression=compression,
                                   backward_passes_per_step=backward_passes_per_step,
                                   op=op if op is not None else ReduceOp.AVERAGE,
                                   process_set=process_set)
    if wrapped is not opt:  # an optimizer without state is rebuilt from its config
        model.optimizer = wrapped
    return model


def single_file(filepath: str) -> bool:
    """Whether ``model.save``/``save_weights`` write ``filepath`` as one file: always with
    Keras 3; with Keras 2 for ``.keras`` and ``.h5`` paths (others are a SavedModel folder
    or a TF checkpoint, several files)."""
    return not uses_tf_keras() or str(filepath).endswith((".keras", ".h5", ".hdf5"))


def write_atomically(filepath: str, write: Callable[[str], Any]) -> None:
    """``write(path)`` to a temporary file renamed over ``filepath`` (ronde/checkpoint.py);
    straight to ``filepath`` where Keras writes several files (see :func:`single_file`)."""
    from ..checkpoint import atomic_save

    if single_file(filepath):
        atomic_save(filepath, write_path=write)
    else:
        write(filepath)


def save_checkpoint(model: Any, filepath: str, root_rank: int = 0, **kwargs: Any) -> bool:
    """``model.save(filepath)`` on ``root_rank``, atomically: ``filepath`` holds the
    previous model or the new one, never a torn file (see ronde/checkpoint.py); load it
    with :func:`load_model`. No collective. Returns True where it wrote."""
    from ..checkpoint import on_root

    if not on_root(root_rank):
        return False
    write_atomically(filepath, lambda path: model.save(path, **kwargs))
    return True
