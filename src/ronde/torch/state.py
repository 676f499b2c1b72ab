"""Broadcasting model parameters, optimizer state and objects from one rank.

``broadcast_parameters`` overwrites tensors in place (zero-copy buffer broadcasts).
``broadcast_optimizer_state`` sends the root's whole ``optimizer.state_dict()``: the
structure and plain values (learning rates, betas, ...) by ``broadcast_object``, the
state tensors (momentum buffers, Adam moments, ``step``) by buffer broadcasts, and
loads it on the other ranks. As Horovod does, an optimizer that has not stepped yet
first gets its state created by one step on zero gradients (every trainable parameter
gets a zero ``grad``; sparse for ``SparseAdam`` and for the sparse embeddings of
``model=``), so that momentum buffers and moments exist, and are equal, on every rank.
That step runs the wrapped optimizer's own ``step()``, never the distributed one, and
leaves the parameters as they were (weight decay would move them, by each rank's own
learning rate: Horovod lets the ranks' parameters drift apart there; ronde does not).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Mapping

import torch

from .. import _api, _objects
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
        broadcast_object=lambda obj: _objects.broadcast_object(obj, root_rank, f"{name}.structure",
                                                           process_set))


def _create_state(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's state initialisation: one step of the inner optimizer on zero gradients."""
    from .optimizer import _DistributedMixin

    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    as_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        zero = torch.zeros_like(p)
        p.grad = zero.to_sparse() if as_sparse or id(p) in sparse else zero
    # a zero-gradient step still moves parameters under weight decay (AdamW, SGD's
    # weight_decay), by each rank's own learning rate before the root's is received:
    # put them back, so broadcast_parameters() before this stays in force (Horovod
    # leaves the ranks' parameters apart there)
    decays = any(g.get("weight_decay", 0) for g in optimizer.param_groups)
    kept = [p.detach().clone() for p in params] if decays else []
    if isinstance(optimizer, _DistributedMixin):
        super(_DistributedMixin, optimizer).step()  # type: ignore[misc]
    else:
        optimizer.step()
    with torch.no_grad():
        for p, k in zip(params, kept):
            p.copy_(k)


def _broadcast_hyperparameters(optimizer: Any, root_rank: int,
                               process_set: ProcessSet) -> None:
    """A ``ShardedOptimizer``: each rank's state is its own slice (the moments of the
    elements it owns), so only what is replicated is sent: the param groups'
    hyperparameters (``lr``, ``betas``, ``weight_decay``...). The step counts are equal
    on every rank already (every rank steps together, and ``load_sharded`` reads them
    from the same files); no state is created before the first step (it would count
    one step too many)."""
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    got = _objects.broadcast_object(hyper, root_rank, "broadcast_optimizer_state.sharded",
                                    process_set)
    if len(got) != len(optimizer.param_groups):
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank} has {len(got)} param "
                         f"groups, this rank {len(optimizer.param_groups)}; make the same "
                         "optimizer on every rank")
    for group, values in zip(optimizer.param_groups, got):
        group.update(values)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state (and hyperparameters) equal to ``root_rank``'s.

    Before the first step the state is created first, as Horovod does: every trainable
    parameter gets a zero gradient and the wrapped optimizer steps once (momentum
    buffers, Adam moments and ``step`` counts then exist on every rank). Accepts a plain
    optimizer or a ``DistributedOptimizer``. A ``ShardedOptimizer`` keeps its own
    slices (each rank's state is a different part): only the param groups'
    hyperparameters come from ``root_rank``, at the start, after steps or after
    ``load_sharded``.

    Args:
        optimizer: the optimizer whose ``state_dict()`` is sent.
        root_rank: the rank whose state everyone gets.
        model: optional; its sparse ``nn.Embedding`` parameters get sparse zero gradients
            for that first step (as in Horovod).
        process_set: the ranks taking part (default: all).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support LBFGS")
    if isinstance(model, ProcessSet):  # ronde's earlier order: process_set third
        model, process_set = None, model
    from .sharded import is_sharded

    if is_sharded(optimizer):
        _broadcast_hyperparameters(optimizer, root_rank, process_set)
        return
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer, model)
    sd = optimizer.state_dict() if _api.rank() == root_rank else None
    got = broadcast_state(sd, root_rank, "broadcast_optimizer_state", process_set)
    if _api.rank() != root_rank:
        optimizer.load_state_dict(got)


def save_checkpoint(obj: Any, path: str | os.PathLike[str], root_rank: int = 0) -> bool:
    """``torch.save(obj, path)`` on ``root_rank``, atomically: ``path`` holds the previous
    checkpoint or the new one, never a torn file, even when a peer's failure stops this
    rank mid-save (see ronde/checkpoint.py). No collective: call it on every rank or
    under ``if hvd.rank() == 0``. Returns True where it wrote."""
    from ..checkpoint import atomic_save, on_root

    if not on_root(root_rank):
        return False
    atomic_save(path, lambda fh: torch.save(obj, fh))
    return True
