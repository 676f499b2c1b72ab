"""``DistributedOptimizer`` (``mx.optimizer``) and ``DistributedTrainer`` (Gluon).

Both average the gradients over the ranks before the optimizer sees them, with
one fused allreduce per dtype (:func:`ronde.frameworks.host_reduce.fused_allreduce`,
which also applies ``compression``):

* ``DistributedOptimizer(opt)`` wraps an ``mx.optimizer.Optimizer``: its
  ``update``/``update_multi_precision`` reduce the gradient(s) they are given in place,
  then call the inner optimizer. MXNet's updater hands it the gradients in chunks
  (``aggregate_num`` at a time), so there is one fused allreduce per chunk.
* ``DistributedTrainer(params, opt)`` is a ``gluon.Trainer`` without a kvstore whose
  ``step``/``allreduce_grads`` reduce *all* dense gradients in one fused allreduce.
  At the first step the ranks compare their parameter tables and raise
  ``TensorMismatchError`` naming the parameters that differ.

``trainer.step(batch_size)`` takes the **per-rank** batch size: the averaged
gradient then equals the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import mxnet as mx
import numpy as np

from .. import _state
from .._ops import ReduceOp
from ..frameworks.compression import NUMPY_COMPRESSION as Compression
from ..frameworks.compression import Compresses
from ..frameworks.gradients import Reduction
from ..frameworks.naming import require_same_parameters
from ..process_sets import ProcessSet, global_process_set
from . import _collectives as C

logger = logging.getLogger(__name__)

_OWN = frozenset({"_optimizer", "_ronde"})


class DistributedOptimizer(mx.optimizer.Optimizer):
    """An ``mx.optimizer.Optimizer`` whose updates use gradients averaged over ranks.

    Args:
        optimizer: the inner optimizer (e.g. ``mx.optimizer.create('sgd', ...)``).
        gradient_predivide_factor: divide by this before the sum and by
            ``size / factor`` after it.
        num_groups: accepted for Horovod compatibility (the gradients of one update
            call are always fused).
        process_set: the ranks that average their gradients (default: all).
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``.

    Attributes not defined here (``learning_rate``, ``rescale_grad``, ``wd`` ...) are
    read from and written to the inner optimizer.
    """

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set,
                 compression: Compresses = Compression.none) -> None:
        # no super().__init__(): every optimizer attribute lives on the inner optimizer
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_ronde", Reduction.configure(  # fails now on a wrong one
            ReduceOp.AVERAGE, gradient_predivide_factor, compression, process_set,
            on_host=True))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._optimizer, name, value)

    def _reduce(self, index: Any, grad: Any) -> None:
        red = self._ronde
        if not red.process_set.included():
            return  # Horovod: a rank outside the process set updates with its own gradient
        grads = grad if isinstance(grad, (list, tuple)) else [grad]
        indices = index if isinstance(index, (list, tuple)) else [index]
        C.reduce_fused_(grads, f"DistributedOptimizer.grad.{indices[0]}.{len(indices)}", red)

    def create_state(self, index: Any, weight: Any) -> Any:
        """The inner optimizer's state for one weight."""
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: Any) -> Any:
        """The inner optimizer's (multi-precision) state for one weight."""
        return self._optimizer.create_state_multi_precision(index, weight)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Average ``grad`` (one array or a list) over ranks in place, then update."""
        self._reduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Average ``grad`` over ranks in place, then the inner multi-precision update."""
        self._reduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        """Set the inner optimizer's learning rate."""
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: dict[Any, float]) -> None:
        """Set per-parameter learning-rate multipliers on the inner optimizer."""
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict[Any, float]) -> None:
        """Set per-parameter weight-decay multipliers on the inner optimizer."""
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` that averages all gradients over ranks in one fused allreduce.

    Args:
        params: the parameters to optimise (``net.collect_params()``).
        optimizer: an optimizer name or ``mx.optimizer.Optimizer`` (not a
            ``DistributedOptimizer``: that would reduce twice).
        optimizer_params: keyword arguments for a named optimizer.
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``.
        gradient_predivide_factor: divide by this before the sum and by
            ``size / factor`` after it.
        prefix: prepended to the collective names (two trainers that step at the same
            time need different prefixes).
        num_groups: accepted for Horovod compatibility (all gradients are fused).
        process_set: the ranks that average their gradients (default: all).
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict | None = None,
                 compression: Compresses = Compression.none,
                 gradient_predivide_factor: float = 1.0, prefix: str | None = None,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("DistributedTrainer got a DistributedOptimizer; using its inner "
                          "optimizer so that gradients are not reduced twice", stacklevel=2)
            optimizer = optimizer._optimizer
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None,
                         update_on_kvstore=False)
        self._ronde_reduction = Reduction.configure(
            ReduceOp.AVERAGE, gradient_predivide_factor, compression, process_set,
            on_host=True)  # fails now on a wrong argument
        self._ronde_prefix = prefix or ""
        self._ronde_ps = process_set
        self._ronde_validated = -1  # the job generation checked in (see ronde.torch)

    def _ronde_validate(self, params: list[Any]) -> None:
        require_same_parameters(((p.name, np.dtype(p.dtype), p.shape) for p in params),
                                f"{self._ronde_prefix}DistributedTrainer.params", self._ronde_ps,
                                "DistributedTrainer: the trainable parameters differ across "
                                "ranks", "build the same model on every rank")
        self._ronde_validated = _state.require().generation

    def _allreduce_grads(self) -> None:
        if not self._ronde_ps.included():
            return  # outside the process set: a local step, as DistributedOptimizer
        params = [p for p in self._params if p.grad_req != "null"]
        if self._ronde_validated != _state.require().generation:
            self._ronde_validate(params)
        grads = []
        for p in params:
            per_ctx = p.list_grad()
            if len(per_ctx) > 1:  # several local devices: sum them first, as a kvstore does
                total = per_ctx[0].copy()
                for g in per_ctx[1:]:
                    total += g.as_in_context(total.context)
                per_ctx[0][:] = total
            grads.append(per_ctx[0])
        C.reduce_fused_(grads, f"{self._ronde_prefix}DistributedTrainer.grads",
                        self._ronde_reduction)
        for p in params:
            per_ctx = p.list_grad()
            for g in per_ctx[1:]:
                per_ctx[0].copyto(g)
