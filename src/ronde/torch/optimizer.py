"""``DistributedOptimizer``: averages gradients across ranks while backward runs.

The wrapper is a dynamic subclass of the user's optimizer class (so
``isinstance(opt, torch.optim.SGD)`` holds and LR schedulers work) sharing the
original's attributes, one ``__dict__`` (``_wrap.py``: an LR scheduler made before
wrapping keeps counting steps, and the distributed step still runs). A
``post_accumulate_grad`` hook on every trainable parameter starts an asynchronous
in-place allreduce of ``p.grad`` as soon as the gradient is final, so communication
overlaps the rest of backward; ``step()`` waits for all of them (:meth:`synchronize`)
and then runs the inner step.

Semantics (as Horovod's, where it defines them):

* ``backward_passes_per_step=N``: the first N-1 backward passes accumulate locally
  (torch sums into ``p.grad``); the N-th starts the allreduce. ``step()`` after fewer
  passes (a partial last window) reduces what was accumulated; nothing is rescaled,
  so divide the loss by N yourself for a mean over micro-batches. N+1 passes before
  a step raise ``TooManyPassesError`` from ``backward()``.
* Every parameter of the optimizer's groups takes part, whatever its ``requires_grad``
  when the wrapper was made: the hooks follow ``requires_grad`` (a parameter unfrozen
  later is hooked, one frozen later unhooked, at the next ``synchronize()``; in that
  one step the unfrozen one's gradient is reduced there, without overlap).
* A parameter has a gradient to contribute when it is trainable and ``p.grad`` is not
  None. Which parameters have one is agreed every step by one small allreduce of
  per-parameter counts (the *presence* count), started along with the last gradient's
  allreduce in the usual step. A parameter with a gradient on some ranks only is
  reduced with zeros from the others (DDP's and Horovod's rule). One with a gradient on
  no rank keeps ``grad=None``, so the optimizer leaves it alone, as in one process and
  under DDP: a layer frozen, or unused, does not move under weight decay or momentum.
  ``zero_unused_grads=True`` gives Horovod's zero gradient instead (to trainable
  parameters only).
* ``step(closure)`` runs the closure first (under ``torch.enable_grad()``: forward and
  backward, as PyTorch Lightning's closures do), then reduces, then steps, and returns
  the closure's loss.
* ``step()`` when no parameter has a gradient at all raises ``RondeError`` (usually
  a forgotten ``loss.backward()``).
* At the first ``synchronize()`` the ranks compare their parameter tables
  (``allgather_object``) and raise ``TensorMismatchError`` naming the differing
  parameters instead of waiting for an allreduce that one rank never submits.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Iterable, Sequence

import torch

from .. import _api, _state
from .._errors import ProcessSetError, RondeError, UnsupportedError
from .._ops import ReduceOp
from ..frameworks.accumulation import PassCounter
from ..frameworks.compression import Compresses
from ..frameworks.gradients import Reduction, Started
from ..frameworks.naming import (gradient_name, name_parameters, presence_name,
                                 require_same_parameters)
from ..process_sets import ProcessSet, global_process_set
from . import _buckets, _device
from . import _collectives as C
from ._compile import eager
from ._tensors import dtype_name
from ._wrap import SkipSynchronize, inner, wrap
from .compression import Compression

logger = logging.getLogger(__name__)


class _DistributedMixin(SkipSynchronize):
    """Methods mixed in front of the user's optimizer class."""

    param_groups: list[dict[str, Any]]

    def _ronde_init(self, named_parameters: Any, compression: Compresses,
                    backward_passes_per_step: int,
                    op: Any, gradient_predivide_factor: float, groups: Any,
                    sparse_as_dense: bool, process_set: ProcessSet,
                    zero_unused_grads: bool) -> None:
        # (Adasum went to torch/adasum.py before this)
        red = Reduction.configure(op, gradient_predivide_factor, compression, process_set,
                                  backward_passes_per_step)
        #: the op, scales and compression (frameworks/gradients.py: every binding's)
        self._ronde_reduction = red
        self._ronde_sparse_as_dense = bool(sparse_as_dense)
        self._ronde_ps = process_set
        self._ronde_counter: PassCounter[torch.Tensor] = PassCounter(red.passes_per_step)
        self._ronde_names = name_parameters(self.param_groups, named_parameters)
        #: every parameter, trainable or not (requires_grad may change after wrapping);
        #: the presence counts are in this order
        self._ronde_params = [p for g in self.param_groups for p in g["params"]]
        trainable = [p for p in self._ronde_params if p.requires_grad]
        self._ronde_zero_unused = bool(zero_unused_grads)
        #: Horovod's attributes, which tests and user code read
        self._parameter_names = {p: self._ronde_names[id(p)] for g in self.param_groups
                                 for p in g["params"]}
        self._requires_update: set[torch.Tensor] = set()  # the hooked parameters
        self.process_set = process_set
        self.op = ReduceOp(red.op)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.gradient_predivide_factor = gradient_predivide_factor
        #: a rank outside the process set steps on its own gradients, as in Horovod
        if process_set is not global_process_set and process_set.process_set_id is None:
            raise ProcessSetError(f"DistributedOptimizer: {process_set!r} is not registered; "
                                  "call hvd.add_process_set() on every rank first")
        self._ronde_member = process_set is global_process_set or process_set.included()
        #: parameter -> its gradient's reduction in flight (a sparse one: its gather)
        self._ronde_handles: dict[torch.Tensor, Any] = {}
        #: the step's allreduce of how many ranks have each gradient, and its name
        self._ronde_presence: Any = None
        self._ronde_presence_name = presence_name(self._ronde_names[id(self._ronde_params[0])])
        self._ronde_all_groups = _buckets.user_groups(groups, trainable)
        self._ronde_groups: dict[int, list[torch.Tensor]] = {}
        self._ronde_group_of: dict[int, int] = {}
        self._ronde_ready: dict[int, set[int]] = {}
        self._ronde_validated = -1  #: the job generation the parameters were checked in
        self._ronde_buckets: _buckets.Buckets | None = None  # (:attr:`gradient_buckets`)
        #: the buckets, where every hook may go straight to them (``_ronde_set_buckets``)
        self._ronde_lean: _buckets.Buckets | None = None
        self._ronde_syncs = 0  #: synchronize() calls in this generation
        self._ronde_order: list[int] | None = None
        self._ronde_index = {id(p): i for i, p in enumerate(self._ronde_params)}
        self._ronde_synchronized, self._ronde_should_sync = False, True
        if self._ronde_member:  # the device path's collectives now, not in a hook
            _device.prepare([p for p in self._ronde_params if not p.is_sparse], process_set)
        #: parameter -> its gradient hook: the trainable ones (see _ronde_rehook)
        self._ronde_hooks: dict[torch.Tensor, Any] = {}
        self._ronde_rehook()

    # -- set-up --------------------------------------------------------------------------
    def _ronde_rehook(self) -> None:
        """Hook exactly the parameters trainable now (at construction, and at a
        ``synchronize()`` that found one changed): a frozen one cannot be hooked, and one
        frozen since would keep the presence count from starting early."""
        hooks = self._ronde_hooks
        for p in self._ronde_params if self._ronde_member else ():
            if p.requires_grad and p not in hooks:
                hooks[p] = p.register_post_accumulate_grad_hook(self._ronde_hook)
            elif not p.requires_grad and p in hooks:
                hooks.pop(p).remove()
        self._requires_update = set(hooks)
        self._ronde_unhooked_at = [i for i, p in enumerate(self._ronde_params) if p not in hooks]
        self._ronde_unhooked = [self._ronde_params[i] for i in self._ronde_unhooked_at]
        #: this rank's presence when every hooked parameter has a gradient (the usual step)
        self._ronde_usual = torch.tensor([int(p in hooks) for p in self._ronde_params],
                                         dtype=torch.int32)
        self._ronde_groups = {gid: [q for q in members if q in hooks]
                              for gid, members in self._ronde_all_groups.items()}
        self._ronde_group_of = {id(q): gid for gid, members in self._ronde_groups.items()
                                for q in members}

    def remove_hooks(self) -> None:
        """Take this wrapper's gradient hooks off, for a model another wrapper will train
        (Lightning wraps anew at every ``fit``): two wrappers would reduce each gradient
        twice under one name. A later ``step()`` of this wrapper puts them back."""
        for hook in self._ronde_hooks.values():
            hook.remove()
        self._ronde_hooks.clear()

    # -- backward side ---------------------------------------------------------------------
    def _ronde_hook(self, p: torch.Tensor) -> None:
        lean = self._ronde_lean  # the usual steady step: as few operations as it takes
        if lean is not None and id(p) in lean.slot_of \
                and (lean.taken or self._ronde_same_generation()):
            if id(p) in lean.taken:  # a second backward pass before step()
                raise self._ronde_counter.too_many(2, "the gradient of {!r}",
                                                   self._ronde_names[id(p)])
            lean.take(p)
            return
        if not self._ronde_counter.record(p, "the gradient of {!r}", self._ronde_names[id(p)]):
            return
        buckets = self._ronde_buckets
        if buckets is not None and not buckets.taken and not self._ronde_same_generation():
            # an elastic reset since the layout: the new ranks lay theirs out anew, with
            # this rank, after two per-tensor steps
            buckets = None
            self._ronde_set_buckets(None)
        if buckets is not None and id(p) in buckets.slot_of:  # the steady state
            buckets.take(p)
            if not buckets.presence \
                    and len(buckets.taken) + len(self._ronde_handles) == len(self._ronde_hooks) \
                    and self._ronde_presence is None \
                    and not any(q.requires_grad for q in self._ronde_unhooked):
                self._ronde_start_presence(self._ronde_usual)
            return
        if self._ronde_order is not None:
            self._ronde_order.append(self._ronde_index[id(p)])
        gid = self._ronde_group_of.get(id(p))
        if gid is None:
            self._ronde_submit(p)
        else:
            ready = self._ronde_ready.setdefault(gid, set())
            ready.add(id(p))
            members = self._ronde_groups[gid]
            if len(ready) == len(members):
                for q in members:
                    self._ronde_submit(q)
        taken = len(buckets.taken) if buckets is not None else 0
        if taken + len(self._ronde_handles) == len(self._ronde_hooks) \
                and self._ronde_validated >= 0 and self._ronde_presence is None \
                and not any(q.requires_grad for q in self._ronde_unhooked):
            # the usual step: the presence count goes along with the last gradient
            self._ronde_start_presence(self._ronde_usual)

    def _ronde_start_presence(self, flags: torch.Tensor) -> None:
        """Start the step's allreduce of ``flags`` (1 where this rank has a gradient)."""
        self._ronde_presence = C.allreduce_async(flags, None, self._ronde_presence_name,
                                                 ReduceOp.SUM, 1.0, 1.0, self._ronde_ps)

    def _ronde_submit(self, p: torch.Tensor) -> None:
        if p in self._ronde_handles:
            return
        grad = p.grad
        assert grad is not None
        buckets = self._ronde_buckets
        if buckets is not None and id(p) in buckets.slot_of:
            buckets.take(p)
            return
        name = gradient_name(self._ronde_names[id(p)])
        red = self._ronde_reduction
        if grad.is_sparse and not self._ronde_sparse_as_dense:
            self._ronde_handles[p] = C.sparse_allreduce_async(
                grad, name, red.op, red.process_set, red.prescale, red.postscale)
            return
        self._ronde_handles[p] = red.start(grad.to_dense() if grad.is_sparse else grad, name,
                                           C.allreduce_async_)

    # -- step side -------------------------------------------------------------------------
    def _ronde_validate(self) -> None:
        require_same_parameters(
            ((self._ronde_names[id(p)], dtype_name(p.dtype), p.shape) for p in self._ronde_params),
            "ronde.torch.DistributedOptimizer.parameters", self._ronde_ps,
            "DistributedOptimizer: the parameters differ across ranks",
            "build the same model on every rank (and pass the same named_parameters)")
        self._ronde_validated = _state.require().generation

    def _ronde_agree(self) -> list[int]:
        """Start the reductions and the presence count that no hook started; return the
        indices of the parameters with no gradient to contribute here (one contributes
        when trainable and with a gradient: a frozen one's stays local, as under DDP)."""
        params, handles = self._ronde_params, self._ronde_handles
        buckets = self._ronde_buckets
        taken = buckets.taken if buckets is not None else ()
        if self._ronde_presence is not None:  # the usual step: only the unhooked lack one
            if buckets is not None:
                buckets.flush()
            return self._ronde_unhooked_at
        folded = buckets is not None and buckets.presence  # every parameter in a bucket
        if folded and buckets.full:  # the usual step there: every bucket started
            return []
        changed = any(p.requires_grad != (p in self._ronde_hooks) for p in params)
        missing = []
        for i, p in enumerate(params):
            if p in handles or id(p) in taken:
                continue
            if p.requires_grad and p.grad is not None:  # a partial window, a new trainable
                self._ronde_submit(p)
            else:
                missing.append(i)
        if buckets is not None:
            buckets.flush()
        if not folded:  # (folded: the buckets' flags are the counts)
            flags = torch.ones(len(params), dtype=torch.int32)
            flags[missing] = 0
            self._ronde_start_presence(flags)
        if changed:  # hooks for next time, while the counts travel
            self._ronde_rehook()
        return missing

    @eager  # a compiled step runs these eagerly (graph breaks)
    def synchronize(self) -> None:
        """Wait until every gradient is reduced (starting those not started yet).

        Call it before reading or clipping gradients, then call ``step()`` inside
        ``with optimizer.skip_synchronize():``.
        """
        if not self._ronde_member:
            self._ronde_synchronized = True
            return
        lay_out: list[int] | None = None  #: the ready order to lay the buckets out from
        try:
            if self._ronde_validated != _state.require().generation:
                self._ronde_validate()
                self._ronde_syncs = 0
                self._ronde_set_buckets(None)
            params, handles = self._ronde_params, self._ronde_handles
            buckets = self._ronde_buckets
            if not handles and (buckets is None or not buckets.taken) \
                    and all(p.grad is None for p in params):
                raise RondeError("optimizer.step()/synchronize() found no gradients on rank "
                                 f"{_api.rank()}: call loss.backward() before optimizer.step()")
            missing = self._ronde_agree()
            presence = self._ronde_presence
            counts = presence.wait() if presence is not None else None
            if missing and counts is not None:
                counts = counts.tolist()
            if buckets is not None:
                buckets.finish(counts if missing else None, self._ronde_zero_unused)
            if missing:
                for i in missing:
                    p = params[i]
                    if buckets is not None and p in buckets:
                        continue  # its bucket gave it what it should have
                    if counts[i]:  # a gradient on other ranks: this one contributes zeros
                        p.grad = torch.zeros_like(p)
                        self._ronde_submit(p)
                    elif self._ronde_zero_unused and p.requires_grad:  # Horovod's zeros
                        p.grad = torch.zeros_like(p)
            if handles:
                self._ronde_give_results(handles)
            self._ronde_syncs += 1
            if self._ronde_syncs == _buckets.LAYOUT_STEP + 1:
                lay_out = self._ronde_order
            self._ronde_order = [] if self._ronde_syncs == _buckets.LAYOUT_STEP \
                and self._ronde_bucket_cap() else None
        finally:
            self._ronde_drop_step()
        if lay_out is not None:
            # once the step's handles are dropped, so that each gradient's own tensor is
            # freed as its bucket adopts it (``_buckets._adopt_grads``), not held beside
            # every bucket until the end of this step
            self._ronde_make_buckets(lay_out)
        self._ronde_synchronized = True

    def _ronde_give_results(self, handles: dict[torch.Tensor, Any]) -> None:
        """Each per-tensor reduction's result into its parameter's ``grad``."""
        red = self._ronde_reduction
        for p, started in handles.items():
            if not isinstance(started, Started):  # a sparse gradient's gather
                p.grad = started.wait()
                continue
            value, grad = red.result(started), p.grad
            if value is grad:  # reduced in place
                continue
            if grad is not None and not grad.is_sparse:  # compressed on the wire
                with torch.no_grad():
                    grad.copy_(value)
            elif grad is not None:  # sparse_as_dense: sparse again for the step
                p.grad = value.to(p.dtype).to_sparse()
            else:
                p.grad = value.to(p.dtype)

    def _ronde_bucket_cap(self) -> int:
        """Bytes per bucket; 0 where this optimizer reduces each gradient on its own
        (``RONDE_BUCKET_BYTES=0``, or ``groups=``: the user's own grouping)."""
        if self._ronde_all_groups:
            return 0
        return _state.require().cfg.bucket_bytes

    def _ronde_make_buckets(self, order: list[int]) -> None:
        """Lay the buckets out (rank 0's ready order, broadcast: the same on every rank)
        at the same synchronize() on every rank."""
        params, cfg = self._ronde_params, _state.require().cfg
        base = self._ronde_presence_name[: -len(".presence")]
        self._ronde_set_buckets(_buckets.make(
            order, params, self._ronde_hooks, [self._ronde_names[id(p)] for p in params],
            base, self._ronde_bucket_cap(), self._ronde_reduction, C.bucket_allreduce(),
            cfg.bucket_views, cfg.first_bucket_bytes))

    def _ronde_set_buckets(self, buckets: "_buckets.Buckets | None") -> None:
        """Use ``buckets`` (None: the per-tensor path); where they hold every parameter (so
        carry the presence count) and a step is one backward pass, hooks go straight to
        them (``_ronde_lean``): no pass count (a second pass finds its gradient taken)."""
        self._ronde_buckets = buckets
        self._ronde_lean = buckets if buckets is not None and buckets.presence \
            and self._ronde_counter.passes_per_step == 1 else None

    @eager
    def step(self, closure: Any = None) -> Any:
        """Run ``closure`` if given, wait for the reduced gradients (unless inside
        ``skip_synchronize``), then step.

        Args:
            closure: computes the loss and its gradients (forward and backward, as
                PyTorch Lightning's closures do); it runs first, under
                ``torch.enable_grad()``, so that its gradients are the ones reduced.

        Returns:
            The closure's loss, or what the inner step returns without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._ronde_should_sync:
            if self._ronde_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(); gradients are reduced twice. Use "
                              "`with optimizer.skip_synchronize(): optimizer.step()`",
                              stacklevel=2)
            self.synchronize()
        self._ronde_synchronized = False
        out = inner(self, _DistributedMixin, "step")()
        return loss if closure is not None else out

    #: torch's load_state_dict() wraps a class's step() in its step hooks unless marked:
    #: they run once, around the inner step (after the reduction), not twice
    step.hooked = True  # type: ignore[attr-defined]

    @eager
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refuses while reductions are still in flight (those of a
        step that a failure interrupted, e.g. before an elastic reset, are dropped)."""
        buckets = self._ronde_buckets
        busy = bool(self._ronde_handles) or (buckets is not None and buckets.in_flight)
        if busy and ((rt := _state.current()) is None or rt.engine.failed is not None
                     or not self._ronde_same_generation()):
            self._ronde_drop_step()
            busy = False
        if busy:
            raise RondeError("optimizer.zero_grad() was called after loss.backward() but before "
                             "optimizer.step() or optimizer.synchronize(): gradients are being "
                             "reduced in the background; call step() first")
        self._ronde_counter.reset()
        self._ronde_ready.clear()
        inner(self, _DistributedMixin, "zero_grad")(set_to_none)

    def _ronde_same_generation(self) -> bool:
        """Whether the job is still the generation the parameters were checked in."""
        rt = _state.current()
        return rt is not None and rt.generation == self._ronde_validated

    def _ronde_drop_step(self) -> None:
        """Forget the step in flight (its reductions were started by an engine that
        failed, or by an earlier generation of the job)."""
        self._ronde_handles.clear()
        self._ronde_presence = None
        self._ronde_ready.clear()
        self._ronde_counter.reset()
        if self._ronde_buckets is not None:
            self._ronde_buckets.reset()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (between steps)."""
        self._ronde_counter = PassCounter(passes)
        self._ronde_set_buckets(self._ronde_buckets)

    @property
    def gradient_buckets(self) -> _buckets.Buckets | None:
        """The gradient buckets (``_buckets.py``), laid out at the second synchronize()
        of a generation from the ready order (None before: per tensor)."""
        return self._ronde_buckets

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before each allreduce."""
        return self._ronde_counter.passes_per_step


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Compresses = Compression.none,
                         backward_passes_per_step: int = 1,
                         op: Any = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         zero_unused_grads: bool = False) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Args:
        optimizer: a constructed torch optimizer; use the returned object instead.
        named_parameters: ``model.named_parameters()``: names the gradients' collectives
            (recommended). Without it, names come from parameter positions.
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``.
        backward_passes_per_step: backward passes accumulated locally before the allreduce.
        op: ``Average`` (default) or ``Sum``; ``Adasum`` makes it a delta optimizer
            (``torch/adasum.py``: local step, parameter deltas combined with Adasum).
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it (guards low-precision sums).
        num_groups: deprecated spelling of ``groups=<int>``.
        groups: an int (that many groups of consecutive parameters) or a list of lists
            of parameters; a group's allreduces start together once all are ready.
        sparse_as_dense: reduce sparse gradients as dense tensors instead of allgathering
            their indices and values.
        process_set: the ranks that average their gradients (default: all).
        zero_unused_grads: a trainable parameter that got a gradient on no rank in a step
            gets a zero gradient (Horovod's behaviour; under weight decay or momentum the
            optimizer then still moves it). Default False: it keeps ``grad=None`` and the
            optimizer skips it, as in one process and under DDP.

    Returns:
        An instance of a subclass of ``type(optimizer)`` sharing its ``__dict__``; a
        ``step`` patched before wrapping (an LR scheduler's) runs inside the distributed one.

    Raises:
        ValueError: duplicate names, parameters missing from ``named_parameters``, an
            unsupported op, a predivide factor without Average, or a wrapped optimizer.
    """
    if C.resolve_op(op, None) == ReduceOp.ADASUM:
        if compression is not Compression.none or backward_passes_per_step != 1:
            raise UnsupportedError("op=Adasum: compression and backward_passes_per_step are "
                                   "not supported with the Adasum delta optimizer")
        from .adasum import AdasumOptimizer

        return AdasumOptimizer(optimizer, named_parameters, process_set)
    return wrap(optimizer, _DistributedMixin, lambda w: w._ronde_init(
        named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
        groups if groups is not None else num_groups, sparse_as_dense, process_set,
        zero_unused_grads), "DistributedOptimizer")
