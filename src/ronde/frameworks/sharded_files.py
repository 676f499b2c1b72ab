"""Sharded-optimizer checkpoints: the one engine of every binding's ``save_sharded`` and
``load_sharded``, with a :class:`Codec` per framework for how one rank's pieces become a
file and come back (numpy's ``.npz`` files and ``meta.json``, this module's, for Keras
and JAX; torch's ``.pt`` files and ``meta.pt``, :class:`ronde.torch._codec.TorchCodec`).

A *piece* is a range ``[a, b)`` of one parameter's flat elements, keyed by a string the
binding makes stable across processes (torch: the parameter's name; JAX: the leaf's path;
Keras: the variable's place and shape), with the optimizer's state over it: *slots*
(``mu``, ``exp_avg``...: flat arrays of ``b - a`` elements) and, where the framework keeps
them per parameter, scalars (torch's ``step``). Every rank calls :func:`save` with its
pieces; a step holds::

    optim.<id>.<r>-of-<N><suffix>   each rank: its pieces' state
    <model file with <id>>          the first rank: the binding's model or parameters
    <meta>                          the first rank, last: N, every file of the step and
                                    its size, every file's pieces, the binding's scalars

``<id>`` is new at every save and the index is replaced atomically once every file of
the step is complete (:class:`ronde.checkpoint.ShardedSave`): a save cut short leaves
the previous step whole; the next save removes what it left. :func:`load` reads only
the files whose pieces overlap the wanted ones, at any N, and checks every wanted
element arrived; :func:`check_params` refuses a checkpoint of other parameters (names,
shapes, dtypes) before anything is loaded. Files are read with ``allow_pickle=False``
(numpy) or ``weights_only=True`` (torch): arrays, tensors and plain values only, and
only the regular files of the folder that the index names, of the sizes it records
(:func:`ronde.checkpoint.open_member`).

:func:`gather` is the in-job export of the same pieces: every slot of every key whole on
one rank of the running job, nothing held twice (one alltoall per key and slot in which
only that rank receives).
"""

from __future__ import annotations

import json
import math
import os
from typing import IO, Any, Callable, Sequence

import numpy as np

from .. import _api, _objects
from .._errors import RondeError
from ..checkpoint import (ShardedSave, begin_sharded_save, check_sharded_index, open_member,
                          previous_step, read_index, sharded_file_names)
from ..process_sets import ProcessSet, global_process_set
from . import reshard


#: (key, a, b, {slot: flat array of b - a elements, or a scalar})
Piece = tuple[str, int, int, dict[str, Any]]

#: a step's model file: its name (``{id}`` stands for the step's id) and how it is
#: written: ``{"write": fn(open file)}`` or ``{"write_path": fn(path)}``
ModelFile = tuple[str, dict[str, Callable[..., Any]]]


class Codec(reshard.NumpyCodec):
    """How one rank's pieces become a file of a step and come back, and how the step's
    index is written and read: numpy ``.npz`` files (arrays only) and ``meta.json``.
    What a piece's state is (which values are slots, a new slot's zeros) is the elastic
    reshard's codec's (:class:`ronde.frameworks.reshard.NumpyCodec`). A framework's codec
    overrides what differs (:class:`ronde.torch._codec.TorchCodec`)."""

    suffix = ".npz"   #: the ranks' files' ending
    meta = "meta.json"  #: the index's name

    def entry(self, key: str, a: int, b: int, state: dict[str, Any]) -> Any:
        """A piece as the index lists it."""
        return (key, a, b, sorted(state))

    def write(self, fh: IO[bytes], pieces: Sequence[Piece]) -> None:
        """Write this rank's ``pieces`` to the open file ``fh``."""
        np.savez(fh, **{f"{i}.{slot}": np.ascontiguousarray(v)
                        for i, (_, _, _, state) in enumerate(pieces)
                        for slot, v in state.items()})

    def read(self, fh: IO[bytes], entries: list[Any], needed: list[int]
             ) -> dict[int, dict[str, Any]]:
        """The state of the pieces ``needed`` (their places in ``entries``, the file's
        pieces as the index lists them), read from ``fh``."""
        with np.load(fh, allow_pickle=False) as saved:
            return {j: {slot: saved[f"{j}.{slot}"] for slot in entries[j][3]} for j in needed}

    def write_meta(self, fh: IO[bytes], meta: dict[str, Any]) -> None:
        fh.write(json.dumps(meta).encode())

    def read_meta(self, data: bytes, where: str) -> Any:
        try:
            return json.loads(data)
        except ValueError as exc:
            raise RondeError(f"{where} is not JSON ({exc}); the index is damaged") from None


