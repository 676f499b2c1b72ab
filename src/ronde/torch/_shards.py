"""The layout of ``ShardedOptimizer`` (:mod:`.sharded`): buckets of one dtype padded to
``N * S`` elements, and the *pieces* of the parameters a rank owns in them; and the
memory a step moves through, made once (:class:`Pool`).

A bucket of ``L`` elements is padded to ``N * S`` (``S = ceil(L / N)``) and rank ``r``
owns elements ``[r*S, (r+1)*S)``; a piece is the part of one parameter that falls in a
rank's range, a flat view of the parameter's storage. A bucket also keeps what one step
needs: the gradient buffer of this pass, the averaged slice, the reduction in flight.

Flat parameters (``RONDE_SHARDED_FLAT_PARAMS``, on by default): at layout each bucket
gets one *storage* of ``N * S`` elements, its members' values are copied in (the padding
zero) and each parameter becomes a view of it (``p.data = storage[o:o+n]``), as DDP's
buckets and FSDP's flat parameters are. The pieces are then views of this rank's range
``storage[r*S:(r+1)*S]``: the inner optimizer's step writes it in place, and the
allgather sends that range itself into the storage (every transport writes only the
other ranks' ranges of its output; MPI gets its in-place form): the parameters are
whole after it, with no buffer of a bucket and no copy. One rank: nothing moves. A
``p.data`` replaced later (``p.data = p.data.clone()``, loading by assignment) is
seen at the next step (one ``data_ptr()`` compared a parameter), its values copied into
the storage and the parameter pointed at it again; another dtype, device or size is
refused naming the parameter. Off: the parameters keep their own memory, and the
allgather goes through pooled buffers, copied out member by member.

Memory, per rank (``P`` parameters of 4 bytes, Adam's 8 bytes of state a parameter):

* stage 1: each bucket's buffer is its own and kept (the ``p.grad`` are views of it,
  ``RONDE_GRADIENT_AS_BUCKET_VIEW``), and the averaged slice is written back into this
  rank's range of it: ``4P`` parameters + ``4P`` gradients + ``8P/N`` state;
* stage 2: a bucket takes a buffer from the pool while its gradients come in and gives
  it back when its reduce-scatter is done, and the reduce-scatter writes straight into
  the kept slice: ``4P + 4P/N + 8P/N``, plus the pool;
* both: the parameters are the buckets' storages (``4P``, plus each bucket's padding of
  under ``N`` elements), and the allgather needs no other memory (on the CPU; a GPU's
  storage receives it in a pooled host buffer, copied in once); the reduce-scatters'
  other buffers come from the pools, and at most ``RONDE_SHARDED_IN_FLIGHT``
  reduce-scatters are in flight (the optimizer waits for the oldest before it starts
  another), so the pools stay a few buckets.

Made once and reused, these buffers are not handed back to the C allocator each step:
glibc keeps freed blocks of this size in its heap (its mmap threshold rises to the
largest block freed), so a step that allocates and frees its buckets grew the process
by hundreds of MB over its first steps.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _state
from .._errors import UnsupportedError
from .._ops import ReduceOp
from ..frameworks.gradients import Reduction
from ..frameworks.shard_layout import Piece, ShardLayout, Span
from ..process_sets import ProcessSet
from ..transport import hugepages
from . import _collectives as C
from ._pools import Pool, Pools
from ._tensors import dtype_name


class Bucket(Span):
    """Consecutive parameters of one dtype, reduce-scattered as one flat buffer: a span
    of the layout and what one step needs of it."""

    def __init__(self, name: str, index: int, members: list[int], params: list[torch.Tensor],
                 names: list[str], rank: int, size: int, stage: int, flat: bool) -> None:
        super().__init__(members, [params[i].numel() for i in members], size)
        self.name, self.names = name, names
        self.stage = stage
        self.dtype = params[members[0]].dtype
        self.lo = rank * self.per  # this rank's range of the padded bucket
        #: the members' flat storage (``RONDE_SHARDED_FLAT_PARAMS``; None: off, or members
        #: on several devices): each parameter a view of it, where the allgather lands
        self.storage: torch.Tensor | None = None
        self.addresses: dict[int, int] = {}  # each member's data_ptr() in the storage
        if flat and len({params[i].device for i in members}) == 1:
            self.link(params)
        #: stage 3 (:mod:`._units`): this rank's range, kept apart between the members'
        #: uses; the members' shapes, for :meth:`fill`
        self.own = self.storage[self.lo:self.lo + self.per].clone() \
            if stage == 3 and self.storage is not None else None
        self.shapes = {i: params[i].shape for i in members}
        #: this rank's pieces, each with a flat view of its parameter's storage (stage 3:
        #: of :attr:`own`, not of the storage, which goes)
        self.pieces = [Piece(i, names[i], a, b, self.offset[i] + a - self.lo, index,
                             params[i].detach().view(-1)[a:b] if self.own is None else
                             self.own[self.offset[i] + a - self.lo:][:b - a])
                       for i, a, b in self.owned(rank)]
        self.hooked: set[int] = set()  # members whose hook puts their gradient
        self.unhooked: list[torch.Tensor] = []  # members without a hook now
        self.buf: torch.Tensor | None = None  # size * S: this pass's gradients
        self.filled: set[int] = set()
        self.started: Any = None  # (its reduce-scatter: a gradients.Started, or None; the
        # buffer itself on a single rank)
        self.scratch: torch.Tensor | None = None  # the reduce-scatter's result (pooled)
        #: the averaged slice: stage 1, this rank's range of the kept buffer (made with
        #: it); stage 2, a tensor of its own, the reduce-scatter's output
        self.slice: torch.Tensor = torch.zeros(self.per if stage > 1 else 0, dtype=self.dtype)
        self.summed = False  # whether ``slice`` holds a reduction of this window
        self.last_pass = -1  # the backward pass (of this window) it was last started in
        self.gathering: Any = None  # the allgather of the updated slices
        self.lent: list[tuple[Pool, torch.Tensor]] = []  # its pooled buffers
        self.version = -1  # ``buf._version`` when its reduce-scatter started (or ended)
        self.modified = False  # stage 1: the buffer changed while it was being reduced

    def _new_buf(self, pools: Pools) -> torch.Tensor:
        """Stage 1: the bucket's own buffer, kept (its range is the slice); stage 2: one
        from the pool until the reduce-scatter is done. The padding zeroed."""
        if self.stage == 1:
            buf = torch.empty(self.padded, dtype=self.dtype)
            self.slice = buf[self.lo:self.lo + self.per]
        else:
            buf = pools.whole.take(self.dtype, self.padded)
        buf[self.length:].zero_()
        return buf

    def put(self, i: int, grad: torch.Tensor, pools: Pools) -> torch.Tensor:
        """Member ``i``'s gradient into its slot (added for a second pass before this
        bucket was reduced; nothing to do when ``grad`` is the slot: a view of it);
        returns the slot."""
        if grad.dtype != self.dtype:  # (``p.data`` replaced: ``model.half()`` after wrapping)
            raise changed_parameters([f"{self.names[i]!r} has a {dtype_name(grad.dtype)} "
                                      f"gradient, was {dtype_name(self.dtype)}"],
                                     flat=self.storage is not None)
        if self.buf is None:  # every slot is copied into or zeroed before it moves
            self.buf = self._new_buf(pools)
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

    def due(self, cur: int) -> bool:
        """Whether this bucket is still to be reduced in backward pass ``cur`` (stage 2:
        once a pass; stage 1: once a window)."""
        return self.last_pass != cur and (self.stage > 1 or self.last_pass < 0)

    def complete(self, cur: int) -> bool:
        """Every hooked member's gradient is in, and no member without a hook wants in."""
        return self.started is None and self.due(cur) \
            and len(self.filled) >= len(self.hooked) and self.filled >= self.hooked \
            and not any(p.requires_grad for p in self.unhooked)

    def start(self, params: list[torch.Tensor], cur: int, reduction: Reduction | None,
              pools: Pools) -> None:
        """Start this pass's reduce-scatter of the buffer (zeros where this rank has no
        gradient); ``reduction`` None: one rank, whose gradients are the average."""
        if self.buf is None:
            self.buf = self._new_buf(pools)
            self.buf[:self.length].zero_()
        else:
            for i in self.members:
                if i not in self.filled:
                    o = self.offset[i]
                    self.buf[o:o + params[i].numel()].zero_()
        self.last_pass = cur
        if reduction is None:
            self.started = (None, self.buf)
        else:
            # the result's memory: the kept slice itself (stage 2, first pass of the
            # window), else a pooled one (stage 1's range of the buffer is still input)
            into = self.slice if self.stage > 1 and not self.summed else None
            if into is None:
                into = self.scratch = pools.part.take(self.dtype, self.per)
            self.started = (reduction.start(self.buf, self.name, _reducescatter, into), None)
        # stage 1's p.grad are views of the buffer: an in-place change from now on (torch's
        # clip_grad_norm_ through a reference taken before ronde's patch, DDP's average)
        # races the reduce-scatter; the optimizer's synchronize() compares the version
        self.version = self.buf._version

    def finish(self, reduction: Reduction, pools: Pools) -> bool:
        """Take the averaged slice into :attr:`slice` (added to what this window holds);
        stage 2 gives its buffer back. Returns whether a reduction was in flight."""
        started, solo = self.started
        # one rank: the gradients are the average; else this rank's slice, averaged
        # (decompressed: fp16 travels as a predivided Sum)
        out = solo[:self.per] if started is None else reduction.result(started)
        if self.stage == 1:  # a change since the start is the user's (before ronde's own)
            self.modified = self.buf._version != self.version  # type: ignore[union-attr]
        with torch.no_grad():
            if self.summed:
                self.slice.add_(out)
            elif out.data_ptr() != self.slice.data_ptr():
                self.slice.copy_(out)
        if self.scratch is not None:
            pools.part.give(self.scratch)
            self.scratch = None
        self.summed = True
        self.started, self.filled = None, set()
        if self.stage > 1:
            pools.whole.give(self.buf)
            self.buf = None
        else:  # the slice written into the buffer is ronde's own change
            self.version = self.buf._version  # type: ignore[union-attr]
        return started is not None

    def drop(self, pools: Pools) -> None:
        """Wait for the reduce-scatter in flight (a failed one too) and forget it."""
        try:
            self.started[0].handle.wait()
        except Exception:  # noqa: BLE001 - dropped: its error is the window's, not ours
            pass
        if self.scratch is not None:
            pools.part.give(self.scratch)
        self.started = self.scratch = None

    def new_window(self, pools: Pools) -> None:
        """Nothing reduced or filled yet (stage 2 holds no buffer between passes)."""
        self.summed, self.last_pass, self.filled, self.modified = False, -1, set(), False
        if self.stage > 1 and self.buf is not None:
            pools.whole.give(self.buf)
            self.buf = None

    def link(self, params: list[torch.Tensor]) -> None:
        """Make :attr:`storage` (``padded`` elements on the members' device), copy the
        members' values in, zero the padding and point each member at its view of it."""
        first = params[self.members[0]]
        storage = torch.empty(self.padded, dtype=self.dtype, device=first.device)
        with torch.no_grad():
            storage[self.length:].zero_()
            for i in self.members:
                self._point(params[i], storage, i)
        self.storage = storage
        # the members' old memory back to the system now (glibc's heap keeps blocks of
        # this size, and the next bucket's storage would not fit in their holes): at
        # most one bucket more than the parameters at any time (RONDE_SHARDED_TRIM_HEAP)
        if _state.require().cfg.sharded_trim_heap:
            hugepages.trim_heap()

    def _point(self, p: torch.Tensor, storage: torch.Tensor, i: int) -> None:
        o = self.offset[i]
        view = storage[o:o + p.numel()]
        view.copy_(p.detach().reshape(-1))
        p.data = view.view_as(p)
        self.addresses[i] = p.data_ptr()

    def relink(self, params: list[torch.Tensor]) -> list[str]:
        """Members whose ``p.data`` was replaced since :meth:`link` (``p.data = ...``,
        ``model.to()``) are views of the storage again, their new values copied in;
        returns the ones that cannot be (another dtype, device or size), described."""
        storage, bad = self.storage, []
        if storage is None or self.own is not None:  # (stage 3: a new storage each use)
            return bad
        for i in self.members:
            p = params[i]
            if p.data_ptr() == self.addresses[i]:
                continue
            if p.dtype != storage.dtype or p.device != storage.device \
                    or p.numel() != self.sizes[i]:
                bad.append(f"{self.names[i]!r} is {dtype_name(p.dtype)}{list(p.shape)} on "
                           f"{p.device} now, was {dtype_name(storage.dtype)} "
                           f"({self.sizes[i]} elements) on {storage.device}")
                continue
            with torch.no_grad():
                self._point(p, storage, i)
        return bad

    # -- stage 3: the members whole only while their unit runs (._units) --------------
    def release(self, params: list[torch.Tensor], keep: bool = False) -> torch.Tensor | None:
        """Point the members at empty tensors and let the storage go; returns it (for
        the caller's pool), None if there was none; ``keep``: take this rank's range of
        it into :attr:`own` first (the parameters were written)."""
        own, storage = self.own, self.storage
        assert own is not None
        if storage is None:
            return None
        if keep:
            own.copy_(storage[self.lo:self.lo + self.per])
        for i in self.members:
            params[i].data = own.new_empty(0)
        self.storage = None
        return storage

    def fill(self, params: list[torch.Tensor], solo: bool, process_set: ProcessSet,
             buffer: torch.Tensor) -> None:
        """Make the members whole in ``buffer`` (``padded`` elements, the caller's; the
        members are not whole): this rank's range from :attr:`own`, the others' by an
        allgather in place, each member a view of it."""
        own = self.own
        assert self.storage is None and own is not None
        buffer[self.lo:self.lo + self.per].copy_(own)
        if not solo:
            C.allgather_async(buffer[self.lo:self.lo + self.per], f"{self.name}.whole",
                              process_set, out=buffer).wait()
        for i in self.members:
            o = self.offset[i]
            params[i].data = buffer[o:o + self.sizes[i]].view(self.shapes[i])
        self.storage = buffer

    def start_gather(self, pools: Pools, solo: bool, process_set: ProcessSet) -> None:
        """Start the allgather of this rank's updated slice: straight from this rank's
        range of :attr:`storage` into the storage itself (the transports write only the
        other ranks' ranges; one rank: nothing to move); without a storage, through
        pooled buffers."""
        storage, name = self.storage, f"{self.name}.params"
        if self.own is not None:  # stage 3: the pieces are the kept range; a unit gathers
            self.gathering = None
            return
        if storage is not None:
            if solo:
                self.gathering = None
            elif storage.is_cpu:
                self.gathering = C.allgather_async(storage[self.lo:self.lo + self.per], name,
                                                   process_set, out=storage)
            else:  # on the host (the slice staged there), copied to the device once (unpack)
                send = self._borrow(pools.part, self.per)
                send.copy_(storage[self.lo:self.lo + self.per])
                self.gathering = C.allgather_async(send, name, process_set,
                                                   out=self._borrow(pools.whole, self.padded))
            return
        send = self._borrow(pools.part, self.per)
        send.zero_()
        for piece in self.pieces:
            send[piece.at:piece.at + piece.b - piece.a].copy_(piece.tensor)
        self.gathering = send if solo else C.allgather_async(
            send, name, process_set, out=self._borrow(pools.whole, self.padded))

    def _borrow(self, pool: Pool, n: int) -> torch.Tensor:
        view = pool.take(self.dtype, n)
        self.lent.append((pool, view))
        return view

    def unpack(self, params: list[torch.Tensor], solo: bool) -> None:
        """Every rank's updated slices (the allgather's output) into the parameters
        (nothing to copy where the allgather landed in the storage)."""
        gathering, storage = self.gathering, self.storage
        if self.own is not None:
            return
        full = gathering if solo or gathering is None else gathering.wait()
        with torch.no_grad():
            if storage is None:
                for i in self.members:
                    o, p = self.offset[i], params[i]
                    p.view(-1).copy_(full[o:o + p.numel()])
            elif full is not None and full.data_ptr() != storage.data_ptr():
                storage.copy_(full)
        for pool, view in self.lent:
            pool.give(view)
        self.gathering, self.lent = None, []


