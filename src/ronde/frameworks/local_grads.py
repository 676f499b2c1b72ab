"""Worker-local variables: gradients a partial tape or optimizer keeps on its rank.

Where it sits: used by ``PartialDistributedGradientTape`` (TensorFlow) and Keras'
``PartialDistributedOptimizer``, Horovod's names for model parallelism inside data
parallelism (a layer, often an embedding, whose weights differ per rank). The
gradients of the registered variables are never reduced; by Horovod's rule they are
divided by the process set's size instead (``scale_local_gradients=True``), so
that a local layer learns at the rate it would under an averaged loss. Everything
else goes through the usual one-call reduction of the step.

Variables are told apart by identity (Keras 3 and TF variables both hash by it),
so registering a layer's variables costs nothing per step.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence


def divided(grad: Any, size: int) -> Any:
    """``grad / size`` for a dense gradient of any framework, or a ``tf.IndexedSlices``
    (its values divided, its indices kept)."""
    if hasattr(grad, "indices") and hasattr(grad, "dense_shape"):
        return type(grad)(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size


def layer_variables(local_layers: Any, layer_type: type) -> list[Any]:
    """The trainable variables of ``local_layers`` (one layer, a collection, or None).

    Raises:
        ValueError: an entry is not a ``layer_type`` (Horovod's message).
    """
    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, layer_type) else list(local_layers)
    if not all(isinstance(layer, layer_type) for layer in layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return [v for layer in layers for v in layer.trainable_weights]


class LocalSources:
    """The set of variables whose gradients stay on their rank."""

    def __init__(self, variables: Iterable[Any] = ()) -> None:
        self._ids: set[int] = set()
        self._keep: list[Any] = []     # keeps ids valid while registered
        for v in variables:
            self.add(v)

    def add(self, variable: Any) -> None:
        """Register ``variable`` as worker-local."""
        if id(variable) not in self._ids:
            self._ids.add(id(variable))
            self._keep.append(variable)

    def __contains__(self, variable: Any) -> bool:
        return id(variable) in self._ids

    def __len__(self) -> int:
        return len(self._ids)


def reduce_except_local(grads: Sequence[Any], sources: Sequence[Any], local: LocalSources,
                        reduce: Callable[[list[Any], list[Any]], list[Any]],
                        divide_by: int | None) -> list[Any]:
    """Reduce the gradients of non-local sources with ``reduce``; divide the rest.

    Args:
        grads: one gradient (or None) per source.
        sources: the variables, in the same order.
        local: the worker-local variables.
        reduce: ``(grads, sources) -> reduced grads`` for the shared ones (one call).
        divide_by: the set's size, each local gradient's divisor (None: kept as is,
            ``scale_local_gradients=False``).
    """
    if not len(local):
        return reduce(list(grads), list(sources))
    shared = [i for i, v in enumerate(sources) if v not in local]
    out = list(grads)
    if shared:
        reduced = reduce([grads[i] for i in shared], [sources[i] for i in shared])
        for i, g in zip(shared, reduced):
            out[i] = g
    if divide_by is not None:
        for i, v in enumerate(sources):
            if v in local and out[i] is not None:
                out[i] = divided(out[i], divide_by)
    return out
