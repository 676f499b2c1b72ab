"""Gradient buckets for ``DistributedOptimizer``: one allreduce per bucket, not per tensor.

Why: each collective costs ronde's engine a negotiation entry, a fusion decision and a
completion, about 130 Python calls across its threads; a ResNet-18-shaped model's 62
gradients made that 9,800 calls and 17 ms of CPU per step at np=2, where DDP's C++
reducer spends 2 ms (``python -m ronde.bench train``). DDP and Horovod both group
gradients into buckets; so does this, in the steady state.

How: the first steps of a job generation run the per-tensor path, which checks what
it must (the parameter tables, presence, mismatches) and, in the second step, records
the order in which gradients became ready. At that step's ``synchronize()`` rank 0
lays the buckets out from its order (consecutive parameters of one dtype, the first
bucket at most 1 MiB so that communication starts early in the backward pass, the
others at most ``RONDE_BUCKET_BYTES``) and broadcasts the layout, so every rank's
buckets are the same by construction. From then on a parameter's hook copies its
gradient into its slot of the bucket's flat buffer (one ``copy_``) and makes ``p.grad``
a view of its slot (``RONDE_GRADIENT_AS_BUCKET_VIEW``, on by default), and the hook
that fills a bucket starts its allreduce; the averages then land in ``p.grad`` in place
(without views, ``synchronize()`` copies them back).

What still holds, as on the per-tensor path: a parameter without a gradient on this
rank contributes zeros (its slot is zeroed), and the presence count decides whether
it gets the average or keeps ``grad=None``. Where every parameter of the optimizer is in
a bucket and the bucket's reduction is linear (Sum or Average, with at most ronde's own
fp16/bf16 cast: :func:`carries_presence`), the count rides in the buckets: a bucket's
flat buffer ends with one flag per member (1 where this rank has its gradient), reduced
with the gradients, so a flag above zero says that some rank had one, and the step needs
no collective of its own for it (the layout is agreed, so every rank decides alike;
otherwise the optimizer's separate presence count stays). A bucket's length and dtype are negotiated
like any tensor's, so ranks whose layouts differ fail with a ``TensorMismatchError``
naming the bucket's parameters instead of averaging unrelated values. Parameters that
are sparse, not on the CPU, or hooked only after the layout was made use the per-tensor
path; so does everything under ``groups=`` (the user's own grouping). An elastic reset
(a new generation) starts over with the per-tensor steps.
"""

from __future__ import annotations

from threading import get_ident
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import _api, _cores
from .._errors import TensorMismatchError
from .._ops import ReduceOp
from ..frameworks.compression import Compressor
from ..frameworks.gradients import Reduction, Started
from ..process_sets import ProcessSet

#: DDP's first bucket (``RONDE_FIRST_BUCKET_BYTES`` resolves ``auto`` to it or not: _cores)
FIRST_BUCKET_BYTES = _cores.FIRST_BUCKET_BYTES
#: a bucket smaller than 1/SMALL_FRACTION of the first bucket's cap joins the next one of
#: its dtype (the last one, the one before). A collective costs about the same for 5 KiB
#: as for 500: a small bucket moves nothing worth overlapping. Where a small last bucket
#: holds the gradients ready last, it fills the moment backward ends, a few layers after
#: the one before it (the transformer of ``python -m ronde.bench train``, 1,003 KiB + 192
#: KiB: 0.25-0.4 ms of CPU a step more at np=2 as two buckets, ``scripts/thread_cpu.py``);
#: a small first one is what fits before a large gradient (the CNN's 5 KiB before its
#: 2 MiB layer). DDP keeps both.
SMALL_FRACTION = 4
#: the synchronize() (0-based, per generation) whose ready order the layout follows:
#: the second, after lazy initialisation and the first step's checks
LAYOUT_STEP = 1


class Bucket:
    """One flat buffer holding the gradients of consecutive parameters."""

    __slots__ = ("name", "flat", "members", "left", "handle", "flags")

    def __init__(self, name: str, members: list[tuple[int, torch.Tensor]],
                 dtype: torch.dtype, presence: bool = False,
                 memory: Callable[[int], np.ndarray | None] | None = None) -> None:
        self.name = name
        total = sum(p.numel() for _, p in members)
        self.flat = _flat(total + (len(members) if presence else 0), dtype, memory)
        #: the presence flags after the gradients (one per member), or None
        self.flags: torch.Tensor | None = self.flat[total:] if presence else None
        #: (parameter index in the optimizer, parameter, its slot: a view of ``flat``)
        self.members: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        at = 0
        for i, p in members:
            n = p.numel()
            self.members.append((i, p, self.flat[at:at + n].view(p.shape)))
            at += n
        self.left = len(self.members)  #: members whose gradient is not in ``flat`` yet
        self.handle: Started | None = None  #: the step's allreduce once started


