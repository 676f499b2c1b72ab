"""``DistributedOptimizer(optimizer, op=hvd.Adasum)``: Horovod's delta optimizer.

Each rank takes its optimizer's step on its own gradients, then the ranks combine the
parameter *deltas* (new minus old) with Adasum (``collectives/adasum.py``) and every
rank applies the combined delta to the old parameters, so the parameters stay equal on
every rank. The learning rate is not scaled by the size: Adasum adapts (orthogonal
deltas add, parallel ones average), as the paper and Horovod's docs advise.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._ops import ReduceOp
from ..frameworks.naming import name_parameters
from ..process_sets import ProcessSet, global_process_set
from . import _collectives as C
from ._compile import eager
from ._wrap import inner, wrap


class _AdasumMixin:
    """Methods mixed in front of the user's optimizer class (see the module docstring)."""

    param_groups: list[dict[str, Any]]

    def _ronde_adasum_init(self, named_parameters: Any, process_set: ProcessSet) -> None:
        self._ronde_ps = process_set
        self._ronde_names = name_parameters(self.param_groups, named_parameters)

    @eager  # a compiled step runs these eagerly (graph breaks)
    def synchronize(self) -> None:
        """Nothing to wait for: the deltas are combined inside ``step()``."""

    @eager
    def step(self, closure: Any = None) -> Any:
        """Run ``closure`` if given (its gradients are the ones stepped on), take the local
        step, then combine the deltas; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        before = [p.detach().clone() for p in params]
        out = inner(self, _AdasumMixin, "step")()
        with torch.no_grad():
            handles = []
            for p, old in zip(params, before):
                delta = (p.detach() - old).contiguous()
                handles.append(C.allreduce_async_(
                    delta, name=f"adasum.delta.{self._ronde_names[id(p)]}", op=ReduceOp.ADASUM,
                    process_set=self._ronde_ps))
            for p, old, h in zip(params, before, handles):
                p.copy_(old + C.synchronize(h))
        return loss if closure is not None else out

    step.hooked = True  # type: ignore[attr-defined]  # see optimizer.py


def AdasumOptimizer(optimizer: torch.optim.Optimizer,
                    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                    process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """``optimizer`` as a delta optimizer combining its steps with Adasum."""
    return wrap(optimizer, _AdasumMixin,
                lambda w: w._ronde_adasum_init(named_parameters, process_set),
                "DistributedOptimizer(op=Adasum)")
