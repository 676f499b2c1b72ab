"""``ShardedOptimizer``: the optimizer's state (stage 1) and the gradients (stage 2) split
over the ranks, for any torch optimizer whose step is elementwise (ZeRO, arXiv 1910.02054;
docs/sharding.md for users).

Layout: the parameters, in reverse order (backward's), go in buckets of one dtype laid out
as :mod:`._buckets` does; a bucket of ``L`` elements is padded to ``N * S`` (``S =
ceil(L / N)``) and rank ``r`` owns elements ``[r*S, (r+1)*S)``: split by elements, not by
tensors, so the ranks' shares differ by at most one element a bucket. The layout follows
from the parameter table (compared across ranks when the optimizer is made) and ``N``.

Pieces: the part of a parameter this rank owns is a flat view of its storage
(``p.detach().view(-1)[a:b]``), and that storage is its bucket's flat buffer (each
parameter a view of it, ``RONDE_SHARDED_FLAT_PARAMS``: :mod:`._shards`); the param groups
hold the pieces, so the optimizer's state exists for them only, LR schedulers still work,
and the optimizer's own step updates the owned part of each parameter in place.

A step: each final gradient is copied by its hook into its bucket, and a full bucket
starts a reduce-scatter (Average) while backward goes on; at the end of the backward pass
(an autograd callback) every bucket not started in it starts, with zeros where this rank
has no gradient, so every rank reduces every bucket exactly once per window (stage 1) or
per pass (stage 2, which frees ``p.grad`` and the bucket buffers as it goes; a rank
ahead of a slow peer holds the buckets in flight until it catches up: waiting for the
oldest inside a hook could deadlock where ranks start buckets in different orders).
``step()`` gives each piece its averaged slice as ``.grad`` (None where no rank had a
gradient: DDP's rule, one presence count a step), steps on the pieces, and allgathers the
updated slices into the buckets' flat buffers, the parameters: the volume of one allreduce.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._errors import UnsupportedError
from .._ops import ReduceOp
from ..frameworks.compression import Compresses
from ..process_sets import ProcessSet, global_process_set
from . import _collectives as C
from ._elementwise import check_elementwise
from ._sharded_mixin import _ShardedMixin, sharded
from ._sharded_patches import ModifiedGradientsError
from ._units import Units
from .compression import Compression

__all__ = ["ModifiedGradientsError", "ShardedOptimizer", "is_sharded"]


def ShardedOptimizer(optimizer: torch.optim.Optimizer,
                     named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                     stage: int = 1, backward_passes_per_step: int = 1,
                     compression: Compresses = Compression.none, op: Any = ReduceOp.AVERAGE,
                     process_set: ProcessSet = global_process_set,
                     elementwise: bool | None = None, sparse_as_dense: bool = False,
                     model: torch.nn.Module | None = None,
                     units: list[torch.nn.Module] | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that each rank keeps ``1/N`` of its state (and, with
    ``stage=2``, of the gradients), and ``step()`` applies gradients averaged over all
    ranks: the same update as ``DistributedOptimizer``, in less memory.

    Every rank must make it (it compares the parameter tables across ranks).

    Args:
        optimizer: a constructed torch optimizer whose step is elementwise (SGD, Adam,
            AdamW, RMSprop, Adagrad...); use the returned object instead. State it holds
            already (loaded before wrapping) is cut to this rank's part.
        named_parameters: ``model.named_parameters()``: names in errors and checkpoints
            (recommended: :func:`save_sharded` files are keyed by these names).
        stage: 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters too:
            each unit of ``model`` gathered only while it runs, :mod:`._units`).
        backward_passes_per_step: backward passes per step (see the module doc).
        compression: ``Compression.none``, ``.fp16`` or ``.bf16`` for the reduce-scatter.
        op: ``Average`` only (Adasum and Sum are refused).
        process_set: the ranks that shard (default: all); outside it, a plain optimizer.
        elementwise: True to vouch for an optimizer ronde does not know; False refuses.
        sparse_as_dense: refused if True (sparse gradients cannot be sharded).
        model: stage 3: the model whose parameters these are (its units are hooked).
        units: stage 3: the submodules gathered one at a time (default: each child of
            ``model`` that holds parameters).

    Raises:
        UnsupportedError: an optimizer that needs whole tensors, Adasum or Sum, sparse
            gradients or parameters, a non-contiguous parameter.
        TensorMismatchError: the ranks' parameters differ.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"ShardedOptimizer: stage must be 1, 2 or 3, got {stage!r}")
    resolved = C.resolve_op(op, None)
    if resolved != ReduceOp.AVERAGE:
        raise UnsupportedError("ShardedOptimizer averages gradients: op=Adasum and op=Sum are "
                               "not supported (Adasum combines whole gradients pairwise; use "
                               "DistributedOptimizer(op=hvd.Adasum))")
    if sparse_as_dense:
        raise UnsupportedError("ShardedOptimizer: sparse gradients cannot be sharded; use "
                               "DistributedOptimizer(sparse_as_dense=True)")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    check_elementwise(optimizer, elementwise)
    parts = Units(model, units) if stage == 3 else None  # (model= needed: refused here)
    out = sharded(optimizer, named_parameters, stage, backward_passes_per_step, compression,
                  process_set, parts)
    if parts is not None:
        parts.attach(out)
    return out


def is_sharded(optimizer: Any) -> bool:
    """True for an optimizer returned by :func:`ShardedOptimizer`."""
    return isinstance(optimizer, _ShardedMixin)