def _flat(numel: int, dtype: torch.dtype,
          memory: Callable[[int], np.ndarray | None] | None) -> torch.Tensor:
    """A zeroed flat buffer, in the memory ``memory`` gives where it gives some (the
    steady lane's shared memory, ``_api.bucket_memory``: reduced there in place, no
    cross-memory copies), else torch's own."""
    raw = memory(numel * dtype.itemsize) if memory is not None else None
    if raw is None:
        return torch.zeros(numel, dtype=dtype)
    flat = torch.from_numpy(raw).view(dtype)
    flat.zero_()
    return flat


def _adopt_grads(bucket: Bucket) -> None:
    """Each member's gradient (this step's average) copied into its slot and replaced
    by it, as the bucket is made: the gradients and the buckets are not held twice over
    at the step that lays them out (they were: +1 copy of every gradient at that step's
    peak, 80 MB on ``python -m ronde.bench memory``'s model); each old gradient is freed
    before the next bucket is allocated."""
    with torch.no_grad():
        for _, p, slot in bucket.members:
            grad = p.grad
            if grad is not None and grad.layout == torch.strided and \
                    grad.dtype == slot.dtype and grad.shape == slot.shape:
                slot.copy_(grad)
                p.grad = slot


class Buckets:
    """The bucket layout of one optimizer and the state of the step in flight.

    Args:
        layout: lists of parameter indices (into ``params``), one per bucket.
        params: the optimizer's parameters, in its order.
        names: their names (for errors), in the same order.
        base: the collective name the buckets' names start with.
        reduction: the optimizer's op, scales and compression, applied to each bucket's
            flat buffer as to a gradient (:mod:`ronde.frameworks.gradients`).
        allreduce: torch's in-place asynchronous allreduce.
        as_view: make each gradient taken a view of its slot (``RONDE_GRADIENT_AS_BUCKET_VIEW``).
        memory: where the buckets' buffers may live (:func:`_flat`), or None.
        presence: the buckets carry the presence count (module docstring): true only
            when the layout holds every parameter and :func:`carries_presence` allows it.
    """

    def __init__(self, layout: Sequence[Sequence[int]], params: Sequence[torch.Tensor],
                 names: Sequence[str], base: str, reduction: Reduction,
                 allreduce: Callable[..., Any], as_view: bool = False,
                 presence: bool = False,
                 memory: Callable[[int], np.ndarray | None] | None = None) -> None:
        self.presence = presence
        self.buckets: list[Bucket] = []
        for k, ids in enumerate(layout):
            bucket = Bucket(f"{base}.bucket{k}.{len(ids)}", [(i, params[i]) for i in ids],
                            params[ids[0]].dtype, presence, memory)
            if as_view:
                _adopt_grads(bucket)
            self.buckets.append(bucket)
        #: id(parameter) -> (its bucket, its slot)
        self.slot_of: dict[int, tuple[Bucket, torch.Tensor]] = {
            id(p): (b, slot) for b in self.buckets for _, p, slot in b.members}
        self.taken: set[int] = set()  #: id() of the parameters copied in this step
        #: ``RONDE_GRADIENT_AS_BUCKET_VIEW``: a gradient taken becomes a view of its slot
        #: (DDP's ``gradient_as_bucket_view``): the average lands in ``p.grad`` in place,
        #: and backward accumulates into the slot while ``zero_grad`` keeps the view
        self.as_view = as_view
        self._names = names
        self._reduction, self._allreduce = reduction, allreduce
        self.started = 0  #: buckets started in this step
        #: the step's last bucket is waited for at once by ``synchronize()``, which drives
        #: its round: it does not wake the engine's control thread (``_api.waited_by``)
        self._waited_by = _api.waited_by()

    def __contains__(self, p: torch.Tensor) -> bool:
        return id(p) in self.slot_of

    @property
    def in_flight(self) -> bool:
        """Whether a step's gradients are taken or its buckets started (not finished)."""
        return bool(self.taken) or self.started > 0

    def take(self, p: torch.Tensor) -> None:
        """Copy ``p.grad`` into ``p``'s slot (not when it is the slot already: see
        ``as_view``); start the bucket's allreduce once it is full. (At once, in the hook:
        copying a bucket's gradients together when it fills, in one call, held each
        gradient longer and made the backward pass's allocations slower, 0.6 ms a step
        more for the transformer of ``python -m ronde.bench train``.)"""
        i = id(p)
        if i in self.taken:
            return
        bucket, slot = self.slot_of[i]
        grad = p.grad
        if grad is not slot:
            slot.copy_(grad)
            if self.as_view:
                p.grad = slot
        self.taken.add(i)
        bucket.left -= 1
        if not bucket.left:
            if bucket.flags is not None:
                bucket.flags.fill_(1)  # the last step's reduction overwrote them
            self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        last = self.started + 1 == len(self.buckets)
        if last:
            self._waited_by(get_ident())  # its submission, which the engine takes as such
        try:
            bucket.handle = self._reduction.start(bucket.flat, bucket.name, self._allreduce)
        except BaseException:
            if last:
                self._waited_by(0)
            raise
        self.started += 1

    @property
    def full(self) -> bool:
        """Whether this step's hooks started every bucket."""
        return len(self.taken) == len(self.slot_of)

    def flush(self) -> None:
        """Start the buckets that no hook completed, their missing slots zeroed (a
        parameter without a gradient here contributes zeros, as on the per-tensor path)."""
        taken = self.taken
        for b in self.buckets:
            if b.handle is None:
                flags = b.flags
                if flags is not None:
                    flags.fill_(1)
                for k, (_, p, slot) in enumerate(b.members):
                    if id(p) not in taken:
                        slot.zero_()
                        if flags is not None:
                            flags[k] = 0
                self._start(b)

    def finish(self, counts: Sequence[int] | None, zero_unused: bool) -> None:
        """Wait for every bucket and give each parameter its average: those that
        contributed a gradient here, and those others had a gradient for (``counts``,
        the presence count per parameter index; None: the usual step, every member
        contributed, or the buckets carry the count: a bucket that this rank's hooks
        did not fill reads its flags). The caller resets the step afterwards
        (:meth:`reset`, from ``synchronize``'s ``_ronde_drop_step``, as on an error)."""
        taken = self.taken
        for b in self.buckets:
            try:
                out = self._reduction.result(b.handle)
            except TensorMismatchError as exc:
                held = ", ".join(repr(self._names[i]) for i, _, _ in b.members[:8])
                raise TensorMismatchError(
                    f"{exc} (gradient bucket {b.name!r} holds {len(b.members)} "
                    f"gradients: {held}{' ...' if len(b.members) > 8 else ''}); the "
                    "ranks' models or RONDE_BUCKET_BYTES differ") from None
            elsewhere: Any = counts
            # left at 0: this step's hooks filled it (flush() does not count down)
            if b.flags is not None and b.left:  # flags above 0: a rank had one
                elsewhere = {i: f > 0 for (i, _, _), f in zip(
                    b.members, out[len(out) - len(b.members):].tolist())}
            at = 0
            for i, p, slot in b.members:
                n = p.numel()
                value = slot if out is b.flat else out[at:at + n].view(p.shape)
                at += n
                grad = p.grad
                if grad is value:  # a view of its slot: the average is in place
                    continue
                if id(p) in taken or (elsewhere is not None and elsewhere[i]):
                    if grad is None or grad.is_sparse or grad.shape != p.shape:
                        p.grad = value.to(p.dtype, copy=True)
                    else:
                        grad.copy_(value)
                elif zero_unused and p.requires_grad:  # Horovod's zeros
                    p.grad = torch.zeros_like(p)

    def reset(self) -> None:
        """Forget the step in flight (after :meth:`finish`, or on an error)."""
        self.taken = set()
        self.started = 0
        for b in self.buckets:
            b.handle = None
            b.left = len(b.members)


