"""A sharded optimizer's state across an elastic resize, in memory (every binding's).

The state is a list of *pieces*: ``(key, a, b, {slot: values})``, the slots of one
parameter's flat elements ``[a, b)`` (arrays of ``b - a`` elements, or scalars such as a
step count). At each commit every rank sends its pieces to rank ``r - 1``
(:func:`swap_with_neighbour`): each rank holds its own slice and the next one's. After the
job re-forms, :func:`reshard` (every rank, the new ones too) finds who holds each old
slice (:func:`holders`: the rank itself, else the one before it), sends every rank the
parts that fall in its new pieces (one ``alltoall``), and merges what arrives, checking
that every element did. The binding gives a :class:`Codec` (torch tensors travel as
``torch.save`` bytes read back with ``weights_only=True``, JAX's as ``.npz`` read with
``allow_pickle=False``) and, after laying its shards out for the new size, the element
ranges each rank now owns.
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .. import _api, _objects
from .._errors import RondeError
from ..process_sets import ProcessSet

#: (key, a, b, {slot: values over [a, b), or a scalar})
Piece = tuple[str, int, int, dict[str, Any]]


class Codec(Protocol):
    """How a binding's pieces travel and are built."""

    def encode(self, pieces: list[Piece]) -> np.ndarray: ...

    def decode(self, data: np.ndarray) -> list[Piece]: ...

    def is_array(self, value: Any) -> bool: ...

    def zeros(self, like: Any, n: int) -> Any: ...

    def copy(self, value: Any) -> Any: ...


def exchange(blocks: Sequence[bytes | np.ndarray], name: str) -> list[np.ndarray]:
    """Send ``blocks[j]`` to rank ``j`` (empty: nothing); the blocks received, by rank."""
    arrays = [np.frombuffer(b, dtype=np.uint8) if isinstance(b, bytes) else b
              for b in blocks]
    if len(arrays) == 1:
        return [arrays[0]]
    splits = [a.size for a in arrays]
    out, got = _api.alltoall(np.concatenate(arrays), splits, name)
    parts, at = [], 0
    for n in got:
        parts.append(out[at:at + n])
        at += n
    return parts


def swap_with_neighbour(own: list[Piece], codec: Codec, name: str) -> list[Piece]:
    """Send ``own`` to rank ``r - 1``; rank ``r + 1``'s pieces (a collective)."""
    rank, size = _api.rank(), _api.size()
    if size == 1:
        return []
    blocks: list[Any] = [b""] * size
    blocks[(rank - 1) % size] = codec.encode(own)
    return codec.decode(exchange(blocks, name)[(rank + 1) % size])


def holders(was: list[tuple[int, int]], old_size: int) -> dict[int, tuple[int, bool]]:
    """For each rank of the last commit (``was[j]``: what rank ``j`` was then, -1 for a
    new one), the rank now holding its slice and whether as its own (else the copy);
    ``RondeError`` where none does."""
    now_of = {r: j for j, (r, _) in enumerate(was) if r >= 0}
    out: dict[int, tuple[int, bool]] = {}
    lost = []
    for q in range(old_size):
        if q in now_of:
            out[q] = (now_of[q], True)
        elif old_size > 1 and (q - 1) % old_size in now_of:
            out[q] = (now_of[(q - 1) % old_size], False)
        else:
            lost.append(q)
    if lost:
        raise RondeError(
            f"elastic ShardedOptimizer: the optimizer state of rank(s) {lost} of the last "
            f"commit (at {old_size} ranks) is gone: each slice has one copy, on the rank "
            "before it, and both were lost; resume from a save_sharded() checkpoint "
            "(hvd.load_sharded) instead")
    return out


def committed_ranks(rank: int, size: int, moved: bool = False
                    ) -> tuple[list[tuple[int, int]], int, bool]:
    """Every rank's (rank, size) at its last commit (an allgather); the common size (0
    when nobody committed); whether any rank says its layout ``moved`` since (so that
    every rank decides alike whether to lay out again, even after a sync that a lost
    peer cut short on some ranks and not others)."""
    got = _objects.allgather_object((rank, size, bool(moved)), "ronde.elastic.sharded.ranks")
    was = [(int(r), int(s)) for r, s, _ in got]
    sizes = {s for r, s in was if r >= 0}
    if len(sizes) > 1:
        raise RondeError(f"elastic ShardedOptimizer: the survivors committed at different "
                         f"sizes {sorted(sizes)}")
    return was, (sizes.pop() if sizes else 0), any(m for _, _, m in got)


