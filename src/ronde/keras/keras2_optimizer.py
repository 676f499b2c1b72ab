"""``DistributedOptimizer`` for Keras 2 (``tf_keras``) optimizers, Horovod's semantics.

With ``TF_USE_LEGACY_KERAS=1`` TensorFlow's ``tf.keras`` is ``tf_keras`` (Keras 2), which
has two optimizer families, both TensorFlow only:

* ``tf_keras.optimizers.Optimizer`` (``tf.keras.optimizers.Adam``...): ``minimize`` is
  ``compute_gradients`` then ``apply_gradients``;
* ``tf_keras.optimizers.legacy.Optimizer`` (``OptimizerV2``): ``minimize`` is
  ``_compute_gradients`` then ``apply_gradients``; ``get_gradients`` in TF1-style graphs.

The wrapper is a subclass of the optimizer's class, with its name, built from its config
(or converted in place when it already holds state), as for Keras 3. Where the
gradients are reduced, as in Horovod: the compute hooks (``compute_gradients``,
``_compute_gradients``, ``get_gradients``; ``model.fit`` calls them through
``minimize``) return the reduced gradients. ``apply_gradients`` also reduces what it is
given, unless those are exactly the gradients a compute hook or a
``DistributedGradientTape`` just returned: a custom loop with a plain tape works, and
nothing is reduced twice. Every step's gradients go to the host in one call
(:func:`ronde.tensorflow.gradients.reduce_gradients`); clipping, in ``apply_gradients``,
sees the reduced gradients.

``backward_passes_per_step=k`` is Horovod's local aggregation (:class:`PassAggregator`,
Horovod's ``opt._agg_helper``): each compute adds the gradients to this rank's
accumulators and counts the pass; the k-th reduces the sums (Horovod sums the passes;
``average_aggregated_gradients=True`` divides by k) and clears them. ``apply_gradients``
applies on those steps only and just advances ``iterations`` on the others. Both are
``tf.cond``s on the counter, so they work eagerly and in ``tf.function``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import tensorflow as tf

from .._errors import UnsupportedError
from .._ops import ReduceOp
from .._api import set_size
from ..frameworks.local_grads import LocalSources, reduce_except_local
from ..tensorflow.gradients import reduce_gradients, take_reduced
from ._choice import KERAS2_MIXINS

if TYPE_CHECKING:
    from .optimizer import Options

logger = logging.getLogger(__name__)

Grads = list[Any]

_computed = threading.local()


def _remember(optimizer: Any, grads: Sequence[Any]) -> None:
    """Remember the gradients a compute hook of ``optimizer`` returned (reduced and, in a
    window, aggregated), so that its ``apply_gradients`` does neither again."""
    _computed.last = (id(optimizer), [g for g in grads if g is not None])


def _computed_here(optimizer: Any, grads: Sequence[Any]) -> bool:
    """True (once) if ``grads`` are what a compute hook of ``optimizer`` last returned."""
    last = getattr(_computed, "last", None)
    mine = [g for g in grads if g is not None]
    if (last is None or last[0] != id(optimizer) or len(last[1]) != len(mine)
            or any(a is not b for a, b in zip(last[1], mine))):
        return False
    _computed.last = None
    return True


class PassAggregator:
    """Local aggregation over ``passes`` backward passes (Horovod's ``_agg_helper``).

    Args:
        passes: backward passes per reduction and update.
        average: divide the reduced sum by ``passes`` (``average_aggregated_gradients``).
        sparse_as_dense: densify ``tf.IndexedSlices`` (they cannot be accumulated).
    """

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool) -> None:
        self.passes = int(passes)
        self.average = bool(average)
        self.sparse_as_dense = bool(sparse_as_dense)
        with tf.init_scope():
            #: passes accumulated since the last reduction (Horovod's ``counter``)
            self.counter = tf.Variable(0, trainable=False, dtype=tf.int32,
                                       name="ronde_aggregated_passes")
        self._sums: dict[int, tf.Variable] = {}  # by the gradient's position

    def _accumulator(self, i: int, grad: Any, variable: Any) -> tf.Variable:
        """The sum of position ``i``, created on its first gradient (in a ``tf.function``:
        on the first trace, as Keras creates its slots)."""
        acc = self._sums.get(i)
        if acc is None:
            shape = (variable.shape if variable is not None and variable.shape.is_fully_defined()
                     else grad.shape)
            with tf.init_scope():
                acc = tf.Variable(tf.zeros(shape, grad.dtype), trainable=False,
                                  name="ronde_aggregated_gradient")
            self._sums[i] = acc
        return acc

    def add(self, grads: Sequence[Any], variables: Sequence[Any],
            reduce: Callable[[Grads], Grads]) -> Grads:
        """Add this pass's gradients; on the last pass of a window return the reduced sums
        (and clear them), else the running sums."""
        dense = []
        for g, v in zip(grads, variables):
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    label = getattr(v, "name", "a variable")
                    raise ValueError(
                        f"DistributedOptimizer(backward_passes_per_step={self.passes}): the "
                        f"gradient of {label!r} is a tf.IndexedSlices, which cannot be "
                        "accumulated; pass sparse_as_dense=True")
                g = tf.convert_to_tensor(g)
            dense.append(g)
        where = [i for i, g in enumerate(dense) if g is not None]
        sums = {i: self._accumulator(i, dense[i], variables[i]) for i in where}
        running = []
        for i in where:
            sums[i].assign_add(tf.cast(dense[i], sums[i].dtype))
            running.append(sums[i].read_value())
        self.counter.assign_add(1)

        def reduce_and_clear() -> Grads:
            full: Grads = [None] * len(dense)
            for i, r in zip(where, running):
                full[i] = r
            reduced = reduce(full)
            out = [reduced[i] / self.passes if self.average else reduced[i] for i in where]
            for acc in self._sums.values():
                acc.assign(tf.zeros_like(acc))
            self.counter.assign(0)
            return out

        outs = tf.cond(tf.equal(self.counter, self.passes), reduce_and_clear,
                       lambda: list(running)) if where else []
        result: Grads = [None] * len(dense)
        for i, o in zip(where, outs):
            result[i] = o
        return result

    def gate(self, apply: Callable[[], Any], iterations: Any) -> None:
        """Run ``apply`` on the step that ended a window (counter back at 0); on the other
        steps only advance ``iterations``, as one step of the optimizer does."""
        def skip() -> None:
            iterations.assign_add(1)

        def run() -> None:
            apply()

        tf.cond(tf.equal(self.counter, 0), run, skip)


class _Keras2Mixin:
    """What both Keras 2 families share: the reduction, local variables, aggregation."""

    _ronde_options: Options
    _ronde: Any
    _agg_helper: PassAggregator | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        setup(self, type(self)._ronde_options)  # from_config copies are distributed too

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (``PartialDistributedOptimizer``)."""
        self._ronde.local.add(var)

    def _ronde_reduce(self, grads: Grads, variables: Sequence[Any]) -> Grads:
        o = self._ronde

        def reduce_all(g: Grads, v: Sequence[Any]) -> Grads:
            return reduce_gradients(g, v, o.prefix, o.reduction, o.sparse_as_dense)

        return reduce_except_local(grads, list(variables), o.local, reduce_all,
                                   set_size(o.reduction.process_set) if o.scale_local
                                   else None)

    def _ronde_gradients(self, grads: Grads, variables: Sequence[Any], reduce: bool) -> Grads:
        """The gradients to apply: reduced (unless ``reduce`` is False: already done),
        through the aggregation window when there is one."""
        def step(g: Grads) -> Grads:
            return self._ronde_reduce(g, variables) if reduce else list(g)

        if self._agg_helper is None:
            return step(list(grads))
        return self._agg_helper.add(list(grads), variables, step)

    def _ronde_processed(self, grads_and_vars: Any) -> list[tuple[Any, Any]]:
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        out = self._ronde_gradients([g for g, _ in pairs], variables, reduce=True)
        _remember(self, out)
        return list(zip(out, variables))

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply the gradients averaged over the ranks (reduced here unless a compute hook
        or a ``DistributedGradientTape`` just did), one window at a time with
        ``backward_passes_per_step > 1``."""
        pairs = list(grads_and_vars)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if not _computed_here(self, grads):
            # a DistributedGradientTape's gradients are reduced, not yet aggregated
            grads = self._ronde_gradients(grads, variables, reduce=not take_reduced(grads))
        pairs = list(zip(grads, variables))
        base = super()
        if self._agg_helper is None:
            return base.apply_gradients(pairs, *args, **kwargs)  # type: ignore[misc]
        self._ronde_build(pairs)

        def apply() -> Any:
            return base.apply_gradients(pairs, *args, **kwargs)  # type: ignore[misc]

        self._agg_helper.gate(apply, self.iterations)  # type: ignore[attr-defined]
        return self.iterations  # type: ignore[attr-defined]

    def _ronde_build(self, pairs: list[tuple[Any, Any]]) -> None:
        """Create the optimizer's slots, as its ``apply_gradients`` would, before that goes
        inside a ``tf.cond``."""


KERAS2_MIXINS.append(_Keras2Mixin)

class _CurrentMixin(_Keras2Mixin):
    """``tf_keras.optimizers.Optimizer`` (the default Keras 2 optimizers since TF 2.11)."""

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[Any]:
        """``[(gradient, variable)]`` of ``loss``, averaged over the ranks."""
        found = super().compute_gradients(loss, var_list, tape)  # type: ignore[misc]
        return self._ronde_processed(found)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[Any]:
        """Horovod's spelling of :meth:`compute_gradients`."""
        return self.compute_gradients(loss, var_list, tape)

    def _ronde_build(self, pairs: list[tuple[Any, Any]]) -> None:
        with tf.init_scope():  # every variable, as apply_gradients does (idempotent)
            self.build([v for _, v in pairs])  # type: ignore[attr-defined]


class _LegacyMixin(_Keras2Mixin):
    """``tf_keras.optimizers.legacy.Optimizer`` (``OptimizerV2``)."""

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[Any]:
        """``[(gradient, variable)]`` of ``loss``, averaged over the ranks (``minimize``)."""
        found = super()._compute_gradients(loss, var_list, grad_loss,  # type: ignore[misc]
                                           tape=tape)
        return self._ronde_processed(found)

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[Any]:
        """Horovod's public spelling of :meth:`_compute_gradients`."""
        return self._compute_gradients(loss, var_list, None, tape)

    def get_gradients(self, loss: Any, params: Any) -> list[Any]:
        """The gradients of ``loss`` (TF1-style graphs), averaged over the ranks."""
        grads = super().get_gradients(loss, params)  # type: ignore[misc]
        out = self._ronde_gradients(list(grads), list(params), reduce=True)
        _remember(self, out)
        return out

    def _ronde_build(self, pairs: list[tuple[Any, Any]]) -> None:
        with tf.init_scope():  # those with a gradient, as apply_gradients does
            self._create_all_weights(  # type: ignore[attr-defined]
                [v for g, v in pairs if g is not None])


def setup(optimizer: Any, options: Options) -> None:
    """Give ``optimizer`` its own copy of the options (its own local variables) and, with
    ``passes > 1``, its aggregation window."""
    optimizer._ronde = replace(options, local=LocalSources())
    passes = options.reduction.passes_per_step
    optimizer._agg_helper = (PassAggregator(passes, options.average_aggregated,
                                            options.sparse_as_dense)
                             if passes > 1 else None)


def is_legacy(optimizer: Any) -> bool:
    """True for an ``OptimizerV2`` (``tf_keras.optimizers.legacy``)."""
    import tf_keras

    return isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer)


