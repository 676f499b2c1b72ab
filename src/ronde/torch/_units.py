"""Stage 3 of ``ShardedOptimizer``: each rank holds only its slices of the parameters
between their uses (ZeRO-3, FSDP's full sharding), on the same layout as stages 1 and 2.

The model is cut into *units* (by default each child of ``model`` that holds parameters;
``units=`` names others), and the buckets never span two units. Between uses a bucket
keeps only this rank's range ``[r*S, (r+1)*S)`` in a tensor of its own (the optimizer's
pieces are views of it: the inner optimizer steps on it in place) and its parameters
point at empty tensors. A unit is made whole (:meth:`~._shards.Bucket.fill`: one
allgather a bucket, in place into a buffer from a small pool, the parameters views of
it) right before its forward, and let go right after it (its buffer back to the pool);
what autograd saves of the parameters in that forward is recorded as where it lies in
the unit's buffer, not as the tensor (``saved_tensors_hooks``), so the buffer is free to
go and the saved tensor is found again, in whatever buffer the unit then has, when
backward needs it. Made whole again when backward reaches its outputs (a gradient hook
on them, ``register_multi_grad_hook``) or unpacks what it saved, and let go when every
parameter of it that wants a gradient has handed it to its bucket (stage 2's
reduce-scatter, which goes on as before), or at the end of the backward pass. The step
then updates the kept ranges, and no allgather follows it: the next forward gathers.
Reusing pooled buffers (rather than freeing and allocating) keeps the units' memory in
one place: freed into glibc's heap, a unit's buffer landed in a new hole each time, and
the process grew by a unit per unit.

Every rank runs every unit's forward and backward in the same order (they are
collectives). In this first version: one unit at a time, no prefetch (the allgather of
the next unit does not overlap the current one's compute); a parameter in one unit only
(tied weights in two units are refused); the model's ``state_dict()`` and
``load_state_dict()`` refused between steps except inside
``optimizer.whole_parameters()`` (every rank; ``save_sharded``/``load_sharded`` enter it
themselves; the optimizer's own state dict reads the kept ranges and the shapes the
layout recorded); an elastic reset refused. A parameter used outside its unit's forward
(a submodule called around its unit) finds an empty tensor: torch's shape error, not
ronde's. Off the CPU the allgather goes through a host buffer (untested: no GPU here).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .. import _state
from .._errors import UnsupportedError
from ..transport import hugepages
from ._pools import Pool
from ._shards import Bucket


class Units:
    """The units of a stage-3 ``ShardedOptimizer``: the hooks that make each whole
    while it runs, and let it go after."""

    def __init__(self, model: torch.nn.Module, units: list[torch.nn.Module] | None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError("ShardedOptimizer(stage=3) needs model=: the torch.nn.Module "
                            "whose parameters it shards (it gathers each unit of it right "
                            "before the unit runs)")
        self.model = model
        self.modules = list(units) if units is not None else [
            m for m in model.children() if any(True for _ in m.parameters())]
        if not self.modules:
            raise UnsupportedError("ShardedOptimizer(stage=3): the model has no child module "
                                   "with parameters; pass units=[...] (the submodules "
                                   "gathered one at a time)")
        self.unit_of: dict[int, int] = {}  # id(parameter) -> unit
        for u, m in enumerate(self.modules):
            for p in m.parameters():
                if id(p) in self.unit_of and self.unit_of[id(p)] != u:
                    raise UnsupportedError(
                        "ShardedOptimizer(stage=3): a parameter is in two units (tied "
                        f"weights: units {self.unit_of[id(p)]} and {u}); ronde's stage 3 does "
                        "not share a parameter between units yet: put both uses in one unit "
                        "(units=[...]) or use stage=2")
                self.unit_of[id(p)] = u
        self.whole_wanted = 0  # depth of whole() contexts
        self.opt: Any = None

    def orders(self, params: list[torch.Tensor]) -> list[list[int]]:
        """The parameter indices of each unit in backward's order (the last unit first,
        its parameters last first): the groups the layout lays out apart."""
        groups: list[list[int]] = [[] for _ in self.modules]
        for i, p in enumerate(params):
            if id(p) not in self.unit_of:
                raise UnsupportedError(
                    f"ShardedOptimizer(stage=3): parameter {i} of the optimizer is in no unit "
                    "(a parameter of the model itself, not of a child module?); pass "
                    "units=[...] covering every parameter")
            groups[self.unit_of[id(p)]].append(i)
        return [g[::-1] for g in groups[::-1] if g]

    def attach(self, opt: Any) -> None:
        """Shard the laid-out buckets out (keep this rank's ranges, drop the rest) and
        hook the units; ``opt``: the wrapped optimizer (its ``shard_layout``)."""
        self.opt = opt
        layout = opt.shard_layout
        params = layout.params
        self.buckets: list[list[Bucket]] = [[] for _ in self.modules]
        for b in layout.buckets:
            self.buckets[self.unit_of[id(params[b.members[0]])]].append(b)
            b.release(params)  # (its range kept in b.own: the rest goes)
        widest: dict[torch.dtype, int] = {}
        for b in layout.buckets:
            widest[b.dtype] = max(widest.get(b.dtype, 0), b.padded)
        #: the units' buffers, made once: as many kept as one unit takes
        self.pool = Pool(widest, most=max(len(bs) for bs in self.buckets),
                         device=layout.buckets[0].own.device if layout.buckets else None)
        self.wanting = [sum(1 for p in m.parameters() if p.requires_grad)
                        for m in self.modules]
        self.handed = [0] * len(self.modules)
        self.queued = False
        self.saving: list[Any] = []  # the saved-tensor hooks of the units in forward
        for u, m in enumerate(self.modules):
            m.register_forward_pre_hook(lambda _m, _a, u=u: self.before_forward(u))
            m.register_forward_hook(lambda _m, _a, out, u=u: self.after_forward(u, out))
            for p in m.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda _p, u=u: self.handed_one(u))
        # the flat buffers' memory, just let go, back to the system (glibc keeps it);
        # and the heap watched at the end of each backward pass as after a step
        self.heap = hugepages.HeapWatch() if _state.require().cfg.sharded_trim_heap else None
        if self.heap is not None:
            hugepages.trim_heap()
        for m in [self.model] + self.modules:
            m.register_state_dict_pre_hook(self._refuse)
            m.register_load_state_dict_pre_hook(self._refuse)

    # -- the hooks ---------------------------------------------------------------------
    def fill(self, u: int) -> None:
        layout = self.opt.shard_layout
        for b in self.buckets[u]:
            if b.storage is None:
                b.fill(layout.params, layout.solo, layout.process_set,
                       self.pool.take(b.dtype, b.padded))

    def release(self, u: int, keep: bool = False) -> None:
        if self.whole_wanted:
            return
        for b in self.buckets[u]:
            buf = b.release(self.opt.shard_layout.params, keep)
            if buf is not None:
                self.pool.give(buf)

    def before_forward(self, u: int) -> None:
        self.fill(u)
        # what autograd saves of the unit's parameters: where it lies (the buffer goes
        # back to the pool after forward), not the tensor; looked up again in backward
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t, u=u: self._pack(u, t), self._unpack)
        hooks.__enter__()
        self.saving.append(hooks)

    def _pack(self, u: int, t: torch.Tensor) -> Any:
        if t.device == torch.device("meta"):
            return t
        ptr = t.untyped_storage().data_ptr()
        for b in self.buckets[u]:
            if b.storage is not None and b.storage.untyped_storage().data_ptr() == ptr:
                return _Saved(u, b, t.size(), t.stride(),
                              t.storage_offset() - b.storage.storage_offset())
        return t

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        self.fill(saved.unit)
        buf = saved.bucket.storage
        return buf.as_strided(saved.size, saved.stride, buf.storage_offset() + saved.offset)

    def after_forward(self, u: int, out: Any) -> None:
        if self.saving:
            self.saving.pop().__exit__(None, None, None)
        outs = [t for t in _tensors(out) if t.requires_grad]
        if torch.is_grad_enabled() and outs:
            torch.autograd.graph.register_multi_grad_hook(
                outs, lambda _grads, u=u: self.before_backward(u), mode="any")
        self.release(u)

    def before_backward(self, u: int) -> None:
        if not self.queued:  # let every unit go at the end of the pass
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.pass_end)
        self.fill(u)

    def handed_one(self, u: int) -> None:
        self.handed[u] += 1
        if self.handed[u] >= self.wanting[u]:
            self.handed[u] = 0
            self.release(u)

    def pass_end(self) -> None:
        self.queued = False
        self.handed = [0] * len(self.modules)
        for u in range(len(self.modules)):
            self.release(u)
        if self.heap is not None:
            self.heap.settle()

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every unit whole inside (every rank enters it: allgathers), for what reads
        the whole parameters: ``model.state_dict()``, ``load_state_dict()`` (each rank's
        range of what was written is kept at the exit), ``save_sharded``."""
        for u in range(len(self.modules)):
            self.fill(u)
        self.whole_wanted += 1
        try:
            yield
        finally:
            self.whole_wanted -= 1
            if not self.whole_wanted:  # (what was written inside, a load, is kept)
                for u in range(len(self.modules)):
                    self.release(u, keep=True)

    def _refuse(self, *_: Any, **__: Any) -> None:
        if not self.whole_wanted:
            raise UnsupportedError(
                "state_dict()/load_state_dict() of a model under ShardedOptimizer(stage=3): "
                "each rank holds 1/N of its parameters between steps. On every rank: `with "
                "optimizer.whole_parameters(): sd = model.state_dict()` (then save on rank "
                "0), the same around load_state_dict(); or hvd.save_sharded/load_sharded")


class _Saved:
    """Where a tensor autograd saved lies in a unit's buffer (:meth:`Units._pack`)."""

    __slots__ = ("unit", "bucket", "size", "stride", "offset")

    def __init__(self, unit: int, bucket: Bucket, size: torch.Size, stride: tuple[int, ...],
                 offset: int) -> None:
        self.unit, self.bucket, self.size, self.stride = unit, bucket, size, stride
        self.offset = offset


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []
