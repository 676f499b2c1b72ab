"""Sharded-optimizer checkpoints as numpy files, for the bindings whose optimizer state is
arrays (Keras, JAX; torch's own :mod:`ronde.torch.sharded_io` keeps torch files).

A *piece* is a range ``[a, b)`` of one parameter's flat elements, keyed by a string the
binding makes stable across processes (JAX: the leaf's path; Keras: the variable's place
and shape), with the optimizer's *slots* over it (``mu``, ``momentum``...: arrays of
``b - a`` elements). Every rank calls :func:`save` with its pieces; a step holds::

    optim.<id>.<r>-of-<N>.npz   each rank: "<piece>.<slot>" arrays
    <model file with <id>>      the first rank: the binding's model or parameters
    meta.json                   the first rank, last: N, every file of the step and its
                                size, every file's pieces (key, a, b, slots), the
                                binding's scalars

``<id>`` is new at every save and ``meta.json`` is replaced atomically once every file
of the step is complete (:class:`ronde.checkpoint.ShardedSave`): a save cut short
leaves the previous step whole; the next save removes what it left. :func:`load`
reads only the files whose pieces overlap the wanted ones, at any N, and checks every
wanted element arrived. Files are read with ``allow_pickle=False`` (arrays only), and
only the regular files of the folder that ``meta.json`` names, of the sizes it records
(:func:`ronde.checkpoint.open_member`).

:func:`gather` is the in-job export of the same pieces: every slot of every key whole on
one rank of the running job, nothing held twice (one alltoall per key and slot in which
only that rank receives).
"""

from __future__ import annotations

import json
import os
from typing import IO, Any, Callable, Sequence

import numpy as np

from .. import _api, _objects
from .._errors import RondeError
from ..checkpoint import (ShardedSave, begin_sharded_save, check_sharded_index, open_member,
                          previous_step, read_index, sharded_file_names)
from ..process_sets import ProcessSet, global_process_set


META = "meta.json"

#: (key, a, b, {slot: array of b - a elements})
Piece = tuple[str, int, int, dict[str, np.ndarray]]


#: a step's model file: its name (``{id}`` stands for the step's id) and how it is
#: written: ``{"write": fn(open file)}`` or ``{"write_path": fn(path)}``
ModelFile = tuple[str, dict[str, Callable[..., Any]]]


def save(directory: str | os.PathLike[str], pieces: Sequence[Piece], scalars: dict[str, Any],
         fmt: str, rank: int, size: int, process_set: ProcessSet = global_process_set,
         model: ModelFile | None = None) -> None:
    """Write this rank's ``pieces`` as one step; the set's first rank writes ``model``
    (a model's weights) and ``meta.json`` (with ``scalars`` and ``fmt``, a format name
    ending in ``/<version>``). Every rank of the job calls it (``size`` 1: only the
    job's rank 0 writes)."""
    directory = os.fspath(directory)
    ps = process_set
    many = size > 1

    def names(token: str) -> list[str]:
        return [*sharded_file_names(token, size, ".npz"),
                *([model[0].format(id=token)] if model else [])]

    step: ShardedSave = begin_sharded_save(
        directory, META, many, rank == 0, ps, names,
        lambda: previous_step(directory, META,
                              lambda: read_meta(directory, fmt, "")[1]))
    nbytes = 0
    if step.writer:
        arrays = {f"{i}.{slot}": np.ascontiguousarray(v)
                  for i, (_, _, _, slots) in enumerate(pieces) for slot, v in slots.items()}
        nbytes = step.write(sharded_file_names(step.token, size, ".npz")[rank],
                            lambda fh: np.savez(fh, **arrays))
    index = [([(key, a, b, sorted(slots)) for key, a, b, slots in pieces], nbytes)]
    if many:
        index = _objects.allgather_object(index[0], "ronde.save_sharded.index", ps)
    if step.committer:
        meta = {"format": fmt, "id": step.token, "world_size": size,
                "files": sharded_file_names(step.token, size, ".npz"),
                "sizes": [n for _, n in index],
                "pieces": [e for e, _ in index], "model": None, "model_size": None,
                **scalars}
        if model is not None:
            meta["model"] = model[0].format(id=step.token)
            meta["model_size"] = step.write(meta["model"], **model[1])
        step.commit(lambda fh: fh.write(json.dumps(meta).encode()), names(step.token))
    if step.together:
        _api.barrier(process_set=ps)


def read_meta(directory: str | os.PathLike[str], fmt: str, legacy_model: str
              ) -> tuple[str, dict[str, Any]]:
    """The folder and its ``meta.json``, checked (:func:`~ronde.checkpoint.check_sharded_index`)."""
    directory = os.fspath(directory)
    where = os.path.join(directory, META)
    try:
        meta = json.loads(read_index(directory, META))
    except ValueError as exc:
        raise RondeError(f"{where} is not JSON ({exc}); the index is damaged") from None
    return directory, check_sharded_index(meta, where, fmt, legacy_model)


