"""Checkpoints of a ``ShardedOptimizer`` that load at any world size, with no conversion.

``save_sharded(dir, model, optimizer)`` (every rank calls it) writes one *step*::

    dir/optim.<id>.<r>-of-<N>.pt   each rank: its pieces, (parameter name, start, end),
                                   and each piece's optimizer state (tensor slices)
    dir/model.<id>.pt              rank 0: model.state_dict() (if a model is given)
    dir/meta.pt                    rank 0, last: N, every file of the step and its size,
                                   every file's pieces, the param groups' hyperparameters,
                                   every parameter's shape and dtype by name

``<id>`` is new at every save: the step's files never replace the previous step's, and
``meta.pt``, replaced atomically once every file is complete, is what makes the step
the folder's checkpoint (:class:`ronde.checkpoint.ShardedSave`): a save cut short at
any point (Ctrl-C, a crash) leaves the previous step whole, model and optimizer
together, and the next save removes what it left.

``load_sharded(dir, model, optimizer)`` reads ``meta.pt`` and, for each of this rank's
pieces, only the files whose pieces overlap it: at any N, including a plain optimizer in
one process (which then holds the whole state, as ``optimizer.state_dict()`` would: the
export). A plain optimizer's checkpoint saved with ``save_sharded`` is one file of whole
parameters and loads into a ``ShardedOptimizer`` the same way. Files are read with
``torch.load(weights_only=True)``: tensors and plain values, never arbitrary objects;
only files of the folder that ``meta.pt`` names, regular files of the size it recorded
(:func:`ronde.checkpoint.open_member`).
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from .. import _api, _objects
from .._errors import RondeError, UnsupportedError
from ..checkpoint import (begin_sharded_save, check_sharded_index, open_member, previous_step,
                          read_index, sharded_file_names)
from ..process_sets import global_process_set
from ._whole_state import gather_whole
from .sharded import is_sharded


META = "meta.pt"
#: the model's file in a folder of format 1 (before each step's files had its id)
LEGACY_MODEL = "model.pt"
FORMAT = "ronde.sharded/2"


def _pieces(optimizer: Any, model: Any) -> list[tuple[str, int, int, torch.Tensor, int]]:
    """``(name, start, end, tensor, group)`` of every part of a parameter this rank keeps
    state for: a ``ShardedOptimizer``'s pieces, or a plain optimizer's whole parameters
    (named by ``model.named_parameters()``)."""
    if is_sharded(optimizer):
        return optimizer.shard_layout.shard_pieces()
    if model is None:
        raise ValueError("save_sharded/load_sharded with a plain optimizer need the model, "
                         "whose named_parameters() name its parameters")
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("a parameter of the optimizer is not in model.named_parameters()")
            out.append((names[id(p)], 0, p.numel(), p, g))
    return out


def _table(optimizer: Any, model: Any) -> dict[str, tuple[list[int], str]]:
    """Every parameter of the optimizer (not only this rank's pieces), by name: its
    shape and dtype, the same on every rank."""
    if is_sharded(optimizer):
        layout = optimizer.shard_layout
        pairs = list(zip(layout.names, layout.params))
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        pairs = [(names[id(p)], p) for g in optimizer.param_groups for p in g["params"]
                 if id(p) in names]
    return {n: (list(p.shape), str(p.dtype).replace("torch.", "")) for n, p in pairs}


def _check_table(directory: str, meta: dict[str, Any], mine: dict[str, tuple[list[int], str]]
                 ) -> None:
    """Refuse a checkpoint whose parameters are not this optimizer's (renamed, another
    shape or dtype, missing, extra), naming them, before anything is loaded; a folder
    saved before shapes were stored is checked by names and element counts."""
    saved = meta.get("params")
    if not isinstance(saved, dict):  # format 1 and early 2: the pieces give the sizes
        saved = {}
        for entries in meta["pieces"]:
            for name, _, end in entries:
                saved[name] = max(saved.get(name, 0), end)
        have = {n: int(torch.Size(shape).numel()) for n, (shape, _) in mine.items()}
    else:
        saved = {n: (list(shape), dtype) for n, (shape, dtype) in saved.items()}
        have = {n: (list(shape), dtype) for n, (shape, dtype) in mine.items()}
    problems = [f"{n!r} is not in the checkpoint" for n in have if n not in saved]
    problems += [f"{n!r} is in the checkpoint but not in this optimizer" for n in saved
                 if n not in have]
    problems += [f"{n!r} was saved as {_describe(saved[n])}, is {_describe(have[n])} now"
                 for n in have if n in saved and saved[n] != have[n]]
    if problems:
        raise RondeError(
            f"{directory}: the checkpoint's parameters are not this optimizer's: "
            f"{'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}. Build the "
            "model as it was saved (the same names, shapes and dtypes) and load into it; "
            "to change the model, start its optimizer afresh")


def _describe(entry: Any) -> str:
    if isinstance(entry, int):
        return f"{entry} elements"
    shape, dtype = entry
    return f"{dtype}{list(shape)}"


def _hyper(optimizer: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def save_sharded(directory: str | os.PathLike[str], model: Any, optimizer: Any) -> None:
    """Write this rank's part of ``optimizer`` (and, on rank 0, ``model``) to
    ``directory`` (a folder every rank can reach) as one step: loaded whole, or not at
    all, never beside another step's files. Every rank must call it."""
    directory = os.fspath(directory)
    sharded = is_sharded(optimizer)
    layout = optimizer.shard_layout if sharded else None
    ps = layout.process_set if layout else global_process_set
    many = layout is not None and not layout.solo
    rank, size = (layout.rank, layout.size) if layout else (0, 1)

    def names(token: str) -> list[str]:
        return [*sharded_file_names(token, size, ".pt"),
                *([f"model.{token}.pt"] if model is not None else [])]

    step = begin_sharded_save(directory, META, many, not many or rank == 0, ps, names,
                              lambda: previous_step(directory, META,
                                                    lambda: _read_meta(directory)))
    pieces = _pieces(optimizer, model)
    entries = [(name, a, b) for name, a, b, _, _ in pieces]
    nbytes = 0
    if step.writer:
        state = optimizer.state
        states = [{k: (v.detach().reshape(-1).clone() if torch.is_tensor(v) and v.dim() > 0
                       else v) for k, v in state.get(t, {}).items()}
                  for _, _, _, t, _ in pieces]
        nbytes = step.write(sharded_file_names(step.token, size, ".pt")[rank],
                            lambda fh: torch.save({"pieces": entries, "state": states}, fh))
    index = [(entries, nbytes)]
    if many:
        index = _objects.allgather_object(index[0], "ronde.save_sharded.index", ps)
    if step.committer:
        meta = {"format": FORMAT, "id": step.token, "world_size": size,
                "files": sharded_file_names(step.token, size, ".pt"),
                "sizes": [n for _, n in index],
                "pieces": [e for e, _ in index], "param_groups": _hyper(optimizer),
                "optimizer": type(optimizer).__name__, "model": None, "model_size": None,
                "params": _table(optimizer, model)}
        if model is not None:
            meta["model"] = f"model.{step.token}.pt"
            meta["model_size"] = step.write(meta["model"],
                                            lambda fh: torch.save(model.state_dict(), fh))
        step.commit(lambda fh: torch.save(meta, fh), names(step.token))
    if step.together:
        _api.barrier(process_set=ps)