NUMPY = Codec()


def save(directory: str | os.PathLike[str], pieces: Sequence[Piece], scalars: dict[str, Any],
         fmt: str, rank: int, size: int, process_set: ProcessSet = global_process_set,
         model: ModelFile | None = None, codec: Codec = NUMPY) -> None:
    """Write this rank's ``pieces`` as one step; the set's first rank writes ``model``
    (a model's weights) and the index (with ``scalars`` and ``fmt``, a format name
    ending in ``/<version>``). Every rank of the job calls it (``size`` 1: only the
    job's rank 0 writes)."""
    directory = os.fspath(directory)
    ps = process_set
    many = size > 1

    def names(token: str) -> list[str]:
        return [*sharded_file_names(token, size, codec.suffix),
                *([model[0].format(id=token)] if model else [])]

    step: ShardedSave = begin_sharded_save(
        directory, codec.meta, many, rank == 0, ps, names,
        lambda: previous_step(directory, codec.meta,
                              lambda: read_meta(directory, fmt, "", codec)[1]))
    nbytes = 0
    if step.writer:
        nbytes = step.write(sharded_file_names(step.token, size, codec.suffix)[rank],
                            lambda fh: codec.write(fh, pieces))
    index = [([codec.entry(*piece) for piece in pieces], nbytes)]
    if many:
        index = _objects.allgather_object(index[0], "ronde.save_sharded.index", ps)
    if step.committer:
        meta = {"format": fmt, "id": step.token, "world_size": size,
                "files": sharded_file_names(step.token, size, codec.suffix),
                "sizes": [n for _, n in index],
                "pieces": [e for e, _ in index], "model": None, "model_size": None,
                **scalars}
        if model is not None:
            meta["model"] = model[0].format(id=step.token)
            meta["model_size"] = step.write(meta["model"], **model[1])
        step.commit(lambda fh: codec.write_meta(fh, meta), names(step.token))
    if step.together:
        _api.barrier(process_set=ps)


def read_meta(directory: str | os.PathLike[str], fmt: str, legacy_model: str,
              codec: Codec = NUMPY) -> tuple[str, dict[str, Any]]:
    """The folder and its index, checked (:func:`~ronde.checkpoint.check_sharded_index`)."""
    directory = os.fspath(directory)
    where = os.path.join(directory, codec.meta)
    meta = codec.read_meta(read_index(directory, codec.meta), where)
    return directory, check_sharded_index(meta, where, fmt, legacy_model)


def open_model(directory: str, meta: dict[str, Any], codec: Codec = NUMPY) -> IO[bytes]:
    """The step's model file, opened (:func:`ronde.checkpoint.open_member`)."""
    where = os.path.join(directory, codec.meta)
    if not meta.get("model"):
        raise RondeError(f"{where}: saved without a model; pass model=None")
    return open_member(directory, meta["model"], meta.get("model_size"), where)


def load(directory: str, meta: dict[str, Any], wanted: Sequence[tuple[str, int, int]],
         codec: Codec = NUMPY) -> list[dict[str, Any]]:
    """Each wanted piece's state, assembled from the files that overlap it (``{}`` for a
    piece no file has state for): each slot's elements from the saved pieces that hold
    them, each scalar from the first; ``RondeError`` when a piece is only partly covered."""
    by_key: dict[str, list[tuple[int, int, int]]] = {}
    for k, (key, a, b) in enumerate(wanted):
        by_key.setdefault(key, []).append((a, b, k))
    out: list[dict[str, Any]] = [{} for _ in wanted]
    covered = [0] * len(wanted)
    where = os.path.join(directory, codec.meta)
    for f, nbytes, entries in zip(meta["files"], meta["sizes"], meta["pieces"]):
        needed = [j for j, (key, s, e, *_) in enumerate(entries)
                  if any(a < e and s < b for a, b, _ in by_key.get(key, ()))]
        if not needed:
            continue  # nothing wanted in that file
        with open_member(directory, f, nbytes, where) as fh:
            saved = codec.read(fh, entries, needed)
        for j in needed:
            key, s, e = entries[j][:3]
            for a, b, k in by_key[key]:
                lo, hi = max(a, s), min(b, e)
                if lo < hi and saved[j]:
                    covered[k] += hi - lo
                    reshard.merge(codec, out[k], reshard.cut(codec, saved[j], lo - s, hi - s),
                                  lo - a, b - a)
    for k, (key, a, b) in enumerate(wanted):
        if out[k] and covered[k] != b - a:
            raise RondeError(f"{directory}: the optimizer state of {key!r} [{a}:{b}] is only "
                             f"{covered[k]} of {b - a} elements in the files")
    return out