class Layout(ShardLayout):
    """A ``ShardedOptimizer``'s layout, the one public object its checkpoints, the
    elastic handler, ``gather_sharded`` and the consolidated ``state_dict()`` read
    (``optimizer.shard_layout``; a new one after an elastic reset): the spans are the
    buckets."""

    spans: list[Bucket]  # type: ignore[assignment]

    def __init__(self, params: list[torch.Tensor], names: list[str],
                 groups: list[list[torch.Tensor]], buckets: list[Bucket], rank: int,
                 size: int, solo: bool, process_set: ProcessSet) -> None:
        super().__init__(list(buckets), names, rank, size, process_set)
        self.params = params  #: every parameter, whole, in the optimizer's order
        #: their shapes at layout (stage 3's parameters are empty between uses)
        self.shapes = [p.shape for p in params]
        self.groups = groups  #: the param groups' whole parameters
        self.buckets = buckets
        self.solo = solo  #: one rank (or not a member): no collective
        self.index = {id(p): i for i, p in enumerate(params)}
        #: this rank's pieces by parameter index
        self.pieces: dict[int, Piece] = {pc.index: pc for b in buckets for pc in b.pieces}

    def shard_pieces(self) -> list[tuple[str, int, int, torch.Tensor, int]]:
        """This rank's pieces: ``(parameter name, start, end, piece, param group)``."""
        group_of = {self.index[id(p)]: g for g, ps in enumerate(self.groups) for p in ps}
        return [(pc.name, pc.a, pc.b, pc.tensor, group_of[pc.index])
                for b in self.buckets for pc in b.pieces]

    def full_order(self) -> list[int]:
        """Parameter indices in the order of a whole ``state_dict()``'s param groups."""
        return [self.index[id(p)] for g in self.groups for p in g]


