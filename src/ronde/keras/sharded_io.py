"""Checkpoints of a Keras ``ShardedOptimizer`` that load at any world size, with no
conversion: the Keras counterpart of :mod:`ronde.torch.sharded_io`, with the same
layout in numpy files.

``save_sharded(dir, model, optimizer)`` (every rank calls it) writes::

    dir/optim.<id>.<r>-of-<N>.npz   each rank: for each *piece* (a range [a, b) of one
                                    variable's flat elements that its shard covers) the
                                    optimizer's slots over it ("<piece>.<slot>")
    dir/model.weights.h5            rank 0: model.save_weights (if a model is given)
    dir/meta.json                   rank 0, last: N, every file's pieces
                                    ("<index>:<shape>" of the variable, a, b), the
                                    slots, the step count

Every file is written atomically and ``meta.json`` only after every rank's file is
complete; the previous save's files (another ``<id>``) are removed after it, so a save cut
short leaves the previous checkpoint whole. A slot is named by what the optimizer calls
it (``momentum``, ``velocity``...): Keras names a slot variable ``<variable path>_<slot>``.

``load_sharded(dir, model, optimizer)`` reads ``meta.json`` and, for this rank's pieces,
only the files whose pieces overlap them: at any N, and into a plain Keras optimizer in
one process (which then holds the whole state: the export), or from a plain optimizer's
save. Files are read with ``allow_pickle=False``: arrays only.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any

import numpy as np

from .. import _api, _objects
from .._errors import RondeError
from ..checkpoint import atomic_save, commit_sharded_save, sharded_meta
from ..process_sets import global_process_set
from ._bridge import sync_jax_state, to_numpy
from .sharded import _rank_size, is_sharded

META = "meta.json"
MODEL = "model.weights.h5"
FORMAT = "ronde.keras.sharded/1"

#: (variable key, a, b, the slots' arrays over [a, b) as (slot, variable, offset))
_Piece = tuple[str, int, int, list[tuple[str, Any, int]]]


def _slot_name(owner: Any, slot: Any) -> str | None:
    """``slot``'s kind if it is a slot variable of ``owner`` (Keras' naming), else None."""
    prefix = owner.path.replace("/", "_") + "_"
    return slot.name[len(prefix):] if slot.name.startswith(prefix) else None


def _slots_of(optimizer: Any, owners: list[Any]) -> list[list[tuple[str, Any]]]:
    """Each owner's slot variables in ``optimizer`` as (kind, variable); the longest
    matching owner wins where one path is a prefix of another."""
    out: list[list[tuple[str, Any]]] = [[] for _ in owners]
    for v in optimizer.variables:
        best = None
        for i, owner in enumerate(owners):
            kind = _slot_name(owner, v)
            if kind is not None and tuple(v.shape) == tuple(owner.shape) and (
                    best is None or len(kind) < len(best[1])):
                best = (i, kind)
        if best is not None:
            out[best[0]].append((best[1], v))
    return out


def _pieces(optimizer: Any, model: Any) -> tuple[list[_Piece], Any]:
    """This rank's pieces and the optimizer whose ``iterations`` count the steps."""
    if is_sharded(optimizer):
        inner = optimizer.inner_optimizer
        variables = list(optimizer._trainable_variables)
        slots = _slots_of(inner, optimizer._ronde_shards)
        pieces: list[_Piece] = []
        for g, shard_slots in zip(optimizer._ronde_groups, slots):
            offsets = np.cumsum([0] + g.sizes)
            lo = _rank_size(optimizer._ronde_cfg["process_set"])[0] * g.per
            for k, a, b in g.mine:
                pieces.append((_key(variables, g.ids[k]), a, b, [(kind, s, int(offsets[k]) + a - lo)
                                              for kind, s in shard_slots]))
        return pieces, inner
    variables = list(getattr(optimizer, "_trainable_variables", None) or [])
    if not variables:
        raise ValueError("save_sharded/load_sharded: the optimizer has not been built; "
                         "compile and fit the model (or call optimizer.build("
                         "model.trainable_variables)) first")
    slots = _slots_of(optimizer, variables)
    return [(_key(variables, i), 0, int(np.prod(v.shape)), [(kind, s, 0) for kind, s in own])
            for i, (v, own) in enumerate(zip(variables, slots))], optimizer


def _key(variables: list[Any], i: int) -> str:
    """A variable's key in the files: its place among the trainable variables and its
    shape (Keras' own weight files go by order too: the paths Keras generates change
    with how many models the process made before)."""
    return f"{i}:{'x'.join(map(str, variables[i].shape))}"


