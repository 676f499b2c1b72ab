"""A ``ShardedOptimizer``'s state as one optimizer's whole ``state_dict()``, and back.

``gather_whole`` (every member calls it) puts the whole state on one rank, shaped as the
wrapped optimizer's own ``state_dict()`` would be for one process; ``slice_whole`` cuts
such a dict (saved by one process, by a ``ShardedOptimizer`` at any N, or by a plain
optimizer over the same parameters) to this rank's pieces. They give the optimizer its
``consolidate_state_dict``/``state_dict``/``load_state_dict`` (the path Lightning's and
Hugging Face Trainer's own checkpoints take) and ``hvd.gather_sharded``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import RondeError
from ..frameworks import sharded_files
from ._codec import TORCH
from ._elementwise import slice_state
from ._shards import Layout


def gather_whole(layout: Layout, state: dict[torch.Tensor, dict[str, Any]],
                 param_groups: list[dict[str, Any]], root: int | None) -> dict[str, Any] | None:
    """The whole state on rank ``root`` of the layout's process set (None elsewhere);
    ``root`` None: on every rank (an allgather of each tensor instead).

    The export every binding shares (:func:`ronde.frameworks.sharded_files.gather`, with
    torch's codec: tensors move as tensors): nothing is held twice, each state tensor
    of each parameter moves on its own, in one alltoall in which only ``root`` receives,
    after one small object allgather of what each rank holds (the scalar state, Adam's
    ``step``, travels there).
    """
    if root is not None and not 0 <= root < layout.size:
        raise ValueError(f"gather_sharded(root={root}): the optimizer's ranks are "
                         f"0..{layout.size - 1}")
    shapes, names, order = layout.shapes, layout.names, layout.full_order()
    mine = [(names[i], pc.a, pc.b, state.get(pc.tensor, {})) for i, pc in layout.pieces.items()]
    got = sharded_files.gather(mine, {names[i]: shapes[i].numel() for i in order}, root,
                               "ronde.gather_sharded", layout.process_set, TORCH,
                               (0, 1) if layout.solo else (layout.rank, layout.size))
    if got is None:
        return None
    out: dict[int, dict[str, Any]] = {}
    for k, i in enumerate(order):
        whole = got.get(names[i])
        if whole:
            out[k] = {key: v.view(shapes[i]) if TORCH.is_array(v) else v
                      for key, v in sorted(whole.items())}
    return {"state": out, "param_groups": whole_groups(layout, param_groups)}


def whole_groups(layout: Layout, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups of a whole ``state_dict()``: the hyperparameters, and every
    parameter's index (not only this rank's pieces)."""
    groups, at = [], 0
    for group, members in zip(param_groups, layout.groups):
        groups.append({**{key: v for key, v in group.items() if key != "params"},
                       "params": list(range(at, at + len(members)))})
        at += len(members)
    return groups


def slice_whole(layout: Layout, state_dict: Any) -> tuple[dict[torch.Tensor, Any],
                                                           list[dict[str, Any]]]:
    """This rank's pieces' state (by piece) and the param groups' hyperparameters, from
    a whole ``state_dict()``; a dict of another shape is refused, naming what differs.

    Raises:
        RondeError: not a whole state dict (one rank's part, another model's), naming
            the group or the parameter and the fix.
    """
    fix = ("save the whole state: opt.consolidate_state_dict() on every rank, then "
           "opt.state_dict() on rank 0 (Lightning's strategy='ronde' does; Hugging Face "
           "Trainer: callbacks=[hvd.ConsolidateOptimizerState()]), or hvd.save_sharded/"
           "load_sharded")
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), list):
        raise RondeError(f"ShardedOptimizer.load_state_dict: not an optimizer state_dict; {fix}")
    saved = state_dict["param_groups"]
    sizes = [len(g) for g in layout.groups]
    if [len(g.get("params", ())) for g in saved] != sizes:
        raise RondeError("ShardedOptimizer.load_state_dict: the state_dict's param groups "
                         f"hold {[len(g.get('params', ())) for g in saved]} parameters, this "
                         f"optimizer's {sizes}: another model's or optimizer's, or one "
                         f"rank's part of a sharded state; {fix}")
    order, where, at = layout.full_order(), {}, 0
    for g, n in zip(saved, sizes):
        where.update({int(k): i for k, i in zip(g["params"], order[at:at + n])})
        at += n
    out: dict[torch.Tensor, Any] = {}
    for k, st in state_dict["state"].items():
        i = where.get(int(k))
        if i is None:
            raise RondeError(f"ShardedOptimizer.load_state_dict: state for parameter {k}, "
                             "which no param group names")
        p, shape = layout.params[i], layout.shapes[i]
        for key, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != shape:
                raise RondeError(
                    f"ShardedOptimizer.load_state_dict: the {key!r} state of "
                    f"{layout.names[i]!r} has shape {tuple(v.shape)}, the parameter "
                    f"{tuple(shape)}; {fix}")
        pc = layout.pieces.get(i)
        if pc is not None:
            out[pc.tensor] = {key: (v.to(p.dtype) if torch.is_tensor(v) and v.dim() > 0
                                    and v.is_floating_point() else v)
                              for key, v in slice_state(st, shape, pc.a, pc.b,
                                                        pc.name).items()}
    hyper = [{key: v for key, v in g.items() if key != "params"} for g in saved]
    return out, hyper