#: a parameter as :func:`check_params` compares it: (shape, dtype name)
Param = tuple[list[int], str]


def check_params(directory: str, meta: dict[str, Any], mine: dict[str, Param]) -> None:
    """Refuse a checkpoint whose parameters (``meta["params"]``: name -> shape and dtype)
    are not ``mine`` (renamed, another shape or dtype, missing, extra), naming them,
    before anything is loaded; an index saved without them is checked by names and
    element counts (the pieces' ends)."""
    saved = meta.get("params")
    if not isinstance(saved, dict):  # an index before shapes were stored
        saved = {}
        for entries in meta["pieces"]:
            for key, _, end, *_ in entries:
                saved[key] = max(saved.get(key, 0), end)
        have: dict[str, Any] = {n: math.prod(shape) for n, (shape, _) in mine.items()}
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


def _describe(entry: int | Param) -> str:
    if isinstance(entry, int):
        return f"{entry} elements"
    shape, dtype = entry
    return f"{dtype}{list(shape)}"


def gather(pieces: Sequence[Piece], lengths: dict[str, int], root: int | None, name: str,
           process_set: ProcessSet = global_process_set, codec: Codec | None = None,
           position: tuple[int, int] | None = None) -> dict[str, dict[str, Any]] | None:
    """Every slot of every key of ``lengths`` (key -> the parameter's element count) whole,
    on rank ``root`` of ``process_set`` (its index there): ``{key: {slot: flat array}}``,
    with each key's scalars (torch's ``step``) as the first rank holding a piece of it
    has them; None on the other ranks. ``root`` None: on every rank (an allgather per
    slot instead). Every member calls it with its own ``pieces`` (at most one per key;
    rank order must be element order, as the shard layouts are). ``codec``: the
    binding's arrays (numpy's by default; torch's tensors move as tensors);
    ``position``: ``(rank, size)`` where not the process set's (``(0, 1)``: alone).

    What each rank holds (keys, ranges, slots and dtypes, scalars) travels first in one
    object allgather, and every rank checks from the same lists that each slot's pieces
    cover its key exactly (so all raise alike, before anything moves); then each slot of
    each key moves in one alltoall in which only ``root`` receives: no rank holds more
    than its own pieces and, on ``root``, the result.
    """
    codec = codec or NUMPY
    rank, size = position or (_api.set_rank(process_set), _api.set_size(process_set))
    if root is not None and not 0 <= root < size:
        raise ValueError(f"gather_sharded(root={root}): the ranks are 0..{size - 1}")
    held = [(key, a, b, {slot: codec.describe(v) for slot, v in slots.items()})
            for key, a, b, slots in pieces]
    every = ([held] if size == 1 else
             _objects.allgather_object(held, f"{name}.held", process_set))
    kinds: dict[str, dict[str, str]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for h in every:
        for key, a, b, slots in h:
            for slot, (what, v) in slots.items():
                if what == "array":
                    kinds.setdefault(key, {})[slot] = v
                    spans.setdefault((key, slot), []).append((a, b))
                else:
                    scalars.setdefault(key, {}).setdefault(slot, v)
    for (key, slot), got in spans.items():
        at = 0
        for a, b in got:  # rank order is element order, every element once
            at = b if a == at and at <= b else -1
        if key not in lengths or at != lengths[key]:
            raise RondeError(f"gather_sharded: the {slot!r} state of {key!r} is {got} on the "
                             "ranks in order, not the "
                             f"{lengths.get(key)} elements of the parameter (a state not "
                             "shaped like its parameter, or missing on a rank)")
    mine = {key: slots for key, _, _, slots in pieces}
    keep = root is None or rank == root
    out: dict[str, dict[str, Any]] = {}
    for k, key in enumerate(lengths):
        for slot in sorted(kinds.get(key, {})):
            send = codec.flat(mine.get(key, {}).get(slot), kinds[key][slot])
            whole = codec.copy(send) if size == 1 else \
                codec.gather_one(send, root, f"{name}.{k}.{slot}", process_set)
            if keep:
                out.setdefault(key, {})[slot] = whole
        if keep and key in scalars:
            out.setdefault(key, {}).update({slot: codec.scalar(v)
                                            for slot, v in scalars[key].items()})
    return out if keep else None
