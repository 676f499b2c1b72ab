"""``DistributedOptimizer`` for Keras 3 optimizers, on every Keras backend.

The wrapper is a subclass of the user's optimizer class (same name, same config)
whose ``apply()`` averages the gradients over the ranks before the inner update:
``apply_gradients`` (custom loops), ``model.fit`` on TensorFlow and torch, and
``stateless_apply`` (``model.fit`` on JAX) all go through ``apply``. The reduction
is one host call per step (:mod:`ronde.keras._bridge`), so it works inside
``tf.function`` and ``jax.jit``.

``backward_passes_per_step=k`` uses Keras' own ``gradient_accumulation_steps=k``:
the optimizer accumulates locally and the ranks reduce the accumulated gradient
once per update (Horovod's default sums the k passes,
``average_aggregated_gradients=True`` averages them as Keras does). Clipping
(``clipnorm``...) applies to the reduced gradient, as in Horovod.

On TensorFlow, XLA cannot compile the host call: a model compiled with
``jit_compile=True`` must not use this optimizer (the ronde callbacks switch
``jit_compile`` off with a log line; otherwise the first step raises a
``RondeError`` that says so). JAX's ``jit`` and torch need nothing.

A Keras 2 optimizer (``tf_keras``, used under ``TF_USE_LEGACY_KERAS=1``) is wrapped
by :mod:`.keras2_optimizer` instead, with Horovod's Keras 2 semantics.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from .. import _api
from .._api import set_size
from .._errors import UnsupportedError
from .._ops import ReduceOp
from ..frameworks.compression import Compresses
from ..frameworks.gradients import Reduction
from ..frameworks.host_reduce import GradientSpec, reduce_arrays
from ..frameworks.local_grads import LocalSources, layer_variables, reduce_except_local
from ..frameworks.naming import gradient_name
from ..process_sets import ProcessSet, global_process_set
from ._bridge import backend_name, host_map
from ._choice import KERAS2_MIXINS, keras_module

logger = logging.getLogger(__name__)


class CallableList(list):  # type: ignore[type-arg]
    """A list that returns itself when called: ``opt.variables`` and ``opt.variables()``."""

    def __call__(self) -> "CallableList":
        return self


@dataclass(frozen=True)
class Options:
    """What a distributed optimizer does with the gradients (see ``DistributedOptimizer``)."""

    #: the op, scales, compression, process set and passes (the pipeline every binding
    #: shares: :mod:`ronde.frameworks.gradients`)
    reduction: Reduction
    sparse_as_dense: bool
    prefix: str
    average_aggregated: bool
    local: LocalSources = field(default_factory=LocalSources)
    scale_local: bool = True


def _tape_reduced(grads: Sequence[Any]) -> bool:
    tape = sys.modules.get("ronde.tensorflow.gradients")
    return bool(tape is not None and tape.take_reduced(grads))


class _DistributedMixin:
    """Methods mixed in front of the user's Keras optimizer class."""

    _ronde: Options
    _ronde_skip: bool = False
    gradient_accumulation_steps: Any

    @property
    def variables(self) -> CallableList:
        """The optimizer's variables (a list that can also be called, Keras 2 style)."""
        return CallableList(super().variables)  # type: ignore[misc]

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Reduce ``grads`` over the ranks, then apply them with the wrapped optimizer."""
        grads = list(grads)
        skip = _tape_reduced(grads)
        if skip:
            logger.debug("gradients come from DistributedGradientTape, already reduced")
        self._ronde_skip = skip
        if not skip and self._ronde.reduction.op == ReduceOp.ADASUM:
            return self._ronde_adasum_apply(grads, trainable_variables)
        if not skip and not self.gradient_accumulation_steps:
            grads = self._ronde_reduce(grads, self._ronde_variables(grads, trainable_variables),
                                       1.0)
        return super().apply(grads, trainable_variables)  # type: ignore[misc]

    def _ronde_variables(self, grads: list[Any], trainable_variables: Any) -> list[Any]:
        """The variables ``grads`` belong to (None each, where the optimizer knows none)."""
        if trainable_variables is not None:
            return list(trainable_variables)
        return list(getattr(self, "_trainable_variables", []) or [None] * len(grads))

    def _ronde_adasum_apply(self, grads: list[Any], trainable_variables: Any) -> Any:
        """The Adasum delta optimizer: the local step, then every rank applies the
        Adasum combination of the ranks' parameter deltas to the old parameters."""
        from keras import ops

        variables = self._ronde_variables(grads, trainable_variables)
        moved = [v for g, v in zip(grads, variables) if g is not None]
        old = [ops.copy(v.value) for v in moved]
        result = super().apply(grads, trainable_variables)  # type: ignore[misc]
        deltas = [ops.subtract(v.value, o) for v, o in zip(moved, old)]
        combined = self._ronde_reduce_all(deltas, moved, 1.0)
        for v, o, d in zip(moved, old, combined):
            v.assign(ops.add(o, ops.cast(d, o.dtype)))
        return result

    def _clip_gradients(self, grads: Any) -> Any:
        # With gradient accumulation Keras calls this once per update, on the
        # accumulated mean: the place to reduce once per k passes.
        if self.gradient_accumulation_steps and not self._ronde_skip:
            o = self._ronde
            scale = 1.0 if o.average_aggregated else float(self.gradient_accumulation_steps)
            variables = list(getattr(self, "_trainable_variables", None) or [])
            if len(variables) != len(grads):
                variables = [None] * len(grads)
            grads = self._ronde_reduce(list(grads), variables, scale)
        return super()._clip_gradients(grads)  # type: ignore[misc]

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (``PartialDistributedOptimizer``)."""
        self._ronde.local.add(var)

    def _compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[Any]:
        """Horovod's (Keras 2) hook: ``[(reduced gradient, variable)]`` of ``loss`` on a tape.

        TensorFlow backend only (the tape is a ``tf.GradientTape``); ``loss`` may be a
        callable, evaluated on a new tape when none is given.
        """
        import tensorflow as tf

        var_list = list(var_list)
        if tape is None:
            with tf.GradientTape() as tape:
                loss = loss() if callable(loss) else loss
        grads = tape.gradient(loss, var_list)
        return list(zip(self._ronde_reduce(list(grads), var_list, 1.0), var_list))

    def _ronde_reduce(self, grads: list[Any], variables: Sequence[Any],
                      extra_post: float) -> list[Any]:
        o = self._ronde
        return reduce_except_local(grads, variables, o.local,
                                   lambda g, v: self._ronde_reduce_all(g, v, extra_post),
                                   set_size(o.reduction.process_set) if o.scale_local
                                   else None)

    def _ronde_reduce_all(self, grads: list[Any], variables: Sequence[Any],
                          extra_post: float) -> list[Any]:
        o = self._ronde
        red = o.reduction if extra_post == 1.0 else \
            replace(o.reduction, postscale=o.reduction.postscale * extra_post)
        if backend_name() == "tensorflow":
            from ..tensorflow.gradients import reduce_gradients

            return reduce_gradients(grads, variables, o.prefix, red, o.sparse_as_dense)
        where = [i for i, g in enumerate(grads) if g is not None]
        if not where:
            return grads
        specs = [GradientSpec(gradient_name(f"{o.prefix}.{_label(variables[i], i)}"))
                 for i in where]
        outs = host_map(lambda *a: reduce_arrays(a, specs, red), [grads[i] for i in where],
                        f"ronde_{o.prefix}")
        result = list(grads)
        for i, out in zip(where, outs):
            result[i] = out
        return result


def _label(v: Any, i: int) -> str:
    label = None if v is None else (getattr(v, "path", None) or getattr(v, "name", None))
    return f"{i}.{label}" if label else str(i)


_classes: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, base: type) -> type:
    """``mixin`` in front of a Keras optimizer class, under the base's name, module and
    docstring (so Keras' serialization sees the user's class); one per pair."""
    if issubclass(base, mixin):
        return base
    cls = _classes.get((mixin, base))
    if cls is None:
        cls = type(base.__name__, (mixin, base), {"__module__": base.__module__,
                                                  "__doc__": base.__doc__})
        _classes[(mixin, base)] = cls
    return cls


def distributed_class(base: type) -> type:
    """The distributed subclass of a Keras optimizer class (one per class)."""
    return mixed_class(_DistributedMixin, base)


def is_distributed(optimizer: Any) -> bool:
    """True for an optimizer returned by ``DistributedOptimizer`` (Keras 3 or Keras 2)."""
    return isinstance(optimizer, (_DistributedMixin, *KERAS2_MIXINS))


def is_keras2(optimizer: Any) -> bool:
    """True for a Keras 2 optimizer (a class of the ``tf_keras`` package)."""
    return "tf_keras" in sys.modules and any(
        c.__module__.split(".")[0] == "tf_keras" for c in type(optimizer).__mro__)


def optimizer_name(optimizer: Any) -> str:
    """The optimizer's name (Keras 2's legacy optimizers keep it in ``_name``)."""
    return str(getattr(optimizer, "name", None) or getattr(optimizer, "_name", None)
               or type(optimizer).__name__)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: Compresses | None = None, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: Any = ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras optimizer so that it applies gradients averaged over the ranks.

    Args:
        optimizer: a Keras 3 optimizer (``keras.optimizers.Adam(...)``), or a Keras 2
            one (``tf_keras.optimizers.Adam``, ``tf_keras.optimizers.legacy.Adam``; see
            :mod:`.keras2_optimizer`).
        name: prefix of the gradients' collective names (default: the optimizer's name).
        use_locking: ignored (Horovod compatibility).
        device_dense: ignored (Horovod compatibility).
        device_sparse: ignored (Horovod compatibility).
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``.
        sparse_as_dense: allreduce ``IndexedSlices`` (TensorFlow) as dense tensors.
        backward_passes_per_step: batches accumulated locally per update and
            allreduce (sets Keras' ``gradient_accumulation_steps``).
        op: ``Average`` (default) or ``Sum``; ``Adasum``: the delta optimizer (each
            rank steps on its own gradients, then the parameter deltas are combined
            with Adasum, see docs/adasum.md; do not scale the learning rate by size).
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        average_aggregated_gradients: with ``backward_passes_per_step > 1``, average
            the passes (Keras' convention) instead of summing them (Horovod's default).
        num_groups: accepted for Horovod compatibility (a step is one host call).
        groups: as ``num_groups``.
        process_set: the ranks that average their gradients.
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` by the set's size (Horovod's default).

    Returns:
        A new optimizer of a subclass of ``type(optimizer)`` built from its config.
        An optimizer that already holds variables (after a step, or from
        ``load_model``) is converted in place instead, keeping its state.
        For a Keras 2 optimizer, ``backward_passes_per_step`` is Horovod's own local
        aggregation (``opt._agg_helper``), and ``op`` must be Average or Sum.

    Raises:
        ValueError: an unsupported op, or ``backward_passes_per_step`` that conflicts
            with the optimizer's own ``gradient_accumulation_steps``.
    """
    resolved = _api.resolve_op(op, None)
    if resolved == ReduceOp.ADASUM and (int(backward_passes_per_step) != 1
                                        or average_aggregated_gradients):
        raise UnsupportedError("DistributedOptimizer(op=Adasum) combines each step's "
                               "parameter deltas; it does not accumulate passes "
                               "(backward_passes_per_step must be 1)")
    red = Reduction.configure(resolved, gradient_predivide_factor, compression, process_set,
                              backward_passes_per_step, on_host=True)
    passes = red.passes_per_step
    options = Options(red, bool(sparse_as_dense),
                      name or f"DistributedOptimizer.{optimizer_name(optimizer)}",
                      bool(average_aggregated_gradients), LocalSources(),
                      bool(scale_local_gradients))
    if is_keras2(optimizer):
        from .keras2_optimizer import distributed

        return distributed(optimizer, options)
    own = int(getattr(optimizer, "gradient_accumulation_steps", None) or 1)
    if passes > 1 and own > 1 and own != passes:
        raise ValueError(f"backward_passes_per_step={passes} conflicts with the optimizer's "
                         f"gradient_accumulation_steps={own}; set only one of them")
    cls: Any = distributed_class(type(optimizer))
    if getattr(optimizer, "built", False):
        if passes > 1 and own != passes:
            raise ValueError("backward_passes_per_step needs an optimizer that was not built "
                             "yet (or one built with gradient_accumulation_steps="
                             f"{passes})")
        optimizer.__class__ = cls
        wrapped = optimizer
        logger.info("DistributedOptimizer: %s already holds state; converted in place",
                    type(optimizer).__name__)
    else:
        config = optimizer.get_config()
        if passes > 1:
            config["gradient_accumulation_steps"] = passes
        wrapped = cls.from_config(config)
    wrapped._ronde = options
    return wrapped


def with_options(optimizer: Any, **changes: Any) -> None:
    """Change a distributed optimizer's options in place (used by ``load_model``)."""
    optimizer._ronde = replace(optimizer._ronde, **changes)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,
                                device_dense: str = "", device_sparse: str = "",
                                compression: Compresses | None = None,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0,
                                op: Any = ReduceOp.AVERAGE, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A ``DistributedOptimizer`` that keeps the gradients of ``local_layers`` local.

    The trainable variables of ``local_layers`` (a Keras layer or a collection) are
    registered with ``register_local_var``: their gradients are not reduced and, with
    ``scale_local_gradients``, are divided by the set's size. The other arguments are
    ``DistributedOptimizer``'s.
    """
    if _api.resolve_op(op, None) not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError("op currently only supports Average and Sum")
    local_vars = layer_variables(local_layers, keras_module().layers.Layer)
    opt = DistributedOptimizer(optimizer, name=name, compression=compression,
                               sparse_as_dense=sparse_as_dense,
                               backward_passes_per_step=backward_passes_per_step, op=op,
                               gradient_predivide_factor=gradient_predivide_factor,
                               average_aggregated_gradients=average_aggregated_gradients,
                               groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    for v in local_vars:
        opt.register_local_var(v)
    return opt
