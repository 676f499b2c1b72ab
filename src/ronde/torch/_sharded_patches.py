"""torch's own gradient functions taught about ``ShardedOptimizer`` (docs/sharding.md,
"Recipes"), and the global-norm clip and the DDP check they rely on.

A sharded optimizer's ``p.grad`` is not the averaged gradient: after backward, stage 1
leaves this rank's own gradient there (a view of a bucket being reduce-scattered),
stage 2 leaves None; the average exists only as slices, each on the rank that owns it.
Code written for one process or DDP reads ``p.grad`` between backward and ``step()``:
``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` (Hugging Face Trainer,
accelerate, Lightning's precision plugin, most scripts) and ``GradScaler.unscale_`` (AMP).
Both would be silently wrong, so from the first ``ShardedOptimizer`` on, ronde replaces:

* ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (in ``torch.nn.utils``
  and ``torch.nn.utils.clip_grad``): parameters (or pieces) of a live sharded optimizer
  go to its :meth:`~ronde.torch._sharded_mixin._ShardedMixin.clip_grad_norm_` (the global norm
  of the averaged gradient, one allreduce of a number) or ``clip_grad_value_``; any
  other tensors to torch's own function, unchanged;
* ``torch.nn.utils.clip_grads_with_norm_`` and the ``_clip_grads_with_norm_`` that
  torch's ``clip_grad_norm_`` calls: refused for a sharded optimizer's parameters (the
  norm handed in was computed from ``p.grad``), which catches a ``clip_grad_norm_``
  taken by name before this patch existed, before it writes anything;
* ``torch.amp.GradScaler.unscale_`` (which ``scaler.step`` calls): a sharded optimizer
  synchronizes first, so the scaler unscales and checks the averaged slices, and the
  ranks agree on non-finite slices (:meth:`synchronize`), so every rank skips the same
  steps.

Patching was chosen over refusing because refusing would break every Trainer,
accelerate and Lightning script that clips, and over fake gradients (a ``p.grad`` whose
norm is right) because torch gives a gradient no hook to compute a norm across ranks.
What a patch cannot see (a reference to torch's function taken before the first
``ShardedOptimizer``, DDP around the model, ``p.grad`` changed in place) ``synchronize()`` detects
on every rank, before the step (``ModifiedGradientsError``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable

import torch

from .._errors import RondeError, UnsupportedError

log = logging.getLogger(__name__)

#: the sharded optimizers alive now
_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
_installed = False


def install(optimizer: Any) -> None:
    """Register ``optimizer`` (a ``ShardedOptimizer``) and patch torch's functions once."""
    global _installed
    _live.add(optimizer)
    if _installed:
        return
    _installed = True
    from torch.nn.utils import clip_grad

    norm, value, scale = clip_grad.clip_grad_norm_, clip_grad.clip_grad_value_, \
        clip_grad._clip_grads_with_norm_
    routed_norm = functools.wraps(norm)(functools.partial(_clip_norm, norm))
    routed_value = functools.wraps(value)(functools.partial(_clip_value, value))
    guarded = functools.wraps(scale)(functools.partial(_clip_with_norm, scale))
    for module in (torch.nn.utils, clip_grad):
        module.clip_grad_norm_ = routed_norm
        module.clip_grad_value_ = routed_value
    clip_grad._clip_grads_with_norm_ = guarded
    torch.nn.utils.clip_grads_with_norm_ = guarded
    unscale = torch.amp.GradScaler.unscale_
    torch.amp.GradScaler.unscale_ = functools.wraps(unscale)(
        lambda self, optimizer: _unscale(unscale, self, optimizer))
    log.debug("torch's clip_grad_norm_, clip_grad_value_ and GradScaler.unscale_ now "
              "route a ShardedOptimizer's parameters to it")