def open_model(directory: str, meta: dict[str, Any]) -> IO[bytes]:
    """The step's model file, opened (:func:`ronde.checkpoint.open_member`)."""
    where = os.path.join(directory, META)
    if not meta.get("model"):
        raise RondeError(f"{where}: saved without a model")
    return open_member(directory, meta["model"], meta.get("model_size"), where)


def load(directory: str, meta: dict[str, Any], wanted: Sequence[tuple[str, int, int]],
         ) -> list[dict[str, np.ndarray]]:
    """Each wanted piece's slots, assembled from the files that overlap it (``{}`` for a
    piece no file has state for); ``RondeError`` when a piece is only partly covered."""
    by_key: dict[str, list[tuple[int, int, int]]] = {}
    for k, (key, a, b) in enumerate(wanted):
        by_key.setdefault(key, []).append((a, b, k))
    out: list[dict[str, np.ndarray]] = [{} for _ in wanted]
    covered = [0] * len(wanted)
    where = os.path.join(directory, META)
    for f, nbytes, entries in zip(meta["files"], meta["sizes"], meta["pieces"]):
        if not any(key in by_key and any(a < e and s < b for a, b, _ in by_key[key])
                   for key, s, e, _ in entries):
            continue  # nothing wanted in that file
        with open_member(directory, f, nbytes, where) as fh, \
                np.load(fh, allow_pickle=False) as saved:
            for j, (key, s, e, slots) in enumerate(entries):
                for a, b, k in by_key.get(key, ()):
                    lo, hi = max(a, s), min(b, e)
                    if lo >= hi or not slots:
                        continue
                    covered[k] += hi - lo
                    for slot in slots:
                        src = saved[f"{j}.{slot}"]
                        dst = out[k].get(slot)
                        if dst is None:
                            dst = out[k][slot] = np.zeros(b - a, dtype=src.dtype)
                        dst[lo - a:hi - a] = src[lo - s:hi - s]
    for k, (key, a, b) in enumerate(wanted):
        if out[k] and covered[k] != b - a:
            raise RondeError(f"{directory}: the optimizer state of {key!r} [{a}:{b}] is only "
                             f"{covered[k]} of {b - a} elements in the files")
    return out


def gather(pieces: Sequence[Piece], lengths: dict[str, int], root: int, name: str,
           process_set: ProcessSet = global_process_set,
           ) -> dict[str, dict[str, np.ndarray]] | None:
    """Every slot of every key of ``lengths`` (key -> the parameter's element count) whole,
    on rank ``root`` of ``process_set`` (its index there): ``{key: {slot: flat array}}``;
    None on the other ranks. Every member calls it with its own ``pieces`` (at most one
    per key; rank order must be element order, as the shard layouts are).

    What each rank holds (keys, ranges, slots and dtypes) travels first in one object
    allgather, and every rank checks from the same lists that each slot's pieces cover
    its key exactly (so all raise alike, before anything moves); then each slot of each
    key moves in one alltoall in which only ``root`` receives: no rank holds more than
    its own pieces and, on ``root``, the result.
    """
    rank, size = _api.set_rank(process_set), _api.set_size(process_set)
    if not 0 <= root < size:
        raise ValueError(f"gather_sharded(root={root}): the ranks are 0..{size - 1}")
    held = [(key, a, b, {slot: str(v.dtype) for slot, v in slots.items()})
            for key, a, b, slots in pieces]
    every = ([held] if size == 1 else
             _objects.allgather_object(held, f"{name}.held", process_set))
    kinds: dict[str, dict[str, str]] = {}
    spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for h in every:
        for key, a, b, slots in h:
            for slot, dt in slots.items():
                kinds.setdefault(key, {})[slot] = dt
                spans.setdefault((key, slot), []).append((a, b))
    for (key, slot), got in spans.items():
        at = 0
        for a, b in got:  # rank order is element order, every element once
            at = b if a == at and at <= b else -1
        if key not in lengths or at != lengths[key]:
            raise RondeError(f"gather_sharded: the {slot!r} state of {key!r} is {got} on the "
                             f"ranks in order, not the {lengths.get(key)} elements of the "
                             "parameter (a state not shaped like its parameter, or missing "
                             "on a rank)")
    mine = {key: slots for key, _, _, slots in pieces}
    out: dict[str, dict[str, np.ndarray]] = {}
    for k, key in enumerate(lengths):
        for slot in sorted(kinds.get(key, {})):
            send = mine.get(key, {}).get(slot)
            if send is None:
                send = np.empty(0, dtype=kinds[key][slot])
            send = np.ascontiguousarray(send).reshape(-1)
            if size == 1:
                whole = send.copy()
            else:
                splits = [0] * size
                splits[root] = send.size
                whole, _ = _api.alltoall(send, splits, f"{name}.{k}.{slot}", process_set)
            if rank == root:
                out.setdefault(key, {})[slot] = np.asarray(whole)
    return out if rank == root else None
