"""The layout of ``ShardedOptimizer`` (:mod:`.sharded`): buckets of one dtype padded to
``N * S`` elements, and the *pieces* of the parameters a rank owns in them.

A bucket of ``L`` elements is padded to ``N * S`` (``S = ceil(L / N)``) and rank ``r``
owns elements ``[r*S, (r+1)*S)``; a piece is the part of one parameter that falls in a
rank's range, a flat view of the parameter's storage. A bucket also keeps what one step
needs: the gradient buffer of this pass, the averaged slice, the reduction in flight.
"""

from __future__ import annotations

from typing import Any

import torch

from ..frameworks.gradients import Reduction
from ..process_sets import ProcessSet
from . import _collectives as C


class Piece:
    """The part ``[a, b)`` of flattened parameter ``index`` that this rank owns, at
    ``at`` in its bucket's slice."""

    __slots__ = ("index", "name", "a", "b", "at", "tensor")

    def __init__(self, index: int, name: str, a: int, b: int, at: int,
                 tensor: torch.Tensor) -> None:
        self.index, self.name, self.a, self.b, self.at, self.tensor = index, name, a, b, at, tensor


class Bucket:
    """Consecutive parameters of one dtype, reduce-scattered as one flat buffer."""

    def __init__(self, name: str, members: list[int], params: list[torch.Tensor],
                 names: list[str], rank: int, size: int) -> None:
        self.name = name
        self.members = members
        self.dtype = params[members[0]].dtype
        self.offset: dict[int, int] = {}
        at = 0
        for i in members:
            self.offset[i] = at
            at += params[i].numel()
        self.length = at
        self.per = -(-at // size)  # S: each rank's slice, the bucket padded to size * S
        self.padded = self.per * size
        lo, hi = rank * self.per, min((rank + 1) * self.per, at)
        self.pieces: list[Piece] = []
        for i in members:
            o, m = self.offset[i], params[i].numel()
            a, b = max(o, lo) - o, min(o + m, hi) - o
            if a < b:
                flat = params[i].detach().view(-1)
                self.pieces.append(Piece(i, names[i], a, b, o + a - lo, flat[a:b]))
        self.hooked: set[int] = set()  # members whose hook puts their gradient
        self.unhooked: list[torch.Tensor] = []  # members without a hook now
        self.buf: torch.Tensor | None = None  # size * S: this pass's gradients
        self.filled: set[int] = set()
        self.started: Any = None  # (its reduce-scatter: a gradients.Started, or None; the
        # buffer itself on a single rank)
        self.slice = torch.zeros(self.per, dtype=self.dtype)  # the averaged slice
        self.summed = False  # whether ``slice`` holds a reduction of this window
        self.last_pass = -1  # the backward pass (of this window) it was last started in
        self.gathering: Any = None  # the allgather of the updated slices
        self.version = -1  # ``buf._version`` when its reduce-scatter started

    def put(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Member ``i``'s gradient into its slot (added for a second pass before this
        bucket was reduced; nothing to do when ``grad`` is the slot: a view of it);
        returns the slot."""
        if self.buf is None:  # every slot is copied into or zeroed before it moves
            self.buf = torch.empty(self.padded, dtype=self.dtype)
            self.buf[self.length:].zero_()
        o = self.offset[i]
        dst = self.buf[o:o + grad.numel()]
        if grad.data_ptr() != dst.data_ptr():
            with torch.no_grad():
                if i in self.filled:
                    dst.add_(grad.reshape(-1))
                else:
                    dst.copy_(grad.reshape(-1))
        self.filled.add(i)
        return dst

    def due(self, cur: int, stage: int) -> bool:
        """Whether this bucket is still to be reduced in backward pass ``cur`` (stage 2:
        once a pass; stage 1: once a window)."""
        return self.last_pass != cur and (stage == 2 or self.last_pass < 0)

    def complete(self, cur: int, stage: int) -> bool:
        """Every hooked member's gradient is in, and no member without a hook wants in."""
        return self.started is None and self.due(cur, stage) \
            and len(self.filled) >= len(self.hooked) and self.filled >= self.hooked \
            and not any(p.requires_grad for p in self.unhooked)

    def start(self, params: list[torch.Tensor], cur: int, reduction: Reduction | None
              ) -> None:
        """Start this pass's reduce-scatter of the buffer (zeros where this rank has no
        gradient); ``reduction`` None: one rank, whose gradients are the average."""
        if self.buf is None:
            self.buf = torch.zeros(self.padded, dtype=self.dtype)
        else:
            for i in self.members:
                if i not in self.filled:
                    o = self.offset[i]
                    self.buf[o:o + params[i].numel()].zero_()
        self.last_pass = cur
        self.started = (None, self.buf) if reduction is None else \
            (reduction.start(self.buf, self.name, _reducescatter), None)
        # stage 1's p.grad are views of the buffer: an in-place change from now on (torch's
        # clip_grad_norm_ through a reference taken before ronde's patch, DDP's average)
        # races the reduce-scatter; the optimizer's synchronize() compares the version
        self.version = self.buf._version

    def finish(self, reduction: Reduction, stage: int) -> bool:
        """Take the averaged slice into :attr:`slice` (added to what this window holds);
        stage 2 frees the buffer. Returns whether a reduction was in flight."""
        started, solo = self.started
        # one rank: the gradients are the average; else this rank's slice, averaged
        # (decompressed: fp16 travels as a predivided Sum)
        out = solo[:self.per] if started is None else reduction.result(started)
        with torch.no_grad():
            if self.summed:
                self.slice.add_(out)
            else:
                self.slice.copy_(out)
        self.summed = True
        self.started, self.filled = None, set()
        if stage == 2:
            self.buf = None
        return started is not None

    def new_window(self, stage: int) -> None:
        """Nothing reduced or filled yet (stage 2 holds no buffer between passes)."""
        self.summed, self.last_pass, self.filled = False, -1, set()
        if stage == 2:
            self.buf = None

    def updated_slice(self) -> torch.Tensor:
        """This rank's slice of the parameters after the step (the allgather's input)."""
        send = torch.zeros(self.per, dtype=self.dtype)
        for piece in self.pieces:
            send[piece.at:piece.at + piece.b - piece.a].copy_(piece.tensor)
        return send

    def unpack(self, full: torch.Tensor, params: list[torch.Tensor]) -> None:
        """Every rank's updated slices (the allgather's output) into the parameters."""
        self.gathering = None
        with torch.no_grad():
            for i in self.members:
                o, p = self.offset[i], params[i]
                p.view(-1).copy_(full[o:o + p.numel()])


def _reducescatter(tensor: torch.Tensor, out: Any, name: str, op: int, pre: float, post: float,
                   process_set: ProcessSet) -> Any:
    """The reduce-scatter in the shape of the binding's allreduce (what
    :meth:`~ronde.frameworks.gradients.Reduction.start` calls)."""
    return C.reducescatter_async(tensor, name, op, process_set, pre, post)