def holds_state(optimizer: Any) -> bool:
    """Whether the optimizer has built its slots (after a step, or loaded)."""
    if is_legacy(optimizer):
        return bool(getattr(optimizer, "_weights", None))
    return bool(getattr(optimizer, "_built", False))


def distributed(optimizer: Any, options: Options) -> Any:
    """The distributed version of a Keras 2 optimizer (``DistributedOptimizer``'s work).

    Args:
        optimizer: a ``tf_keras`` optimizer.
        options: ``DistributedOptimizer``'s resolved options
            (:class:`ronde.keras.optimizer.Options`).

    Raises:
        UnsupportedError: an op other than Average and Sum (Horovod's Keras 2 rule).
    """
    if options.reduction.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise UnsupportedError("DistributedOptimizer on a Keras 2 (tf_keras) optimizer: op "
                               "must be Average or Sum (as in Horovod); for Adasum use a "
                               "Keras 3 optimizer")
    # the user's class (a wrapped optimizer wrapped again gets new options)
    base = next(c for c in type(optimizer).__mro__ if not issubclass(c, _Keras2Mixin))
    mixin = _LegacyMixin if is_legacy(optimizer) else _CurrentMixin
    cls: Any = type(base.__name__, (mixin, base),
                    {"__module__": base.__module__, "__doc__": base.__doc__,
                     "_ronde_options": options})
    if holds_state(optimizer):
        optimizer.__class__ = cls
        setup(optimizer, options)
        logger.info("DistributedOptimizer: %s already holds state; converted in place",
                    base.__name__)
        return optimizer
    return cls.from_config(optimizer.get_config())