def forget_traces() -> None:
    """After a sharded optimizer was laid out again: drop JAX's compiled traces. JAX keeps
    them by function and input shapes, not by ``jax.jit`` object, so a step traced
    before, at a size this rank had at another place, would run again with that place's
    slices baked in (until 2026-12-05: AdamW decayed with another rank's weights, and
    Keras' JAX backend stepped on old shards). Every jitted function of the process
    compiles again once. Nothing where JAX is not loaded."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()


def reshard(own: list[Piece], neighbour: list[Piece], was: list[tuple[int, int]],
            old_size: int, ranges_of: Callable[[int], dict[str, tuple[int, int]]],
            codec: Codec, name: str = "ronde.elastic.sharded.reshard"
            ) -> dict[str, dict[str, Any]]:
    """This rank's new pieces' state (by key), from every holder (a collective; the
    module docstring). ``ranges_of(t)``: rank ``t``'s new ``{key: (a, b)}``."""
    rank, size = _api.rank(), _api.size()
    found = holders(was, old_size)
    blocks: list[Any] = [b""] * size
    held = [own if mine else neighbour for h, mine in found.values() if h == rank]
    if held:
        for t in range(size):
            ranges = ranges_of(t)
            part = [(key, lo, hi, cut(codec, st, lo - a, hi - a))
                    for pieces in held for key, a, b, st in pieces if key in ranges and st
                    for lo, hi in [(max(a, ranges[key][0]), min(b, ranges[key][1]))]
                    if lo < hi]
            if part:
                blocks[t] = codec.encode(part)
    mine = ranges_of(rank)
    merged: dict[str, dict[str, Any]] = {}
    covered: dict[str, int] = {}
    for data in exchange(blocks, name):
        if not len(data):
            continue
        for key, lo, hi, st in codec.decode(data):
            a, b = mine[key]
            covered[key] = covered.get(key, 0) + hi - lo
            merge(codec, merged.setdefault(key, {}), st, lo - a, b - a)
    for key, n in covered.items():
        a, b = mine[key]
        if n != b - a:
            raise RondeError(f"elastic ShardedOptimizer: the state of {key!r} [{a}:{b}] "
                             f"arrived for {n} of {b - a} elements")
    return merged


def cut(codec: Codec, state: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """A piece's ``state`` over its elements ``[lo, hi)`` (arrays sliced, scalars as they
    are)."""
    return {k: (v[lo:hi] if codec.is_array(v) else v) for k, v in state.items()}


def merge(codec: Codec, into: dict[str, Any], part: dict[str, Any], at: int,
          length: int) -> None:
    """Put ``part`` (the state of some of a piece's elements, from ``at``: :func:`cut`)
    into ``into``, the state of the whole piece (``length`` elements; zeros where no
    part has arrived yet); a scalar where ``into`` has none yet."""
    for k, v in part.items():
        if codec.is_array(v):
            dst = into.get(k)
            if dst is None:
                dst = into[k] = codec.zeros(v, length)
            dst[at:at + len(v)] = v
        elif k not in into:
            into[k] = codec.copy(v)


class NumpyCodec:
    """Pieces of numpy arrays as ``.npz`` bytes (read back with ``allow_pickle=False``):
    the keys, ranges and scalars in a JSON entry, the arrays beside it."""

    def encode(self, pieces: list[Any]) -> np.ndarray:
        head, arrays = [], {}
        for i, (key, a, b, st) in enumerate(pieces):
            scalars = {}
            for slot, v in st.items():
                if self.is_array(v):
                    arrays[f"{i}:{slot}"] = v
                else:
                    scalars[slot] = np.asarray(v).item()
            head.append([key, a, b, scalars])
        buf = io.BytesIO()
        np.savez(buf, __head__=np.frombuffer(json.dumps(head).encode(), dtype=np.uint8),
                 **arrays)
        return np.frombuffer(buf.getvalue(), dtype=np.uint8)

    def decode(self, data: np.ndarray) -> list[Any]:
        with np.load(io.BytesIO(data.tobytes()), allow_pickle=False) as z:
            head = json.loads(z["__head__"].tobytes().decode())
            out = []
            for i, (key, a, b, scalars) in enumerate(head):
                st: dict[str, Any] = dict(scalars)
                prefix = f"{i}:"
                for name in z.files:
                    if name.startswith(prefix):
                        st[name[len(prefix):]] = z[name]
                out.append((key, a, b, st))
        return out

    def is_array(self, value: Any) -> bool:
        return isinstance(value, np.ndarray) and value.ndim > 0

    def zeros(self, like: Any, n: int) -> Any:
        return np.zeros(n, dtype=like.dtype)

    def copy(self, value: Any) -> Any:
        return value

    # -- the in-job export (:func:`ronde.frameworks.sharded_files.gather`) --------------
    def describe(self, value: Any) -> tuple[str, Any]:
        """``("array", dtype name)`` for a slot, ``("scalar", plain value)`` otherwise: what
        the export tells the other ranks of a value before it moves."""
        if self.is_array(value):
            return "array", str(value.dtype)
        return "scalar", np.asarray(value).item()

    def scalar(self, described: Any) -> Any:
        """A scalar back from what :meth:`describe` made of it."""
        return described

    def flat(self, value: Any, dtype: str | None = None) -> Any:
        """``value`` as one contiguous dimension (None: an empty one of ``dtype``)."""
        if value is None:
            return np.empty(0, dtype=dtype)
        return np.ascontiguousarray(value).reshape(-1)

    def gather_one(self, send: Any, root: int | None, name: str,
                   process_set: ProcessSet) -> Any:
        """Every rank's ``send`` in rank order on rank ``root`` (an alltoall that only it
        receives: what it gets elsewhere is empty), or on every rank (``root`` None: an
        allgather)."""
        if root is None:
            return np.asarray(_api.allgather(send, name, process_set))
        splits = [0] * _api.set_size(process_set)
        splits[root] = int(send.size)
        return np.asarray(_api.alltoall(send, splits, name, process_set)[0])


#: the codec of the bindings whose state is numpy arrays (JAX, Keras)
NUMPY = NumpyCodec()
