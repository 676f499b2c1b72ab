"""Checkpoints of a ``ShardedOptimizer`` that load at any world size, with no conversion:
the steps of :mod:`ronde.frameworks.sharded_files` in torch files (:class:`~ronde.torch._codec.TorchCodec`),
pieces keyed by the parameters' names.

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

import contextlib
import os
from typing import Any

import torch

from .._errors import UnsupportedError
from ..frameworks import sharded_files
from ..process_sets import global_process_set
from ._codec import TORCH, TorchCodec  # noqa: F401 - (where it was)
from ._whole_state import gather_whole
from .sharded import is_sharded


#: the model's file of a step (``{id}``: the step's id); ``model.pt`` in format 1
MODEL = "model.{id}.pt"
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


def _params(optimizer: Any, model: Any) -> dict[str, sharded_files.Param]:
    """Every parameter of the optimizer (not only this rank's pieces), by name: its
    shape and dtype, the same on every rank."""
    if is_sharded(optimizer):
        layout = optimizer.shard_layout
        pairs = [(n, s, p.dtype) for n, s, p in zip(layout.names, layout.shapes,
                                                        layout.params)]
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        pairs = [(names[id(p)], p.shape, p.dtype) for g in optimizer.param_groups
                 for p in g["params"] if id(p) in names]
    return {n: (list(s), str(d).replace("torch.", "")) for n, s, d in pairs}


def snapshot(optimizer: Any, pieces: list[tuple[str, int, int, torch.Tensor, int]]
             ) -> list[sharded_files.Piece]:
    """``pieces``' state in ``optimizer`` (``Layout.shard_pieces()``, or :func:`_pieces`),
    copied (the step counts too: Adam adds to its in place), each slot flat: what the
    checkpoints write and the elastic handler keeps (a copy, not a view: ``torch.save``
    of a view writes its whole storage)."""
    return [(name, a, b, {k: _copied(v) for k, v in optimizer.state.get(t, {}).items()})
            for name, a, b, t, _ in pieces]


def _copied(value: Any) -> Any:
    if not torch.is_tensor(value):
        return value
    return (value.detach().reshape(-1) if value.dim() > 0 else value.detach()).clone()


def hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (all but its parameters)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def save_sharded(directory: str | os.PathLike[str], model: Any, optimizer: Any) -> None:
    """Write this rank's part of ``optimizer`` (and, on rank 0, ``model``) to
    ``directory`` (a folder every rank can reach) as one step: loaded whole, or not at
    all, never beside another step's files. Every rank must call it."""
    rank, size, process_set = 0, 1, global_process_set
    if is_sharded(optimizer):
        layout = optimizer.shard_layout
        rank, size, process_set = layout.rank, layout.size, layout.process_set
    scalars = {"param_groups": hyperparameters(optimizer),
               "optimizer": type(optimizer).__name__, "params": _params(optimizer, model)}
    with _whole(optimizer):  # (stage 3: every rank makes the parameters whole)
        sharded_files.save(directory, snapshot(optimizer, _pieces(optimizer, model)),
                           scalars, FORMAT, rank, size, process_set,
                           None if model is None else (
                               MODEL, {"write": lambda fh: torch.save(model.state_dict(), fh)}),
                           TORCH)


def _whole(optimizer: Any) -> Any:
    """``ShardedOptimizer.whole_parameters()`` (stage 3's parameters whole), or nothing."""
    return optimizer.whole_parameters() if is_sharded(optimizer) else contextlib.nullcontext()


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
    directory, meta = sharded_files.read_meta(directory, FORMAT, "model.pt", TORCH)
    if not is_sharded(optimizer) and model is None:
        raise ValueError("load_sharded with a plain optimizer needs the model, whose "
                         "named_parameters() name its parameters")
    sharded_files.check_params(directory, meta, _params(optimizer, model))
    if model is not None:
        with sharded_files.open_model(directory, meta, TORCH) as fh, _whole(optimizer):
            model.load_state_dict(torch.load(fh, weights_only=True))
    mine = _pieces(optimizer, model)
    got = sharded_files.load(directory, meta, [(name, a, b) for name, a, b, _, _ in mine],
                             TORCH)
    for (_, _, _, tensor, _), state in zip(mine, got):
        if state:  # none saved for a piece that never stepped
            optimizer.state[tensor] = {k: (v.view(tensor.shape) if torch.is_tensor(v)
                                           and v.dim() > 0 else v) for k, v in state.items()}
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise UnsupportedError(f"{directory}: {len(meta['param_groups'])} param groups saved, "
                               f"the optimizer has {len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        group.update(saved)


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
