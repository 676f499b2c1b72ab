"""``SyncBatchNorm``: batch normalization with statistics over every rank's batch.

In training mode each rank computes, per channel, its sample count, mean and sum
of squared deviations; one allgather shares them and every rank combines them
exactly (Chan's parallel formula, robust to different batch sizes per rank, empty
ones included). The backward pass allreduces the two per-channel sums the input
gradient needs (sum of dy, sum of dy * (x - mean)), so gradients equal those of
one BatchNorm over the concatenated batch. Running statistics are updated as
``torch.nn.BatchNorm*d`` does (unbiased variance, ``momentum=None`` for a
cumulative average). In eval mode, or with one rank, it is plain local BatchNorm.

Collectives are named by the running job's count of SyncBatchNorm calls on the process
set (``ronde._api.auto_name``), so every rank must run the same SyncBatchNorm layers in
training mode in the same order (which data-parallel training does). The count starts
again with each ``init()``: a worker that joins an elastic job counts from where the
others do after the reset (a per-process count did not, and the names differed).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .. import _api
from .._ops import ReduceOp
from ..process_sets import ProcessSet, global_process_set
from . import _collectives as C

def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float,
                ps: ProcessSet) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        xf = x.to(_acc_dtype(x))
        n_local = x.numel() // c if c else 0
        if n_local:
            mean_l = xf.mean(dims)
            m2_l = ((xf - mean_l.view(shape)) ** 2).sum(dims)
        else:
            mean_l = torch.zeros(c, dtype=xf.dtype)
            m2_l = torch.zeros(c, dtype=xf.dtype)
        stats = torch.cat([torch.tensor([float(n_local)], dtype=xf.dtype), mean_l.cpu(),
                           m2_l.cpu()]).unsqueeze(0)
        name = _api.auto_name("sync_batch_norm", None, ps)
        every = C.allgather_async(stats, name, ps).wait().to(xf.device)
        counts, means, m2s = every[:, :1], every[:, 1:c + 1], every[:, c + 1:]
        n = float(counts.sum())
        if n == 0:
            raise ValueError("SyncBatchNorm got an empty batch on every rank")
        mean = (counts * means).sum(0) / n
        m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
        var = m2 / n
        invstd = torch.rsqrt(var + eps)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.to(xf.dtype).view(shape)
        if bias is not None:
            y = y + bias.to(xf.dtype).view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.n, ctx.name, ctx.ps, ctx.has_bias = n, name, ps, bias is not None
        unbiased = m2 / (n - 1) if n > 1 else torch.full_like(m2, float("nan"))
        ctx.mark_non_differentiable(mean, unbiased)
        return y.to(x.dtype), mean, unbiased

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor, _gm: Any, _gv: Any) -> Any:
        x, weight, mean, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, x.dim()))
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        dy = gy.to(mean.dtype)
        xmu = x.to(mean.dtype) - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_w = (sum_dy_xmu * invstd).to(weight.dtype) \
            if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy.to(weight.dtype if weight is not None else x.dtype) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xmu]).cpu()
            both = C.allreduce_async(both, None, f"{ctx.name}.grad", ReduceOp.SUM,
                                     process_set=ctx.ps).wait().to(x.device)
            c = x.shape[1]
            g_dy, g_dy_xmu = both[:c] / ctx.n, both[c:] / ctx.n
            scale = invstd if weight is None else invstd * weight.to(mean.dtype)
            grad_x = (dy - g_dy.view(shape) - xmu * (invstd ** 2 * g_dy_xmu).view(shape)) \
                * scale.view(shape)
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_w, grad_b, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` with statistics over all ranks.

    Args:
        num_features: channels ``C`` of an input of shape ``(N, C, ...)``.
        eps: added to the variance for numerical stability.
        momentum: running-statistics factor (``None``: cumulative average).
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running mean/variance for eval mode.
        process_set: the ranks whose batches are normalized together (default: all).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; synchronized over ranks in training mode."""
        self._check_input_dim(input)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or not _api.is_initialized() or C.set_size(self.process_set) == 1:
            return self._local(input)
        factor = 0.0
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else float(self.momentum))
        y, mean, var = _SyncBatchNormFn.apply(input, self.weight, self.bias, self.eps,
                                              self.process_set)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype),
                                                       alpha=factor)
        return y

    def _local(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: ProcessSet = global_process_set) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` by a ``SyncBatchNorm`` (same state)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            if module.track_running_stats:
                out.running_mean = module.running_mean
                out.running_var = module.running_var
                out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out
