"""Which optimizers a ``ShardedOptimizer`` may split by elements (every binding's).

An optimizer whose step treats every element of a parameter on its own (SGD, Adam,
RMSprop...) computes the same update on any slice of the parameter as on the whole: a
rank can step on its slice alone. One that needs whole tensors (a norm per tensor, a
matrix per layer, a line search over all parameters) cannot, and is refused by name
with the reason; an optimizer ronde does not know is refused unless its user vouches
for it (``elementwise=True``).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

from .._errors import UnsupportedError

#: known optimizers (of any framework) whose step needs whole tensors, and why
WHOLE_TENSORS = {
    "LBFGS": "its step is a line search over all parameters at once",
    "SparseAdam": "it takes sparse gradients, which have no element slices",
    "Adafactor": "it factors each matrix's second moment into row and column statistics",
    "Muon": "it orthogonalizes each weight matrix's update (Newton-Schulz on whole tensors)",
    "Shampoo": "its preconditioners are per-dimension statistics of whole tensors",
    "Lamb": "its trust ratio is a norm over each whole tensor",
    "LARS": "its trust ratio is a norm over each whole tensor",
    "LossScaleOptimizer": "it wraps another optimizer; wrap that one instead and scale "
                          "the loss yourself",
}


def check_elementwise(optimizer: Any, elementwise: bool | None, framework: str,
                      known: Collection[str],
                      whole: Mapping[str, str] = WHOLE_TENSORS) -> None:
    """Refuse ``optimizer`` unless its step is elementwise: a class of ``whole`` (with
    its reason), one that is not a ``framework`` class named in ``known`` (unless the
    user vouches, ``elementwise=True``), or one declared not elementwise."""
    cls = type(optimizer)
    name = cls.__name__
    if name in whole and not elementwise:
        raise UnsupportedError(f"ShardedOptimizer cannot shard {name}: {whole[name]}, "
                               "and each rank holds only slices; use DistributedOptimizer")
    own = cls.__module__.split(".")[0] == framework
    if elementwise is None and not (own and name in known):
        raise UnsupportedError(
            f"ShardedOptimizer: {cls.__module__}.{name} is not one of {framework}'s "
            f"elementwise optimizers ({', '.join(sorted(known))}); if its step treats "
            "every element on its own (no norms, matrices or whole-tensor statistics), "
            "pass elementwise=True")
    if elementwise is False:
        raise UnsupportedError(f"ShardedOptimizer: {name} was declared not elementwise")
