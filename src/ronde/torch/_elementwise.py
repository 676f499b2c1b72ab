"""torch's elementwise optimizers (:mod:`ronde.frameworks.elementwise`), and splitting
their state."""

from __future__ import annotations

from typing import Any

import torch

from .._errors import UnsupportedError
from ..frameworks.elementwise import check_elementwise as check

#: torch.optim classes whose step treats every element on its own: any split is exact
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                         "Rprop", "Adagrad", "Adadelta", "ASGD"})


def check_elementwise(optimizer: torch.optim.Optimizer, elementwise: bool | None) -> None:
    """Refuse an optimizer whose step needs whole tensors
    (:func:`ronde.frameworks.elementwise.check_elementwise`)."""
    check(optimizer, elementwise, "torch", ELEMENTWISE)


def slice_state(state: dict[str, Any], shape: torch.Size, a: int, b: int,
                name: str) -> dict[str, Any]:
    """A whole parameter's optimizer state cut to its elements ``[a, b)`` (tensors of the
    parameter's ``shape`` are sliced; scalars, such as Adam's step, are copied)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == shape and value.dim() > 0:
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
