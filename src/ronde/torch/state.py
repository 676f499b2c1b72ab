"""Broadcasting model parameters, optimizer state and objects from one rank.

``broadcast_parameters`` overwrites tensors in place (zero-copy buffer broadcasts).
``broadcast_optimizer_state`` sends the root's whole ``optimizer.state_dict()``: the
structure and plain values (learning rates, betas, ...) by ``broadcast_object``, the
state tensors (momentum buffers, Adam moments, ``step``) by buffer broadcasts, and
loads it on the other ranks. Unlike Horovod it does not run a zero-gradient step to
create missing state: an optimizer that has not stepped yet has empty state on every
rank, which is already identical (and AdamW's weight decay does not touch the
parameters).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

import torch

from .. import _api
from ..frameworks import state as _state
from ..process_sets import ProcessSet, global_process_set
from . import _collectives as C
from ._tensors import dtype_name, torch_dtype

logger = logging.getLogger(__name__)


def _named(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, Iterable):
        items = []
        for i, item in enumerate(params):
            if isinstance(item, tuple) and len(item) == 2:
                items.append((str(item[0]), item[1]))
            elif isinstance(item, torch.Tensor):
                items.append((str(i), item))
            else:
                raise ValueError(f"broadcast_parameters: element {i} is a "
                                 f"{type(item).__name__}; expected a tensor or (name, tensor)")
    else:
        raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}; "
                         "pass model.state_dict(), model.named_parameters() or a list")
    return [(n, t) for n, t in items if isinstance(t, torch.Tensor)]


def broadcast_parameters(params: Any, root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()``, or a list of
            tensors or ``(name, tensor)`` pairs (same order on every rank).
        root_rank: the rank whose values everyone gets.
        process_set: the ranks taking part (default: all).
    """
    handles = [C.broadcast_async_(t, root_rank, f"broadcast_parameters.{name}", process_set)
               for name, t in _named(params)]
    for h in handles:
        h.wait()


def _broadcast_tensors(tensors: list[torch.Tensor], root_rank: int, prefix: str,
                       process_set: ProcessSet) -> None:
    handles = [C.broadcast_async_(t, root_rank, f"{prefix}.{i}", process_set)
               for i, t in enumerate(tensors)]
    for h in handles:
        h.wait()


def broadcast_state(tree: Any, root_rank: int = 0, name: str = "broadcast_state",
                    process_set: ProcessSet = global_process_set) -> Any:
    """Broadcast a nested structure of dicts/lists holding tensors and plain values.

    Returns the root's structure on every rank (non-root ranks get new tensors).
    """
    return _state.broadcast_state(
        tree, root_rank, _api.rank() == root_rank,
        is_tensor=lambda x: isinstance(x, torch.Tensor),
        describe=lambda t: (dtype_name(t.dtype), tuple(t.shape)),
        empty=lambda s: torch.empty(s.shape, dtype=torch_dtype(s.dtype)),
        broadcast_tensors=lambda ts: _broadcast_tensors(
            [t.detach().cpu() if t.device.type != "cpu" else t for t in ts], root_rank,
            f"{name}.tensor", process_set),
        broadcast_object=lambda obj: _api.broadcast_object(obj, root_rank, f"{name}.structure",
                                                           process_set))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state (and hyperparameters) equal to ``root_rank``'s.

    Works before the first step (empty state everywhere stays empty; learning rates
    and other group options are still sent) and after it (momentum buffers, Adam
    moments, ``step`` counts). Accepts a plain optimizer or a ``DistributedOptimizer``.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support LBFGS")
    sd = optimizer.state_dict() if _api.rank() == root_rank else None
    got = broadcast_state(sd, root_rank, "broadcast_optimizer_state", process_set)
    if _api.rank() != root_rank:
        optimizer.load_state_dict(got)
