"""``DistributedGradientTape`` and the reduction of a step's TensorFlow gradients.

:func:`reduce_gradients` moves every gradient of a step to the host in one call
and reduces them there (:mod:`ronde.frameworks.host_reduce`): dense gradients are
allreduced (compressed when asked), ``tf.IndexedSlices`` (embedding gradients) are
allgathered unless ``sparse_as_dense=True``. ``None`` gradients pass through.

The tape remembers the gradients it returned; when the same list then reaches a
``DistributedOptimizer``'s ``apply_gradients`` (Horovod scripts often use both),
the optimizer does not reduce them a second time.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import tensorflow as tf

from .. import _api
from .._ops import ReduceOp
from ..frameworks.compression import Compresses
from ..frameworks.gradients import Reduction
from ..frameworks.host_reduce import GradientSpec, count_inputs, reduce_arrays
from ..frameworks.local_grads import LocalSources, layer_variables, reduce_except_local
from ..frameworks.naming import gradient_name
from ..process_sets import ProcessSet, global_process_set
from ._bridge import host_call

logger = logging.getLogger(__name__)

_reduced = threading.local()


def mark_reduced(grads: Sequence[Any]) -> None:
    """Remember ``grads`` as already averaged (read by :func:`take_reduced`)."""
    _reduced.grads = [g for g in grads if g is not None]


def take_reduced(grads: Sequence[Any]) -> bool:
    """True (once) if ``grads`` are exactly the tensors a tape last returned reduced."""
    last = getattr(_reduced, "grads", None)
    mine = [g for g in grads if g is not None]
    if not last or len(last) != len(mine) or any(a is not b for a, b in zip(last, mine)):
        return False
    _reduced.grads = None
    return True


def variable_label(v: Any, i: int) -> str:
    """A readable, rank-independent name for source ``i`` (its path or name)."""
    label = getattr(v, "path", None) or getattr(v, "name", None) or "tensor"
    return f"{i}.{str(label).replace(':', '_')}"


def reduce_gradients(grads: Sequence[Any], sources: Sequence[Any], prefix: str,
                     reduction: Reduction, sparse_as_dense: bool = False) -> list[Any]:
    """Reduce a step's gradients over the ranks in one host call.

    Args:
        grads: gradients (tensors, ``IndexedSlices`` or None), one per source.
        sources: the variables they belong to (for names only).
        prefix: the collective name prefix (identical on every rank).
        reduction: the op (``Average``, ``Sum``; others for dense gradients only), the
            scales, the compression (cast on the host) and the ranks taking part.
        sparse_as_dense: densify ``IndexedSlices`` and allreduce them.
    """
    red = reduction.on_host()
    specs: list[GradientSpec] = []
    inputs: list[tf.Tensor] = []
    where: list[int] = []
    out = list(grads)
    for i, (g, v) in enumerate(zip(grads, sources)):
        if g is None:
            continue
        name = gradient_name(f"{prefix}.{variable_label(v, i)}")
        if isinstance(g, tf.IndexedSlices) and sparse_as_dense:
            g = tf.convert_to_tensor(g)
        if isinstance(g, tf.IndexedSlices):
            specs.append(GradientSpec(name, sparse=True))
            inputs += [g.values, g.indices]
        else:
            specs.append(GradientSpec(name))
            inputs.append(tf.convert_to_tensor(g))
        where.append(i)
    if not specs:
        return out
    assert count_inputs(specs) == len(inputs)
    shapes = []
    for spec, k in zip(specs, _offsets(specs)):
        if spec.sparse:
            shapes += [tf.TensorShape([None]).concatenate(inputs[k].shape[1:]),
                       tf.TensorShape([None])]
        else:
            shapes.append(inputs[k].shape)
    results = host_call(lambda *a: reduce_arrays(a, specs, red), inputs,
                        [t.dtype for t in inputs], shapes, f"ronde_{prefix}")
    for spec, k, i in zip(specs, _offsets(specs), where):
        if spec.sparse:
            g = grads[i]
            out[i] = tf.IndexedSlices(results[k], results[k + 1], dense_shape=g.dense_shape)
        else:
            out[i] = results[k]
    return out


def _offsets(specs: Sequence[GradientSpec]) -> list[int]:
    offs, pos = [], 0
    for s in specs:
        offs.append(pos)
        pos += 2 if s.sparse else 1
    return offs


class _DistributedTapeMixin:
    """``gradient()`` of a ``tf.GradientTape`` that returns reduced gradients."""

    _ronde: dict[str, Any]
    _ronde_local: LocalSources

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient on this rank (never reduced; see local_grads)."""
        self._ronde_local.add(source)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
                 use_generic_names: bool = False) -> Any:
        """The gradients of ``target``, averaged (by default) over the ranks."""
        grads = super().gradient(target, sources, output_gradients,  # type: ignore[misc]
                                 unconnected_gradients)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        flat_sources = tf.nest.flatten(sources)
        o = self._ronde

        def reduce(g: list[Any], v: list[Any]) -> list[Any]:
            return reduce_gradients(g, v, o["prefix"], o["reduction"], o["sparse_as_dense"])

        size = _api.set_size(o["reduction"].process_set) if o["scale_local"] else None
        reduced = reduce_except_local(flat_grads, flat_sources, self._ronde_local, reduce,
                                      size)
        mark_reduced(reduced)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None,
                                       use_generic_names: bool = False
                                       ) -> tuple[list[Any], list[Any]]:
        """``gradient()`` split in two lists of ``(variable, gradient)``: local, then shared."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients)
        local = [(s, g) for s, g in zip(sources, grads) if s in self._ronde_local]
        shared = [(s, g) for s, g in zip(sources, grads) if s not in self._ronde_local]
        return local, shared


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "", compression: Compresses | None = None,
                            sparse_as_dense: bool = False, op: Any = ReduceOp.AVERAGE,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True,
                            name: str = "DistributedGradientTape") -> tf.GradientTape:
    """Wrap a ``tf.GradientTape`` so ``gradient()`` averages gradients over the ranks.

    Args:
        gradtape: the tape that recorded the forward pass (use the returned object).
        device_dense: ignored (Horovod compatibility).
        device_sparse: ignored (Horovod compatibility).
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``.
        sparse_as_dense: allreduce ``IndexedSlices`` as dense tensors instead of
            allgathering their values and indices.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with Average, divide by this before the sum and
            by ``size / factor`` after it.
        num_groups: accepted for Horovod compatibility (every gradient of a call is
            fused into one host call anyway).
        groups: as ``num_groups``.
        process_set: the ranks that average their gradients.
        scale_local_gradients: divide the gradients of sources registered with
            ``register_local_source`` by the set's size (Horovod's default).
        name: prefix of the gradients' collective names.

    Returns:
        An instance of a subclass of ``type(gradtape)`` sharing its recording.
    """
    red = Reduction.configure(op, gradient_predivide_factor, compression, process_set,
                              on_host=True)  # fails now on a wrong argument
    base: type[Any] = type(gradtape)
    cls: type[Any] = type(base.__name__, (_DistributedTapeMixin, base),
                          {"__module__": base.__module__})
    tape = cls.__new__(cls)  # type: ignore[call-overload]
    tape.__dict__.update(gradtape.__dict__)
    tape._ronde = {"prefix": name, "reduction": red, "sparse_as_dense": sparse_as_dense,
                   "scale_local": bool(scale_local_gradients)}
    tape._ronde_local = LocalSources()
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "", compression: Compresses | None = None,
                                   sparse_as_dense: bool = False, op: Any = ReduceOp.AVERAGE,
                                   gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A ``DistributedGradientTape`` that keeps the gradients of ``local_layers`` local.

    The trainable variables of ``local_layers`` (a Keras layer or a collection of
    them) are registered with ``register_local_source``: their gradients are not
    reduced, and with ``scale_local_gradients`` they are divided by the set's size.
    ``get_local_and_global_gradients(target, sources)`` returns both parts. The
    other arguments are ``DistributedGradientTape``'s.
    """
    from ..keras._choice import keras_module

    local_vars = layer_variables(local_layers, keras_module().layers.Layer)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor,
                                   num_groups, groups, process_set, scale_local_gradients)
    for v in local_vars:
        tape.register_local_source(v)  # type: ignore[attr-defined]
    return tape