def relink(buckets: list[Bucket], params: list[torch.Tensor]) -> list[str]:
    """:meth:`Bucket.relink` over every bucket: a ``data_ptr()`` compared a parameter (a
    step's cost); the parameters that cannot be views again, described."""
    return [bad for b in buckets if b.storage is not None for bad in b.relink(params)]


def changed_parameters(described: list[str], ranks: int = 0,
                       flat: bool = True) -> UnsupportedError:
    """The error for parameters whose dtype, device or size changed after wrapping:
    ``described``, this rank's (:func:`relink`); ``ranks``, how many ranks found one
    (0: this rank alone knows); ``flat``: whether the parameters are views of flat
    buffers (``RONDE_SHARDED_FLAT_PARAMS``)."""
    what = "; ".join(described) or "on another rank"
    where = f", on {ranks} rank(s)" if ranks else ""
    why = ("Its parameters are views of one flat buffer per bucket, and its state is for "
           "the old ones" if flat else "Its buckets and state are for the old ones")
    return UnsupportedError(
        f"ShardedOptimizer: a parameter changed dtype, device or size after the optimizer "
        f"was made ({what}{where}). {why}: convert or move the model (model.to(), .half(), "
        ".double()) before making the ShardedOptimizer, or make a new one after")


def check_linked(buckets: list[Bucket], params: list[torch.Tensor], solo: bool,
                 process_set: ProcessSet) -> None:
    """:func:`relink` at a step whose ``synchronize()`` ran before it (the user's), agreed
    by every rank in one small allreduce: a parameter that cannot be a view of its
    storage again is refused on every rank, not on its own while the others wait in the
    allgather. Nothing to check (and no collective) without flat storages."""
    if not any(b.storage is not None and b.own is None for b in buckets):
        return
    broken = relink(buckets, params)
    flag = torch.tensor([int(bool(broken))], dtype=torch.int32)
    total = flag if solo else C.allreduce_async(flag, None, f"{buckets[0].name}.linked",
                                                ReduceOp.SUM, 1.0, 1.0, process_set).wait()
    if int(total[0]):
        raise changed_parameters(broken, int(total[0]))