def _owner(parameters: Any, what: str) -> tuple[Any, list[torch.Tensor]]:
    """The live sharded optimizer that owns every tensor of ``parameters`` (None where
    none owns any), and the tensors as a list."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not _live:
        return None, params
    owner_of = [next((opt for opt in list(_live) if opt.owns(p)), None) for p in params]
    owners = {id(o): o for o in owner_of if o is not None}
    if not owners:
        return None, params
    if len(owners) > 1 or any(o is None for o in owner_of):
        raise UnsupportedError(
            f"torch.nn.utils.{what} over the parameters of a ShardedOptimizer together with "
            "other tensors (or another ShardedOptimizer's): the global norm of a sharded "
            "optimizer's gradient is its own; clip each optimizer's parameters in a call of "
            "their own, or call opt.clip_grad_norm_(max_norm) on each")
    return next(iter(owners.values())), params


def _clip_norm(original: Callable[..., Any], parameters: Any, max_norm: float,
               norm_type: float = 2.0, error_if_nonfinite: bool = False,
               foreach: bool | None = None) -> torch.Tensor:
    if not _live:
        return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    opt, params = _owner(parameters, "clip_grad_norm_")
    if opt is None:
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, parameters=params)


def _clip_value(original: Callable[..., Any], parameters: Any, clip_value: float,
                foreach: bool | None = None) -> None:
    if not _live:
        return original(parameters, clip_value, foreach)
    opt, params = _owner(parameters, "clip_grad_value_")
    if opt is None:
        return original(params, clip_value, foreach)
    return opt.clip_grad_value_(clip_value, parameters=params)


def _clip_with_norm(original: Callable[..., Any], parameters: Any, max_norm: float,
                    total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if _live and _owner(params, "clip_grads_with_norm_")[0] is not None:
        raise UnsupportedError(
            "ShardedOptimizer: gradients clipped with a norm computed from p.grad (torch's "
            "clip_grad_norm_ taken by name before the first ShardedOptimizer, or "
            "get_total_norm + clip_grads_with_norm_): p.grad is not the averaged gradient, "
            "so the norm is "
            "wrong; call opt.clip_grad_norm_(max_norm) (the global norm), or "
            "torch.nn.utils.clip_grad_norm_(...) by its module path")
    return original(params, max_norm, total_norm, foreach)


def _unscale(original: Callable[..., Any], scaler: Any, optimizer: Any) -> None:
    if optimizer in _live and scaler.is_enabled():
        optimizer.before_unscale()  # the averaged slices, agreed finite or not
    return original(scaler, optimizer)


def clip_by_total_norm(grads: list[torch.Tensor], max_norm: float, norm_type: float,
                       error_if_nonfinite: bool,
                       total: Callable[[torch.Tensor, bool], torch.Tensor] | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """Scale ``grads`` (this rank's averaged slices) so that the norm of every rank's
    together is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does for one
    process; returns that norm. ``total(local, is_max)`` sums (or, for the inf norm,
    takes the largest of) a one-element float64 tensor over the ranks; None: one rank."""
    p_ = float(norm_type)
    inf = p_ == float("inf")
    local = torch.tensor([max((float(g.abs().max()) for g in grads), default=0.0) if inf
                          else sum(float(g.double().abs().pow(p_).sum()) for g in grads)],
                         dtype=torch.float64)
    summed = local if total is None else total(local, inf)
    norm = float(summed[0]) if inf else float(summed[0]) ** (1.0 / p_)
    if error_if_nonfinite and not torch.isfinite(torch.tensor(norm)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To "
                           "disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    scale = float(max_norm) / (norm + 1e-6)
    if scale < 1.0:
        with torch.no_grad():
            for g in grads:
                g.mul_(scale)
    return torch.tensor(norm, dtype=dtype)


def ddp_wraps(params: list[torch.Tensor]) -> bool:
    """Whether a torch ``DistributedDataParallel`` wraps any of ``params`` (it would
    average them too, writing into ronde's buckets or dropping its result). Looked for
    only where a torch process group exists (a scan of the live objects, once)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    import gc

    mine = {id(p) for p in params}
    return any(isinstance(obj, torch.nn.parallel.DistributedDataParallel)
               and any(id(p) in mine for p in obj.module.parameters())
               for obj in gc.get_objects())


class ModifiedGradientsError(RondeError):
    """A ``ShardedOptimizer``'s gradients were changed behind its back between backward
    and ``step()`` (raised on every rank, before the step)."""


def modified_gradients(ranks: int, changed: list[str]) -> ModifiedGradientsError:
    """The error of ``ranks`` ranks whose gradients changed (``changed``: this rank's)."""
    return ModifiedGradientsError(
        f"ShardedOptimizer: on {ranks} rank(s) (here: "
        f"{', '.join(changed[:4]) or 'not this rank'}) the gradients were changed "
        "after backward() handed them to ronde and before step(), while they were "
        "being averaged: the result would be wrong. Causes: the model wrapped in "
        "torch DistributedDataParallel (ronde averages the gradients: remove DDP, "
        "e.g. ronderun -x RONDE_TORCHRUN_ENV=0 for Hugging Face Trainer), or "
        "torch.nn.utils.clip_grad_norm_/clip_grad_value_ called through a reference "
        "taken before the first ShardedOptimizer was made (call opt.clip_grad_norm_(max_norm) "
        "or torch.nn.utils.clip_grad_norm_(...) by its module path), or p.grad "
        "changed in place (change the averaged slices after opt.synchronize())")