def save_sharded(directory: str | os.PathLike[str], model: Any, optimizer: Any) -> None:
    """Write this rank's part of ``optimizer`` (and, on rank 0, ``model``'s weights) to
    ``directory`` (a folder every rank can reach). Every rank must call it."""
    directory = os.fspath(directory)
    if model is not None:
        sync_jax_state(model)
    sharded = is_sharded(optimizer)
    ps = optimizer._ronde_cfg["process_set"] if sharded else global_process_set
    rank, size = _rank_size(ps) if sharded else (0, 1)
    many = size > 1
    together = _api.is_initialized() and _api.size() > 1
    writer = many or not together or _api.rank() == 0
    token = secrets.token_hex(6)
    if many:
        token = _objects.broadcast_object(token, ps.ranks[0] if ps.ranks else 0,
                                          "ronde.save_sharded.id", ps)
    os.makedirs(directory, exist_ok=True)
    pieces, counter = _pieces(optimizer, model)
    if writer:
        arrays = {f"{i}.{kind}": to_numpy(s).reshape(-1)[at:at + b - a]
                  for i, (_, a, b, slots) in enumerate(pieces) for kind, s, at in slots}
        atomic_save(os.path.join(directory, f"optim.{token}.{rank}-of-{size}.npz"),
                    lambda fh: np.savez(fh, **arrays))
    index = [[(path, a, b, [kind for kind, _, _ in slots]) for path, a, b, slots in pieces]]
    if many:
        index = _objects.allgather_object(index[0], "ronde.save_sharded.index", ps)
    if (rank == 0) and writer:
        if model is not None:
            atomic_save(os.path.join(directory, MODEL), write_path=model.save_weights)
        meta = {"format": FORMAT, "id": token, "world_size": size,
                "files": [f"optim.{token}.{r}-of-{size}.npz" for r in range(size)],
                "pieces": index, "iterations": int(to_numpy(counter.iterations)),
                "optimizer": type(optimizer).__name__}
        commit_sharded_save(directory, META, lambda fh: fh.write(json.dumps(meta).encode()),
                            token, ".npz")
    if together:
        _api.barrier(process_set=ps)


def load_sharded(directory: str | os.PathLike[str], model: Any, optimizer: Any) -> None:
    """Load ``model``'s weights (if given) and this rank's part of ``optimizer`` (built
    here over ``model.trainable_variables`` if it was not) from a folder that
    :func:`save_sharded` wrote, whatever the world size it was written at."""
    directory, meta_path = sharded_meta(directory, META)
    with open(meta_path, "rb") as fh:
        meta = json.loads(fh.read())
    if meta.get("format") != FORMAT:
        raise RondeError(f"{meta_path}: unknown format {meta.get('format')!r}")
    if model is not None:
        model.load_weights(os.path.join(directory, MODEL))
        if not getattr(optimizer, "built", False):
            optimizer.build(model.trainable_variables)
    mine, counter = _pieces(optimizer, model)
    wanted: dict[str, list[tuple[int, int, int]]] = {}
    for k, (path, a, b, _) in enumerate(mine):
        wanted.setdefault(path, []).append((a, b, k))
    values = {id(s): to_numpy(s).reshape(-1).copy() for _, _, _, slots in mine
              for _, s, _ in slots}
    covered = [0] * len(mine)
    for f, entries in zip(meta["files"], meta["pieces"]):
        if not any(p in wanted and any(a < e and s < b for a, b, _ in wanted[p])
                   for p, s, e, _ in entries):
            continue  # nothing of this rank's in that file
        with np.load(os.path.join(directory, f), allow_pickle=False) as saved:
            for j, (path, s, e, kinds) in enumerate(entries):
                for a, b, k in wanted.get(path, ()):
                    lo, hi = max(a, s), min(b, e)
                    if lo >= hi:
                        continue
                    covered[k] += hi - lo
                    for kind, slot, at in mine[k][3]:
                        if kind not in kinds:
                            raise RondeError(f"{directory}: slot {kind!r} of {path!r} was not "
                                             f"saved (saved: {kinds}); another optimizer?")
                        values[id(slot)][at + lo - a: at + hi - a] = \
                            saved[f"{j}.{kind}"][lo - s: hi - s]
    for k, (path, a, b, slots) in enumerate(mine):
        if slots and covered[k] != b - a:
            raise RondeError(f"{directory}: the optimizer state of {path!r} [{a}:{b}] is only "
                             f"{covered[k]} of {b - a} elements in the files")
        for _, slot, _ in slots:
            slot.assign(values[id(slot)].reshape(tuple(slot.shape)))
    counter.iterations.assign(meta["iterations"])
    if counter is not optimizer:
        optimizer.iterations.assign(meta["iterations"])
    if model is not None:
        from ._bridge import mark_variables_changed

        mark_variables_changed(model)