def gather(buckets: list[Bucket], params: list[torch.Tensor], pools: Pools, solo: bool,
           process_set: ProcessSet) -> None:
    """Every rank's updated slices into the parameters: one allgather a bucket, two in
    flight (a third bucket's pooled buffers are not needed before one is unpacked)."""
    moving: list[Bucket] = []
    for b in buckets + [None]:  # type: ignore[operator]
        if b is not None:
            b.start_gather(pools, solo, process_set)
            moving.append(b)
        while moving and (len(moving) > 2 or b is None):
            moving.pop(0).unpack(params, solo)
    if pools.heap is not None:  # the step is over: what it freed and will not reuse
        pools.heap.settle()


def agree_finite(buckets: list[Bucket], solo: bool, process_set: ProcessSet) -> None:
    """Make every rank's averaged slices non-finite where any rank's are (one
    allreduce): every rank then skips the same steps (GradScaler)."""
    bad = not all(bool(torch.isfinite(b.slice).all()) for b in buckets)
    if solo:
        return
    total = C.allreduce_async(torch.tensor([int(bad)], dtype=torch.int32), None,
                              f"{buckets[0].name}.finite", ReduceOp.SUM, 1.0, 1.0,
                              process_set).wait()
    if int(total[0]) and not bad:
        poison(buckets)


def poison(buckets: list[Bucket]) -> None:
    """Make one element of this rank's averaged slices nan (another rank's are not
    finite: every rank then skips the step, as under DDP)."""
    for b in buckets:
        for piece in b.pieces:
            if piece.tensor.grad is not None:
                with torch.no_grad():
                    piece.tensor.grad[0] = float("nan")
                return


def _reducescatter(tensor: torch.Tensor, out: Any, name: str, op: int, pre: float, post: float,
                   process_set: ProcessSet) -> Any:
    """The reduce-scatter in the shape of the binding's allreduce (what
    :meth:`~ronde.frameworks.gradients.Reduction.start` calls), into ``out``."""
    return C.reducescatter_async(tensor, name, op, process_set, pre, post, out=out)
