"""Which optimizers a ``ShardedOptimizer`` may split by elements, and splitting their state.

An optimizer whose step treats every element of a parameter on its own (SGD, Adam,
RMSprop...) computes the same update on any slice of the parameter as on the whole: a
rank can step on its slice alone. One that needs whole tensors (a norm per tensor, a
matrix per layer, a line search over all parameters) cannot, and is refused by name
with the reason; an optimizer ronde does not know is refused unless its user vouches
for it (``elementwise=True``).
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import UnsupportedError

#: torch.optim classes whose step treats every element on its own: any split is exact
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                         "Rprop", "Adagrad", "Adadelta", "ASGD"})
#: known optimizers whose step needs whole tensors (or all of them), and why
WHOLE_TENSORS = {
    "LBFGS": "its step is a line search over all parameters at once",
    "SparseAdam": "it takes sparse gradients, which have no element slices",
    "Adafactor": "it factors each matrix's second moment into row and column statistics",
    "Muon": "it orthogonalizes each weight matrix's update (Newton-Schulz on whole tensors)",
    "Shampoo": "its preconditioners are per-dimension statistics of whole tensors",
    "Lamb": "its trust ratio is a norm over each whole tensor",
    "LARS": "its trust ratio is a norm over each whole tensor",
}


def check_elementwise(optimizer: torch.optim.Optimizer, elementwise: bool | None) -> None:
    """Refuse an optimizer whose step needs whole tensors (see :data:`WHOLE_TENSORS`)."""
    name = type(optimizer).__name__
    if name in WHOLE_TENSORS and not elementwise:
        raise UnsupportedError(f"ShardedOptimizer cannot shard {name}: {WHOLE_TENSORS[name]}, "
                               "and each rank holds only slices; use DistributedOptimizer")
    torch_own = type(optimizer).__module__.startswith("torch.optim")
    if elementwise is None and not (torch_own and name in ELEMENTWISE):
        raise UnsupportedError(
            f"ShardedOptimizer: {type(optimizer).__module__}.{name} is not one of torch's "
            f"elementwise optimizers ({', '.join(sorted(ELEMENTWISE))}); if its step treats "
            "every element on its own (no norms, matrices or whole-tensor statistics), pass "
            "elementwise=True")
    if elementwise is False:
        raise UnsupportedError(f"ShardedOptimizer: {name} was declared not elementwise")


def slice_state(state: dict[str, Any], param: torch.Tensor, a: int, b: int,
                name: str) -> dict[str, Any]:
    """A whole parameter's optimizer state cut to its elements ``[a, b)`` (tensors shaped
    like the parameter are sliced; scalars, such as Adam's step, are copied)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
            out[key] = value.detach().reshape(-1)[a:b].clone()
        elif torch.is_tensor(value) and value.dim() == 0:
            out[key] = value.detach().clone()
        elif torch.is_tensor(value):
            raise UnsupportedError(f"ShardedOptimizer: state {key!r} of {name!r} has shape "
                                   f"{tuple(value.shape)}, neither the parameter's nor a "
                                   "scalar: this optimizer's step is not elementwise")
        else:
            out[key] = value
    return out
