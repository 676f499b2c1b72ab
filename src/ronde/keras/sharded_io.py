"""Checkpoints of a Keras ``ShardedOptimizer`` that load at any world size, with no
conversion: the files of :mod:`ronde.frameworks.sharded_files` plus the model's weights.

``save_sharded(dir, model, optimizer)`` (every rank calls it) writes each rank's pieces
(a range [a, b) of one variable's flat elements that its shard covers, keyed
``"<index>:<shape>"`` by the variable's place among the trainable variables) with the
optimizer's slots over them, ``dir/model.<id>.weights.h5`` (rank 0, ``model.save_weights``,
if a model is given) and ``dir/meta.json`` last, with the step count: one step, whole
or not at all (``<id>`` new at every save). A slot is named by
what the optimizer calls it (``momentum``, ``velocity``...): Keras names a slot variable
``<variable path>_<slot>``.

``load_sharded(dir, model, optimizer)`` reads, for this rank's pieces, only the files
whose pieces overlap them: at any N, and into a plain Keras optimizer in one process
(which then holds the whole state: the export), or from a plain optimizer's save.

``gather_sharded(optimizer, root=0)`` is the export in a running job: on rank ``root`` a
plain optimizer of the wrapped class, built over the same variables, holding the whole
state; None on the other ranks; nothing held twice
(:func:`ronde.frameworks.sharded_files.gather`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._errors import RondeError
from ..frameworks import sharded_files
from ..process_sets import global_process_set, shard_position
from ._bridge import sync_jax_state, to_numpy
from .sharded import is_sharded, variable_key

#: the model's file of a step (``{id}``: the step's id); ``model.weights.h5`` in format 1
MODEL = "model.{id}.weights.h5"
FORMAT = "ronde.keras.sharded/2"

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
        layout = optimizer.shard_layout
        slots = _slots_of(layout.inner, layout.shards)
        return [(pc.name, pc.a, pc.b, [(kind, s, pc.at) for kind, s in slots[pc.span]])
                for pc in layout.pieces_of(layout.rank)], layout.inner
    variables = list(getattr(optimizer, "_trainable_variables", None) or [])
    if not variables:
        raise ValueError("save_sharded/load_sharded: the optimizer has not been built; "
                         "compile and fit the model (or call optimizer.build("
                         "model.trainable_variables)) first")
    slots = _slots_of(optimizer, variables)
    return [(variable_key(variables, i), 0, int(np.prod(v.shape)),
             [(kind, s, 0) for kind, s in own])
            for i, (v, own) in enumerate(zip(variables, slots))], optimizer


def slices(pieces: list[_Piece]) -> list[tuple[str, int, int, dict[str, np.ndarray]]]:
    """``pieces`` with each slot's values over ``[a, b)`` as numpy (copies): what
    checkpoints, the in-job export and the elastic copies send."""
    return [(key, a, b, {kind: np.array(to_numpy(s).reshape(-1)[at:at + b - a])
                         for kind, s, at in slots}) for key, a, b, slots in pieces]


def fill(pieces: list[_Piece], arrays: list[dict[str, np.ndarray]], where: str) -> None:
    """Assign each piece's slots from ``arrays`` (one dict of slot values per piece, empty
    for a piece with no state: never stepped), each slot variable once."""
    values = {id(s): to_numpy(s).reshape(-1).copy() for _, _, _, slots in pieces
              for _, s, _ in slots}
    for (key, a, b, slots), got in zip(pieces, arrays):
        for kind, slot, at in slots:
            if not got:
                continue
            if kind not in got:
                raise RondeError(f"{where}: slot {kind!r} of {key!r} is missing (there: "
                                 f"{sorted(got)}); another optimizer?")
            values[id(slot)][at:at + b - a] = got[kind]
    for _, _, _, slots in pieces:
        for _, slot, _ in slots:
            slot.assign(values[id(slot)].reshape(tuple(slot.shape)))


def save_sharded(directory: str | os.PathLike[str], model: Any, optimizer: Any) -> None:
    """Write this rank's part of ``optimizer`` (and, on rank 0, ``model``'s weights) to
    ``directory`` (a folder every rank can reach). Every rank must call it."""
    if model is not None:
        sync_jax_state(model)
    sharded = is_sharded(optimizer)
    ps = optimizer.process_set if sharded else global_process_set
    rank, size = shard_position(ps) if sharded else (0, 1)
    pieces, counter = _pieces(optimizer, model)
    arrays = slices(pieces)

    sharded_files.save(directory, arrays, {"iterations": int(to_numpy(counter.iterations)),
                                           "optimizer": type(optimizer).__name__},
                       FORMAT, rank, size, ps,
                       None if model is None else (MODEL, {"write_path": model.save_weights}))


def load_sharded(directory: str | os.PathLike[str], model: Any, optimizer: Any) -> None:
    """Load ``model``'s weights (if given) and this rank's part of ``optimizer`` (built
    here over ``model.trainable_variables`` if it was not) from a folder that
    :func:`save_sharded` wrote, whatever the world size it was written at."""
    directory, meta = sharded_files.read_meta(directory, FORMAT, "model.weights.h5")
    if model is not None:
        with sharded_files.open_model(directory, meta):  # a regular file of the folder
            model.load_weights(os.path.join(directory, meta["model"]))
        if not getattr(optimizer, "built", False):
            optimizer.build(model.trainable_variables)
    mine, counter = _pieces(optimizer, model)
    fill(mine, sharded_files.load(directory, meta, [(key, a, b) for key, a, b, _ in mine]),
         directory)
    counter.iterations.assign(meta["iterations"])
    if counter is not optimizer:
        optimizer.iterations.assign(meta["iterations"])
    if model is not None:
        from ._bridge import mark_variables_changed

        mark_variables_changed(model)


def gather_sharded(optimizer: Any, root: int = 0) -> Any:
    """The whole state of a ``ShardedOptimizer``, in a running job: on rank ``root`` of its
    process set (the index there) a plain optimizer of the wrapped class and config,
    built over the same trainable variables, every slot and the step count set (as one
    process that trained alone would hold them; its learning rate the current one);
    None on the other ranks. Every member calls it. Use it to continue in one process
    (``model.compile(optimizer=...)``) or to save with Keras' own tools.

    Each rank sends only its slices, each slot of each variable in one alltoall that only
    ``root`` receives (:func:`ronde.frameworks.sharded_files.gather`).
    """
    if not is_sharded(optimizer):
        raise TypeError("gather_sharded() takes a ShardedOptimizer; a plain optimizer holds "
                        "the whole state already")
    if optimizer.inner_optimizer is None:
        raise ValueError("gather_sharded: the optimizer has not been built (fit or "
                         "apply_gradients first)")
    pieces, counter = _pieces(optimizer, None)
    mine = slices(pieces)
    variables = list(optimizer._trainable_variables)
    lengths = {variable_key(variables, i): int(np.prod(v.shape))
               for i, v in enumerate(variables)}
    got = sharded_files.gather(mine, lengths, root,
                               f"{optimizer.collective_prefix}.gather_sharded",
                               optimizer.process_set)
    if got is None:
        return None
    plain = optimizer.whole_optimizer()
    plain.build(variables)
    for i, own in enumerate(_slots_of(plain, variables)):
        whole = got.get(variable_key(variables, i), {})
        for kind, slot in own:
            if kind in whole:
                slot.assign(whole[kind].reshape(tuple(slot.shape)))
    plain.iterations.assign(int(to_numpy(counter.iterations)))
    rate = getattr(optimizer, "_learning_rate", None)
    if hasattr(rate, "assign") and hasattr(getattr(plain, "_learning_rate", None), "assign"):
        plain._learning_rate.assign(to_numpy(rate))  # a scheduler may have changed it
    return plain