def _read_meta(directory: str) -> dict[str, Any]:
    """``directory``'s ``meta.pt``, checked (:func:`~ronde.checkpoint.check_sharded_index`)."""
    meta = torch.load(io.BytesIO(read_index(directory, META)), weights_only=True)
    return check_sharded_index(meta, os.path.join(directory, META), FORMAT, LEGACY_MODEL)


def load_sharded(directory: str | os.PathLike[str], model: Any, optimizer: Any) -> None:
    """Load ``model`` (if given) and this rank's part of ``optimizer`` from a folder that
    :func:`save_sharded` wrote, whatever the world size it was written at: the step its
    ``meta.pt`` names, model and optimizer together.

    Raises:
        FileNotFoundError: no ``meta.pt``, or a file it names is missing.
        RondeError: a file it names is not a regular file of the folder or not of the
            recorded size, the saved parameters differ from the optimizer's (a name, a
            shape or a dtype; named, before anything is loaded), or the state does not
            cover this rank's pieces.
    """
    directory = os.fspath(directory)
    meta = _read_meta(directory)
    where = os.path.join(directory, META)
    if not is_sharded(optimizer) and model is None:
        raise ValueError("load_sharded with a plain optimizer needs the model, whose "
                         "named_parameters() name its parameters")
    _check_table(directory, meta, _table(optimizer, model))
    if model is not None:
        if not meta["model"]:
            raise RondeError(f"{where}: saved without a model; pass model=None")
        with open_member(directory, meta["model"], meta["model_size"], where) as fh:
            model.load_state_dict(torch.load(fh, weights_only=True))
    mine = _pieces(optimizer, model)
    wanted: dict[str, list[tuple[int, int, int]]] = {}
    for k, (name, a, b, _, _) in enumerate(mine):
        wanted.setdefault(name, []).append((a, b, k))
    got: list[dict[str, Any]] = [{} for _ in mine]
    covered = [0] * len(mine)
    for f, nbytes, entries in zip(meta["files"], meta["sizes"], meta["pieces"]):
        if not any(n in wanted and any(a < e and s < b for a, b, _ in wanted[n])
                   for n, s, e in entries):
            continue  # nothing of this rank's in that file
        with open_member(directory, f, nbytes, where) as fh:
            saved = torch.load(fh, weights_only=True)
        for (name, s, e), state in zip(saved["pieces"], saved["state"]):
            for a, b, k in wanted.get(name, ()):
                lo, hi = max(a, s), min(b, e)
                if lo >= hi:
                    continue
                covered[k] += hi - lo
                _merge(got[k], state, lo - a, lo - s, hi - lo, b - a)
    for k, (name, a, b, tensor, _) in enumerate(mine):
        if not got[k]:
            continue  # no state saved for it (never stepped)
        if covered[k] != b - a:
            raise RondeError(f"{directory}: the optimizer state of {name!r} [{a}:{b}] is only "
                             f"{covered[k]} of {b - a} elements in the files")
        optimizer.state[tensor] = {key: (v.view(tensor.shape) if torch.is_tensor(v)
                                         and v.dim() > 0 else v) for key, v in got[k].items()}
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise UnsupportedError(f"{directory}: {len(meta['param_groups'])} param groups saved, "
                               f"the optimizer has {len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        group.update(saved)


def _merge(into: dict[str, Any], state: dict[str, Any], at: int, src: int, n: int,
           length: int) -> None:
    """Copy ``n`` elements of a saved piece's ``state`` from ``src`` into this rank's
    piece's state at ``at`` (``length`` elements in all); scalars as they are."""
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            dst = into.get(key)
            if dst is None:
                dst = into[key] = torch.zeros(length, dtype=value.dtype)
            dst[at:at + n].copy_(value[src:src + n])
        elif key not in into:
            into[key] = value.clone() if torch.is_tensor(value) else value


def gather_sharded(optimizer: Any, root: int = 0) -> dict[str, Any] | None:
    """The whole state of a ``ShardedOptimizer``, in a running job, as the wrapped
    optimizer's own ``state_dict()`` would give it, on rank ``root`` of its process set
    (None on the others); every member calls it. Load it into a plain optimizer over the
    same parameters with ``load_state_dict``. ``root`` is a rank of the optimizer's
    process set (its index there); a rank outside the set, whose optimizer steps alone,
    gets its own whole state.

    Nothing is held twice: each state tensor of each parameter moves on its own, in one
    alltoall in which only ``root`` receives (every rank's slice, in rank order, which is
    the tensor's element order), into the tensor ``root`` keeps; no rank holds more than
    its own slices and, on ``root``, the result. The scalar state (Adam's ``step``) and
    which tensors exist travel in one small object allgather first.
    """
    if not is_sharded(optimizer):
        raise TypeError("gather_sharded() takes a ShardedOptimizer; a plain optimizer's "
                        "state_dict() holds the whole state already")
    return gather_whole(optimizer.shard_layout, optimizer.state, optimizer.param_groups, root)
