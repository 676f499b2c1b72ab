"""Sharded-optimizer checkpoints as numpy files, for the bindings whose optimizer state is
arrays (Keras, JAX; torch's own :mod:`ronde.torch.sharded_io` keeps torch files).

A *piece* is a range ``[a, b)`` of one parameter's flat elements, keyed by a string the
binding makes stable across processes (JAX: the leaf's path; Keras: the variable's place
and shape), with the optimizer's *slots* over it (``mu``, ``momentum``...: arrays of
``b - a`` elements). Every rank calls :func:`save` with its pieces; the folder holds::

    optim.<id>.<r>-of-<N>.npz   each rank: "<piece>.<slot>" arrays
    meta.json                   the first rank, last: N, every file's pieces
                                (key, a, b, slots), the binding's scalars

written atomically, ``meta.json`` after every rank's file, the previous save's files
removed after it (:func:`ronde.checkpoint.commit_sharded_save`). :func:`load` reads
only the files whose pieces overlap the wanted ones, at any N, and checks every wanted
element arrived. Files are read with ``allow_pickle=False``: arrays only.

:func:`gather` is the in-job export of the same pieces: every slot of every key whole on
one rank of the running job, nothing held twice (one alltoall per key and slot in which
only that rank receives).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import numpy as np

from .. import _api, _objects
from .._errors import RondeError
from ..checkpoint import atomic_save, begin_sharded_save, commit_sharded_save, sharded_meta
from ..process_sets import ProcessSet, global_process_set

META = "meta.json"

#: (key, a, b, {slot: array of b - a elements})
Piece = tuple[str, int, int, dict[str, np.ndarray]]


def save(directory: str | os.PathLike[str], pieces: Sequence[Piece], scalars: dict[str, Any],
         fmt: str, rank: int, size: int, process_set: ProcessSet = global_process_set,
         first_files: Callable[[str], None] | None = None) -> None:
    """Write this rank's ``pieces``; the set's first rank writes ``meta.json`` (with
    ``scalars`` and ``fmt``), after ``first_files(directory)`` (a model's weights).
    Every rank of the job calls it (``size`` 1: only the job's rank 0 writes)."""
    directory = os.fspath(directory)
    ps = process_set
    many = size > 1
    token, writer, together = begin_sharded_save(directory, many, ps)
    if writer:
        arrays = {f"{i}.{slot}": np.ascontiguousarray(v)
                  for i, (_, _, _, slots) in enumerate(pieces) for slot, v in slots.items()}
        atomic_save(os.path.join(directory, f"optim.{token}.{rank}-of-{size}.npz"),
                    lambda fh: np.savez(fh, **arrays))
    index = [[(key, a, b, sorted(slots)) for key, a, b, slots in pieces]]
    if many:
        index = _objects.allgather_object(index[0], "ronde.save_sharded.index", ps)
    if rank == 0 and writer:
        if first_files is not None:
            first_files(directory)
        meta = {"format": fmt, "id": token, "world_size": size,
                "files": [f"optim.{token}.{r}-of-{size}.npz" for r in range(size)],
                "pieces": index, **scalars}
        commit_sharded_save(directory, META, lambda fh: fh.write(json.dumps(meta).encode()),
                            token, ".npz")
    if together:
        _api.barrier(process_set=ps)


def read_meta(directory: str | os.PathLike[str], fmt: str) -> tuple[str, dict[str, Any]]:
    """The folder and its ``meta.json``, checked to be of format ``fmt``."""
    directory, meta_path = sharded_meta(directory, META)
    with open(meta_path, "rb") as fh:
        meta = json.loads(fh.read())
    if meta.get("format") != fmt:
        raise RondeError(f"{meta_path}: unknown format {meta.get('format')!r} (expected "
                         f"{fmt!r})")
    return directory, meta


def load(directory: str, meta: dict[str, Any], wanted: Sequence[tuple[str, int, int]],
         ) -> list[dict[str, np.ndarray]]:
    """Each wanted piece's slots, assembled from the files that overlap it (``{}`` for a
    piece no file has state for); ``RondeError`` when a piece is only partly covered."""
    by_key: dict[str, list[tuple[int, int, int]]] = {}
    for k, (key, a, b) in enumerate(wanted):
        by_key.setdefault(key, []).append((a, b, k))
    out: list[dict[str, np.ndarray]] = [{} for _ in wanted]
    covered = [0] * len(wanted)
    for f, entries in zip(meta["files"], meta["pieces"]):
        if not any(key in by_key and any(a < e and s < b for a, b, _ in by_key[key])
                   for key, s, e, _ in entries):
            continue  # nothing wanted in that file
        with np.load(os.path.join(directory, f), allow_pickle=False) as saved:
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