def layout(order: Sequence[int], params: Sequence[torch.Tensor], eligible: Callable[[int], bool],
           cap_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Buckets over the parameters in ready ``order``: consecutive eligible parameters of
    one dtype, the first bucket at most ``first_bytes`` (or ``cap_bytes`` if smaller),
    the others at most ``cap_bytes``; a parameter larger than that is a bucket of its
    own. Then a bucket under 1/:data:`SMALL_FRACTION` of the first's cap joins the next
    one of its dtype (the last, the one before), over the cap."""
    out: list[list[int]] = []
    cur: list[int] = []
    first = min(first_bytes, cap_bytes)
    size, cap = 0, first
    for i in order:
        if not eligible(i):
            continue
        p = params[i]
        n = p.numel() * p.element_size()
        if cur and (size + n > cap or params[cur[0]].dtype != p.dtype):
            out.append(cur)
            cur, size, cap = [], 0, cap_bytes
        cur.append(i)
        size += n
    if cur:
        out.append(cur)
    return _join_small(out, params, first // SMALL_FRACTION)


def _join_small(out: list[list[int]], params: Sequence[torch.Tensor],
                small: int) -> list[list[int]]:
    """:func:`layout`'s buckets with each one under ``small`` bytes joined to the next
    of its dtype (the last to the one before), ready order kept."""
    def same(a: list[int], b: list[int]) -> bool:
        return params[a[0]].dtype == params[b[0]].dtype

    joined: list[list[int]] = []
    pending: list[int] = []  # a small bucket (or several) waiting for the next
    for ids in out:
        if pending and same(pending, ids):
            ids = pending + ids
        elif pending:
            joined.append(pending)
        pending = []
        if sum(params[i].numel() * params[i].element_size() for i in ids) < small:
            pending = ids
        else:
            joined.append(ids)
    if pending and joined and same(joined[-1], pending):
        joined[-1].extend(pending)
    elif pending:
        joined.append(pending)
    return joined


def agree_layout(order: Sequence[int], params: Sequence[torch.Tensor],
                 eligible: Callable[[int], bool], cap_bytes: int, process_set: ProcessSet,
                 name: str, first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Rank 0 of ``process_set`` lays the buckets out from its ``order``; every member
    returns that layout (one broadcast of ``2 x len(params)`` integers; no pickle)."""
    m = len(params)
    msg = np.full((2, m), -1, dtype=np.int64)
    root = process_set.ranks[0]
    if _api.rank() == root:
        at = 0
        for k, ids in enumerate(layout(order, params, eligible, cap_bytes, first_bytes)):
            msg[0, at:at + len(ids)] = ids
            msg[1, at:at + len(ids)] = k
            at += len(ids)
    got = _api.broadcast(msg, root, name, process_set)
    out: list[list[int]] = []
    for i, k in zip(got[0].tolist(), got[1].tolist()):
        if i < 0:
            break
        if not 0 <= i < m or k != len(out) - 1 and k != len(out):
            raise ValueError(f"{name}: a malformed bucket layout from rank {root}")
        if k == len(out):
            out.append([])
        out[k].append(i)
    return out


def carries_presence(reduction: Reduction) -> bool:
    """Whether buckets reduced by ``reduction`` may carry the presence flags: a flag of
    1 must reach every rank as a value above 0, and one of 0 as 0, which a Sum or an
    Average (any positive pre- and postscale) with at most ronde's own cast to fp16 or
    bf16 does; a custom compressor might not (it may quantize or drop small values)."""
    if reduction.op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return False
    if reduction.prescale <= 0 or reduction.postscale <= 0:
        return False
    comp = reduction.compression
    return comp is None or type(comp) is Compressor  # a user's subclass may not


def make(order: Sequence[int], params: Sequence[torch.Tensor], hooked: Any,
         names: Sequence[str], base: str, cap_bytes: int, reduction: Reduction,
         allreduce: Callable[..., Any], as_view: bool = False,
         first_bytes: int | None = None) -> Buckets | None:
    """The buckets of an optimizer's ``params`` (None where none is laid out), from rank
    0's ready ``order`` (:func:`layout`, the first bucket's cap ``first_bytes``, None:
    :data:`FIRST_BUCKET_BYTES`). A gradient goes in one when its parameter is ``hooked``
    (its hook copies it in), on the CPU, dense and floating; the rest keep their own
    reductions; ``as_view``: see :class:`Buckets`. The buckets carry the presence count
    when they hold every parameter (the layout is agreed, so every rank decides alike)
    and :func:`carries_presence`."""
    def eligible(i: int) -> bool:
        p = params[i]
        return p in hooked and p.device.type == "cpu" and not p.is_sparse and \
            p.grad is not None and not p.grad.is_sparse and p.dtype.is_floating_point

    found = agree_layout(order, params, eligible, cap_bytes, reduction.process_set,
                         f"{base}.buckets", FIRST_BUCKET_BYTES if first_bytes is None
                         else first_bytes)
    if not found:
        return None
    presence = sum(map(len, found)) == len(params) and carries_presence(reduction)
    # the steady lane reduces buckets of the global set only, uncompressed in place
    memory = _api.bucket_memory if reduction.process_set.process_set_id == 0 \
        and reduction.as_sent else None
    return Buckets(found, params, names, base, reduction, allreduce, as_view, presence,
                   memory)


def user_groups(groups: Any, params: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """``DistributedOptimizer(groups=...)``: an int (that many groups of consecutive
    ``params``) or lists of parameters, as ``{group: members}``; a group's reductions
    start together once all its members have gradients (no buckets then)."""
    if not groups:
        return {}
    if isinstance(groups, int):
        n = max(1, min(groups, len(params)))
        per = -(-len(params) // n)
        return {i: params[i * per:(i + 1) * per] for i in range(n) if params[i * per:]}
    wanted = {id(p) for p in params}
    out = {}
    for i, group in enumerate(groups):
        members = [p for p in group if id(p) in wanted]
        if len(members) != len(list(group)):
            raise ValueError(f"groups[{i}] holds tensors that are not trainable parameters "
                             "of this optimizer")
        out[i] = members
    return out
