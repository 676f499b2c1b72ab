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

from .. import _objects
from .._errors import RondeError
from . import _collectives as C
from ._elementwise import slice_state
from ._shards import Layout


def gather_whole(layout: Layout, state: dict[torch.Tensor, dict[str, Any]], param_groups: list[dict[str, Any]],
                 root: int | None) -> dict[str, Any] | None:
    """The whole state on rank ``root`` of the layout's process set (None elsewhere);
    ``root`` None: on every rank (an allgather of each tensor instead).

    Nothing is held twice: each state tensor of each parameter moves on its own, in one
    alltoall in which only ``root`` receives (every rank's slice, in rank order, which is
    the tensor's element order), into the tensor ``root`` keeps; no rank holds more than
    its own slices and, on ``root``, the result. The scalar state (Adam's ``step``) and
    which tensors exist travel in one small object allgather first.
    """
    if root is not None and not 0 <= root < layout.size:
        raise ValueError(f"gather_sharded(root={root}): the optimizer's ranks are "
                         f"0..{layout.size - 1}")
    params, pieces = layout.params, layout.pieces
    # what this rank holds of each parameter: its tensors' dtypes, its scalars
    held: dict[int, dict[str, Any]] = {}
    for i, pc in pieces.items():
        tensors, scalars = {}, {}
        for key, v in state.get(pc.tensor, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                tensors[key] = (str(v.dtype).replace("torch.", ""), v.numel())
            else:  # a 0-dim tensor (Adam's step) or a number: kept with its type
                scalars[key] = (v.item(), str(v.dtype).replace("torch.", "")) \
                    if torch.is_tensor(v) else (v, None)
        held[i] = {"tensors": tensors, "scalars": scalars}
    every = ([held] if layout.solo else
             _objects.allgather_object(held, "ronde.gather_sharded.held", layout.process_set))
    me = layout.rank if root is not None else None  # None: every rank keeps the result
    out: dict[int, dict[str, Any]] = {}
    order = layout.full_order()
    kinds_of: dict[int, dict[str, str]] = {}
    for i in order:  # every rank decides alike, from the same lists, before anything moves
        kinds_of[i] = kinds = {key: dt for h in every
                               for key, (dt, _) in h.get(i, {}).get("tensors", {}).items()}
        for key in kinds:
            n = sum(h[i]["tensors"][key][1] for h in every
                    if i in h and key in h[i]["tensors"])
            if n != params[i].numel():
                raise RondeError(f"gather_sharded: the {key!r} state of {layout.names[i]!r} "
                                 f"is {n} elements on the ranks together, not the "
                                 f"parameter's {params[i].numel()} (a state not shaped like "
                                 "its parameter, or missing on a rank)")
    for k, i in enumerate(order):
        kinds = kinds_of[i]
        whole_state: dict[str, Any] = {}
        for key in sorted(kinds):
            dtype = getattr(torch, kinds[key])
            pc = pieces.get(i)
            mine = (state[pc.tensor][key].detach().reshape(-1)
                    if pc is not None and key in state.get(pc.tensor, {})
                    else torch.empty(0, dtype=dtype))
            if layout.solo:
                whole = mine.clone()
            elif root is None:
                whole = C.allgather_async(mine, f"ronde.gather_sharded.{i}.{key}",
                                          layout.process_set).wait()
            else:
                splits = [0] * layout.size
                splits[root] = mine.numel()
                whole, _ = C.alltoall_async(mine, splits, f"ronde.gather_sharded.{i}.{key}",
                                            layout.process_set).wait()
            if me == root:
                whole_state[key] = whole.view(params[i].shape)
        if me == root:
            for h in every:  # the scalars of the first rank that holds a piece
                if i in h:
                    for key, (value, dt) in h[i]["scalars"].items():
                        whole_state[key] = torch.tensor(value, dtype=getattr(torch, dt)) \
                            if dt is not None else value
                    break
            if whole_state:
                out[k] = whole_state
    if me != root:
        return None
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
        p = layout.params[i]
        for key, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                raise RondeError(
                    f"ShardedOptimizer.load_state_dict: the {key!r} state of "
                    f"{layout.names[i]!r} has shape {tuple(v.shape)}, the parameter "
                    f"{tuple(p.shape)}; {fix}")
        pc = layout.pieces.get(i)
        if pc is not None:
            out[pc.tensor] = {key: (v.to(p.dtype) if torch.is_tensor(v) and v.dim() > 0
                                    and v.is_floating_point() else v)
                              for key, v in slice_state(st, p, pc.a, pc.b, pc.name).items()}
    hyper = [{key: v for key, v in g.items() if key != "params"} for g in saved]
    return out, hyper
