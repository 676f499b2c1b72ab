"""The blocking, differentiable collectives (Horovod's ``allreduce``, ``allgather`` ...).

Each is a ``torch.autograd.Function`` whose backward is itself a collective, so a
loss computed from a collective's output back-propagates to every rank's input:

* allreduce: the gradient is allreduced with the same op and scale factors
  (Sum -> Sum, Average -> Average). Min/Max send the summed gradient to the
  elements that were selected (all tied ones); Product has no gradient here.
* allgather: the gradient is *averaged* over ranks, and each rank keeps the rows of its
  own input (Horovod's rule: with the same loss on every rank, each rank's input gets the
  gradient of one copy of that loss).
* broadcast: the gradient is averaged over ranks and delivered to the root; the other
  ranks' inputs get zeros (their values were not used). Horovod's rule too.
* alltoall: the gradient goes back by an alltoall with the received splits.
* reducescatter: the gradient is allgathered, times the set size for Sum, times the
  scale factors (Horovod's rule, which leaves out the 1/size of Average).

These are the rules of Horovod's own autograd functions (docs/compat.md), so a model
that trains with Horovod trains the same here.

Backward collectives are named ``<name>.grad`` when the forward had a name.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import _api, _objects
from .._errors import UnsupportedError
from .._ops import ReduceOp
from ..frameworks.compression import Compresses
from ..frameworks.gradients import Reduction
from ..process_sets import ProcessSet, global_process_set
from . import _collectives as C
from .compression import Compression


def _gname(name: str | None, suffix: str = "grad") -> str | None:
    return f"{name}.{suffix}" if name is not None else None


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float,
                name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.name, ctx.ps = op, pre, post, name, ps
        out = C.allreduce_async(tensor, None, name, op, pre, post, ps).wait()
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            ctx.save_for_backward(tensor, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op = ctx.op
        if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            g = C.allreduce_async(grad.contiguous(), None, _gname(ctx.name), op, ctx.pre, ctx.post,
                                  ctx.ps).wait()
        elif op in (ReduceOp.MIN, ReduceOp.MAX):
            tensor, out = ctx.saved_tensors
            if ctx.pre != 1.0 or ctx.post != 1.0:
                raise NotImplementedError("the gradient of a Min/Max allreduce with scale "
                                          "factors is not implemented")
            g = C.allreduce_async(grad.contiguous(), None, _gname(ctx.name), ReduceOp.SUM, 1.0,
                                  1.0, ctx.ps).wait()
            g = g * (tensor == out).to(g.dtype)
        else:
            raise NotImplementedError(f"the gradient of an allreduce with op={op.name} is not "
                                      "implemented; use Sum or Average")
        return g, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Compresses = Compression.none, op: Any = None,
              prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks of the process set; differentiable.

    Args:
        tensor: the tensor to reduce (same shape and dtype on every rank).
        average: deprecated; ``True`` means ``op=Average``, ``False`` ``op=Sum``.
        name: the collective's name (matches the ranks' calls; auto if None).
        compression: ``Compression.none``, ``.fp16`` or ``.bf16`` (cast on the wire).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiplies each input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part (default: all).

    Returns:
        A new tensor with the reduced values (the input is unchanged).
    """
    red = Reduction(C.resolve_op(op, average), prescale_factor, postscale_factor, compression,
                    process_set)
    return red.apply(tensor, name, lambda sent, op_, pre, post: _Allreduce.apply(
        sent, ReduceOp(op_), pre, post, name, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: ReduceOp, pre: float, post: float, name: str | None,
                ps: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post, ctx.name, ctx.ps = op, pre, post, name, ps
        return tuple(C.grouped_allreduce_async(tensors, None, name, op, pre, post, ps).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if ctx.op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise NotImplementedError("grouped_allreduce is differentiable for Sum/Average only")
        gs = C.grouped_allreduce_async([g.contiguous() for g in grads], None, _gname(ctx.name),
                                       ctx.op, ctx.pre, ctx.post, ctx.ps).wait()
        return (None, None, None, None, None, *gs)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Compresses = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors together (fused when they fit); differentiable."""
    red = Reduction(C.resolve_op(op, average), prescale_factor, postscale_factor, compression,
                    process_set)
    if not tensors:
        return []
    pairs = [compression.compress(t) for t in tensors]
    # one op for the group, as its first tensor is sent (a group holds one dtype)
    op_, pre, post = red.wire(tensors[0], *pairs[0])
    outs = _GroupedAllreduce.apply(ReduceOp(op_), pre, post, name, process_set,
                                   *[p[0] for p in pairs])
    return [red.decompress(o, c, None) for o, (_, c) in zip(outs, pairs)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                ps: ProcessSet) -> torch.Tensor:
        ctx.name, ctx.ps, ctx.rows = name, ps, tensor.shape[0]
        return C.allgather_async(tensor, name, ps).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return (*_allgather_grads([grad], [ctx.rows], ctx.name, ctx.ps), None, None)


def _allgather_grads(grads: Sequence[torch.Tensor], rows: Sequence[int], name: str | None,
                     ps: ProcessSet) -> list[torch.Tensor]:
    """Horovod's allgather gradient: the average over ranks, this rank's rows of it."""
    n = len(grads)
    gnames = _api.group_names("allgather.grad", _gname(name), n, ps)
    hs = [C.allreduce_async(g.contiguous(), None, gn, ReduceOp.AVERAGE, process_set=ps)
          for g, gn in zip(grads, gnames)]
    counts = C.allgather_async(torch.tensor([list(rows)], dtype=torch.int64),
                               _gname(name, "grad.rows") if name else None, ps).wait()
    me = _api.set_rank(ps)
    offsets = counts[:me].sum(dim=0).tolist() if me else [0] * n
    return [h.wait().narrow(0, int(off), r) for h, off, r in zip(hs, offsets, rows)]


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0, in rank order; differentiable.

    The first dimension may differ between ranks; the others and the dtype must agree.
    """
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; "
                         "reshape scalars to shape (1,)")
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, ps: ProcessSet,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.name, ctx.ps, ctx.rows = name, ps, [t.shape[0] for t in tensors]
        return tuple(C.grouped_allgather_async(tensors, name, ps).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *_allgather_grads(grads, ctx.rows, ctx.name, ctx.ps))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather every tensor of the list (see :func:`allgather`); differentiable."""
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("grouped_allgather needs tensors with at least one dimension; "
                         "reshape scalars to shape (1,)")
    if not tensors:
        return []
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None,
                ps: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.name, ctx.ps = root, name, ps
        return C.broadcast_async(tensor, root, name, ps).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        avg = C.allreduce_async(grad.contiguous(), None, _gname(ctx.name), ReduceOp.AVERAGE,
                                process_set=ctx.ps).wait()
        if _api.rank() != ctx.root:
            avg = torch.zeros_like(avg)
        return avg, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s tensor on every rank (a new tensor); differentiable."""
    return _Broadcast.apply(tensor, int(root_rank), name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                ps: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.name, ctx.ps = name, ps
        n = C.set_size(ps)
        if splits is None:
            splits = [tensor.shape[0] // n] * n if tensor.dim() and n else None
        out, received = C.alltoall_async(tensor, splits, name, ps).wait()
        ctx.received = received.tolist()
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Any:
        g, _ = C.alltoall_async(grad.contiguous(), ctx.received, _gname(ctx.name), ctx.ps).wait()
        return g, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send block i of ``tensor`` to rank i; differentiable.

    Returns the received blocks concatenated in rank order; with ``splits`` given,
    ``(output, received_splits)`` as in Horovod.
    """
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    if splits is not None:
        if isinstance(splits, torch.Tensor):
            splits = splits.detach().cpu().reshape(-1).tolist()
        return _Alltoall.apply(tensor, list(splits), name, process_set)
    n = C.set_size(process_set)
    if tensor.shape[0] % n:
        raise ValueError(f"alltoall without splits needs the first dimension "
                         f"({tensor.shape[0]}) divisible by the number of ranks ({n}); "
                         "pass splits=")
    return _Alltoall.apply(tensor, None, name, process_set)[0]


def _reducescatter_scale(op: ReduceOp, pre: float, post: float, ps: ProcessSet) -> float:
    """Horovod's factor on a reducescatter's incoming gradient (size for Sum, the scales)."""
    return (C.set_size(ps) if op == ReduceOp.SUM else 1) * pre * post


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float,
                name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.scale, ctx.name, ctx.ps = _reducescatter_scale(op, pre, post, ps), name, ps
        return C.reducescatter_async(tensor, name, op, ps, pre, post).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        g = grad * ctx.scale if ctx.scale != 1.0 else grad
        g = C.allgather_async(g.contiguous(), _gname(ctx.name), ctx.ps).wait()
        return g, None, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: ReduceOp, pre: float, post: float, name: str | None,
                ps: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.scale, ctx.name, ctx.ps = _reducescatter_scale(op, pre, post, ps), name, ps
        return tuple(C.grouped_reducescatter_async(tensors, name, op, ps, pre, post).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        gs = [(g * ctx.scale if ctx.scale != 1.0 else g).contiguous() for g in grads]
        outs = C.grouped_allgather_async(gs, _gname(ctx.name), ctx.ps).wait()
        return (None, None, None, None, None, *outs)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Compresses = Compression.none, op: Any = ReduceOp.AVERAGE,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter every tensor of the list; differentiable (see :func:`reducescatter`)."""
    resolved = C.resolve_op(op, None, what="reducescatter", allowed=_api.REDUCESCATTER_OPS)
    if not tensors:
        return []
    if any(t.dim() == 0 for t in tensors):
        raise UnsupportedError("grouped_reducescatter needs tensors with at least one "
                               "dimension; reshape scalars to shape (1,)")
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(resolved, prescale_factor, postscale_factor, name,
                                       process_set, *[p[0] for p in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Compresses = Compression.none, op: Any = ReduceOp.AVERAGE,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks and give rank r its block of dimension 0; differentiable.

    Blocks are as even as possible, the first ranks taking one extra row. Only
    ``Sum`` and ``Average`` (default) are supported.
    """
    resolved = C.resolve_op(op, None, what="reducescatter", allowed=_api.REDUCESCATTER_OPS)
    if tensor.dim() == 0:
        raise UnsupportedError("reducescatter needs a tensor with at least one dimension; "
                               "reshape scalars to shape (1,)")
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, resolved, prescale_factor, postscale_factor, name,
                               process_set)
    return compression.decompress(out, cctx)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather a picklable object (tensors included) from every rank, in rank order."""
    return _objects.allgather_object(obj, name, process_set)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Broadcast a picklable object (tensors included) from ``root_rank``."""
    return _objects.broadcast_object(obj, root_rank, name, process_set)
