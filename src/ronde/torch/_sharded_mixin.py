"""The class behind :func:`~ronde.torch.sharded.ShardedOptimizer`, whole (the design is
in :mod:`ronde.torch.sharded`'s docstring; the buckets' own start and finish in
:mod:`._shards`): the hooks that fill the buckets, ``synchronize()``, the step on this
rank's pieces and the allgather of the updated slices, the clips, and what checkpoints
and the elastic handler read.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from typing import Any, Iterable

import torch

from .. import _api, _state
from .._errors import RondeError, UnsupportedError
from .._ops import ReduceOp
from ..frameworks.accumulation import TooManyPassesError
from ..frameworks.compression import Compresses
from ..frameworks.gradients import Reduction
from ..frameworks.naming import name_parameters, require_same_parameters
from ..process_sets import ProcessSet, global_process_set
from . import _buckets
from . import _collectives as C
from . import _sharded_patches
from ._compile import eager
from ._elementwise import slice_state
from ._pools import Pools
from ._shards import (Bucket, Layout, Piece, agree_finite, changed_parameters, check_linked,
                      gather, poison, relink)
from ._units import Units
from ._tensors import dtype_name
from ._whole_state import gather_whole, slice_whole, whole_groups
from ._wrap import SkipSynchronize, inner, wrap


class _ShardedMixin(SkipSynchronize):
    """Methods mixed in front of the user's optimizer class."""

    param_groups: list[dict[str, Any]]
    state: Any

    def _ronde_init(self, named_parameters: Any, stage: int, backward_passes_per_step: int,
                    compression: Compresses, process_set: ProcessSet,
                    units: Units | None = None) -> None:
        #: stage 3: the parameters of each unit (:mod:`._units`), laid out apart
        self._ronde_stage, self._ronde_units = stage, units
        #: the gradients' pipeline every binding shares (frameworks/gradients.py)
        self._ronde_reduction = Reduction.configure(ReduceOp.AVERAGE, 1.0, compression,
                                                    process_set, backward_passes_per_step)
        self._ronde_passes = self._ronde_reduction.passes_per_step
        self._ronde_ps = process_set
        names = name_parameters(self.param_groups, named_parameters)
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            if p.is_sparse or not p.dtype.is_floating_point:
                raise UnsupportedError(f"ShardedOptimizer: parameter {names[id(p)]!r} is "
                                       f"{'sparse' if p.is_sparse else dtype_name(p.dtype)}; "
                                       "only dense floating-point parameters can be sharded")
            if not p.is_contiguous():
                raise UnsupportedError(f"ShardedOptimizer: parameter {names[id(p)]!r} is not "
                                       "contiguous (channels_last?); its pieces must be views "
                                       "of its storage: make it contiguous before wrapping")
        self._ronde_params = params
        self._ronde_names = [names[id(p)] for p in params]
        self._ronde_index = {id(p): i for i, p in enumerate(params)}
        self._ronde_full_groups = [list(g["params"]) for g in self.param_groups]
        old_state = dict(self.state)
        pieces = self._ronde_layout()
        self._ronde_validated = -1
        if not self._ronde_solo and os.environ.get("RONDE_ELASTIC") != "1":
            # here, before the layout moves anything; in an elastic job at the first step
            # of each generation instead, where every rank is (a joining worker makes its
            # optimizer while the others are elsewhere)
            self._ronde_validate()
        for i, piece in pieces.items():  # an optimizer with state already: keep this rank's part
            if params[i] in old_state:
                self.state[piece.tensor] = slice_state(old_state[params[i]], params[i].shape,
                                                       piece.a, piece.b, piece.name)
        self._ronde_had: set[int] = set()  # parameters with a gradient in this window
        self._ronde_pass = 0  # backward passes in this window
        self._ronde_queued = False
        self._ronde_moving: list[Bucket] = []  # reduce-scatters in flight, in start order
        self._ronde_synced = False
        self._ronde_should_sync = True
        self._ronde_hooks: dict[torch.Tensor, Any] = {}
        #: set by GradScaler.unscale_ (ronde's patch): agree on non-finite slices
        self._ronde_check_finite = False
        self._ronde_ddp_checked = False
        self._ronde_whole: dict[str, Any] | None = None  # consolidate_state_dict()'s
        self._ronde_rehook()
        _sharded_patches.install(self)

    def _ronde_layout(self) -> dict[int, Piece]:
        """Build the buckets and this rank's pieces for the job as it is now (at wrapping,
        and again after an elastic reset: :meth:`relayout`); the param groups then hold
        the pieces, and the optimizer's state is empty. Returns the pieces by parameter."""
        process_set, params = self._ronde_ps, self._ronde_params
        member = process_set is global_process_set or process_set.included()
        self._ronde_solo = not member or _api.size() == 1 or C.set_size(process_set) == 1
        rank, size = (0, 1) if self._ronde_solo else (_api.set_rank(process_set),
                                                      C.set_size(process_set))
        cfg, self._ronde_generation = _state.require().cfg, _state.require().generation
        self._ronde_views, self._ronde_limit = cfg.bucket_views, cfg.sharded_in_flight
        order = list(range(len(params)))[::-1]
        base = f"ShardedOptimizer.{self._ronde_names[0]}" if params else "ShardedOptimizer"
        groups = [order] if self._ronde_units is None else self._ronde_units.orders(params)
        layout = [ids for group in groups for ids in _buckets.layout(
            group, params, lambda i: True, cfg.bucket_bytes or _buckets.FIRST_BUCKET_BYTES)]
        # (each bucket's members become views of its flat storage: RONDE_SHARDED_FLAT_PARAMS)
        self._ronde_buckets = [Bucket(f"{base}.shard{k}.{len(ids)}", k, ids, params,
                                       self._ronde_names, rank, size, self._ronde_stage,
                                       cfg.sharded_flat_params or self._ronde_stage == 3)
                               for k, ids in enumerate(layout)]
        self._ronde_pools = Pools(self._ronde_buckets, cfg.sharded_trim_heap)
        self._ronde_next = 0
        #: what checkpoints, the elastic handler and state_dict() read
        self.shard_layout = Layout(params, self._ronde_names, self._ronde_full_groups,
                                   self._ronde_buckets, rank, size, self._ronde_solo, process_set)
        self._ronde_bucket_of = {i: b for b in self._ronde_buckets for i in b.members}
        pieces = self.shard_layout.pieces
        #: a piece's tensor -> its parameter's index (clipping by pieces: Lightning's)
        self._ronde_piece_index = {id(pc.tensor): i for i, pc in pieces.items()}
        self.state = collections.defaultdict(dict)
        for group, full in zip(self.param_groups, self._ronde_full_groups):
            group["params"] = [pieces[self._ronde_index[id(p)]].tensor for p in full
                               if self._ronde_index[id(p)] in pieces]
        return pieces

    def relayout(self) -> None:
        """Lay the shards out again for the job as it is now (after an elastic reset
        changed the ranks): new pieces, no optimizer state (the elastic state handler
        fills it, :mod:`ronde.torch.elastic.sharded`), nothing in flight."""
        if self._ronde_units is not None:
            raise UnsupportedError("ShardedOptimizer(stage=3) follows no elastic reset yet: "
                                   "save_sharded() before and load_sharded() after")
        self._ronde_drop()
        self._ronde_layout()
        self._ronde_new_window()
        self._ronde_rehook()

    def _ronde_validate(self) -> None:
        params = self._ronde_params
        require_same_parameters(
            zip(self._ronde_names, (dtype_name(p.dtype) for p in params),
                (p.shape for p in params)),
            "ronde.torch.ShardedOptimizer.parameters", self._ronde_ps,
            "ShardedOptimizer: the parameters differ across ranks",
            "build the same model on every rank (and pass the same named_parameters)")
        self._ronde_validated = _state.require().generation

    # -- hooks -----------------------------------------------------------------------------
    def _ronde_rehook(self) -> None:
        hooks = self._ronde_hooks
        for p in self._ronde_params:
            if p.requires_grad and p not in hooks:
                hooks[p] = p.register_post_accumulate_grad_hook(self._ronde_hook)
            elif not p.requires_grad and p in hooks:
                hooks.pop(p).remove()
        for b in self._ronde_buckets:
            b.hooked = {i for i in b.members if self._ronde_params[i] in hooks}
            b.unhooked = [self._ronde_params[i] for i in b.members if i not in b.hooked]

    def _ronde_hook(self, p: torch.Tensor) -> None:
        if self._ronde_synced:  # a window synchronized but never stepped (GradScaler
            self._ronde_new_window()  # skipped it): this backward starts the next one
        if not self._ronde_queued:  # the end of this backward pass closes it (see _ronde_pass_end)
            if self._ronde_pass >= self._ronde_passes:
                raise TooManyPassesError(
                    f"ShardedOptimizer: {self._ronde_pass + 1} backward passes before "
                    f"optimizer.step() with backward_passes_per_step={self._ronde_passes}; "
                    "call step() after each window, or raise backward_passes_per_step")
            self._ronde_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._ronde_pass_end)
        i = self._ronde_index[id(p)]
        self._ronde_had.add(i)
        if self._ronde_stage == 1 and self._ronde_pass + 1 < self._ronde_passes:
            return  # torch accumulates the window in p.grad; the last pass puts it
        b = self._ronde_bucket_of[i]
        if self._ronde_stage > 1:
            self._ronde_reap(b)
        slot = b.put(i, p.grad, self._ronde_pools)
        if self._ronde_stage > 1:
            p.grad = None
        elif self._ronde_views and p.grad.data_ptr() != slot.data_ptr():
            # stage 1 keeps its buffers: the gradient lives in its slot from now on
            # (RONDE_GRADIENT_AS_BUCKET_VIEW), one copy of the gradients instead of two
            p.grad = slot.view(p.shape)
        buckets, cur = self._ronde_buckets, self._ronde_pass
        while self._ronde_next < len(buckets) and buckets[self._ronde_next].complete(cur):
            self._ronde_start(buckets[self._ronde_next])  # in layout order, on every rank
            self._ronde_next += 1

    def _ronde_pass_end(self) -> None:
        """The end of a backward pass: on the window's last pass (every pass in stage
        2), start every bucket not started in it: the same count on every rank."""
        self._ronde_queued = False
        if self._ronde_stage > 1 or self._ronde_pass + 1 == self._ronde_passes:
            self._ronde_start_rest()
            self._ronde_reap(None)
        self._ronde_pass += 1
        self._ronde_next = 0

    def _ronde_reap(self, wanted: Bucket | None) -> None:
        """Stage 2: finish the reduce-scatters that are done, and ``wanted``'s (waited)."""
        for b in [b for b in self._ronde_moving if b is wanted or b.started[0].handle.poll()]:
            self._ronde_finish(b)

    def _ronde_start_rest(self) -> None:
        params, cur = self._ronde_params, self._ronde_pass
        for b in self._ronde_buckets:
            if not b.due(cur):
                continue
            if b.started is not None:  # stage 2: the previous pass's reduction
                self._ronde_finish(b)
            for q in b.unhooked:  # unfrozen since the hooks were set: its gradient now
                i = self._ronde_index[id(q)]
                if q.requires_grad and q.grad is not None and i not in b.filled:
                    self._ronde_had.add(i)
                    b.put(i, q.grad, self._ronde_pools)
            if self._ronde_stage == 1:  # a partial window: what torch accumulated so far
                for i in b.hooked - b.filled:
                    if params[i].grad is not None:
                        b.put(i, params[i].grad, self._ronde_pools)
            self._ronde_start(b)
        self._ronde_next = len(self._ronde_buckets)

    def _ronde_start(self, b: Bucket) -> None:
        """Start ``b``'s reduce-scatter, after the oldest where RONDE_SHARDED_IN_FLIGHT
        are in flight (every rank starts them in layout order: none waits for ever)."""
        while self._ronde_moving and len(self._ronde_moving) >= self._ronde_limit:
            self._ronde_finish(self._ronde_moving[0])
        b.start(self._ronde_params, self._ronde_pass, None if self._ronde_solo
                else self._ronde_reduction, self._ronde_pools)
        if b.started[0] is not None:
            self._ronde_moving.append(b)

    def _ronde_drop(self) -> None:
        """Wait for the reduce-scatters in flight and forget them (their results unused)."""
        for b in self._ronde_moving:
            b.drop(self._ronde_pools)
        self._ronde_moving = []

    def _ronde_finish(self, b: Bucket) -> None:
        if b.finish(self._ronde_reduction, self._ronde_pools):
            self._ronde_moving.remove(b)

    # -- the step --------------------------------------------------------------------------
    @eager
    def synchronize(self) -> None:
        """Wait for every bucket's averaged slice and give each piece its ``.grad``
        (None where no rank had a gradient). ``step()`` calls it; call it yourself
        before reading the pieces' gradients, then step inside ``skip_synchronize()``."""
        if self._ronde_synced:
            return
        if _state.require().generation != self._ronde_generation:
            raise UnsupportedError(
                "ShardedOptimizer: the job was resized (an elastic reset) since this optimizer "
                "was laid out; its shards follow a resize inside hvd.elastic.TorchState("
                "model, optimizer) (resharded in memory), or save_sharded() before and "
                "load_sharded() into a new ShardedOptimizer after")
        if not self._ronde_solo and self._ronde_validated != self._ronde_generation:
            self._ronde_validate()
        if not self._ronde_had and not any(b.summed or b.started for b in self._ronde_buckets):
            raise RondeError(f"optimizer.step() found no gradients on rank {_api.rank()}: call "
                             "loss.backward() before optimizer.step()")
        if self._ronde_stage == 1 or self._ronde_pass == 0:
            self._ronde_start_rest()  # a window cut short (fewer passes), or no hook ran
        for b in self._ronde_buckets:
            if b.started is not None:
                self._ronde_finish(b)
        changed = self._ronde_wrapped_in_ddp() + self._ronde_changed()
        bad = self._ronde_check_finite and not all(
            bool(torch.isfinite(b.slice).all()) for b in self._ronde_buckets)
        broken = relink(self._ronde_buckets, self._ronde_params)
        # one count per parameter (had a gradient), then: ranks whose parameters cannot be
        # views again, whose gradients changed behind ronde's back, with non-finite slices
        flags = torch.zeros(len(self._ronde_params) + 3, dtype=torch.int32)
        flags[list(self._ronde_had)] = 1
        flags[-3], flags[-2], flags[-1] = int(bool(broken)), int(bool(changed)), int(bad)
        counts = (flags if self._ronde_solo else C.allreduce_async(
            flags, None, f"{self._ronde_buckets[0].name}.presence", ReduceOp.SUM, 1.0, 1.0,
            self._ronde_ps).wait()).tolist()
        if counts[-3]:
            raise changed_parameters(broken, int(counts[-3]))
        if counts[-2]:
            raise _sharded_patches.modified_gradients(int(counts[-2]), changed)
        for b in self._ronde_buckets:
            for piece in b.pieces:
                piece.tensor.grad = b.slice[piece.at:piece.at + piece.b - piece.a] \
                    if counts[piece.index] else None
        if counts[-1] and not bad:  # another rank's slice is not finite: so is one of ours,
            poison(self._ronde_buckets)  # as every rank's whole gradient would be under DDP
        self._ronde_synced = True

    def _ronde_wrapped_in_ddp(self) -> list[str]:
        """Once, at the first step: whether torch's DDP wraps these parameters (refused)."""
        if self._ronde_ddp_checked:
            return []
        if _sharded_patches.ddp_wraps(self._ronde_params):
            return ["every parameter: torch DistributedDataParallel wraps the model"]
        self._ronde_ddp_checked = True  # until a step found none (refused again after)
        return []

    def _ronde_changed(self) -> list[str]:
        """The parameters whose gradient changed after ronde took it in this window:
        stage 1, a bucket written in place since its reduce-scatter started (its
        parameters named); stage 2, a ``p.grad`` that is back after ronde freed it."""
        names, params = self._ronde_names, self._ronde_params
        if self._ronde_stage == 1:
            return [names[i] for b in self._ronde_buckets
                    if b.buf is not None and b.version >= 0
                    and (b.modified or b.buf._version != b.version)
                    for i in b.members if i in self._ronde_had]
        return [names[i] for b in self._ronde_buckets for i in b.hooked
                if i in self._ronde_had and params[i].grad is not None]

    def _ronde_grads(self, parameters: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
        """The averaged slices (after :meth:`synchronize`) of ``parameters`` (the
        optimizer's parameters or their pieces; None: all)."""
        self.synchronize()
        wanted: set[int] | None = None
        if parameters is not None:
            wanted = set()
            for t in parameters:
                i = self._ronde_index.get(id(t), self._ronde_piece_index.get(id(t)))
                if i is None:
                    raise UnsupportedError("ShardedOptimizer: a tensor to clip is not one of "
                                           "this optimizer's parameters")
                wanted.add(i)
        return [pc.tensor.grad for b in self._ronde_buckets for pc in b.pieces
                if pc.tensor.grad is not None and (wanted is None or pc.index in wanted)]

    @eager
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        parameters: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        """Clip the averaged gradients by their global norm (over every rank's slices:
        one allreduce of a number); returns the norm before clipping, as
        ``torch.nn.utils.clip_grad_norm_`` does for one process. Every rank calls it.

        Args:
            max_norm: the largest norm kept.
            norm_type: the p of the p-norm (``float("inf")``: the largest magnitude).
            error_if_nonfinite: raise where the norm is nan or inf (as torch's).
            parameters: clip these parameters (or pieces) only, by their norm; None: all.
        """
        grads = self._ronde_grads(parameters)
        total = None if self._ronde_solo else (lambda local, is_max: C.allreduce_async(
            local, None, "ShardedOptimizer.clip", ReduceOp.MAX if is_max else ReduceOp.SUM,
            1.0, 1.0, self._ronde_ps).wait())
        return _sharded_patches.clip_by_total_norm(
            grads, max_norm, norm_type, error_if_nonfinite, total,
            grads[0].dtype if grads else self._ronde_params[0].dtype)

    @eager
    def clip_grad_value_(self, clip_value: float,
                         parameters: Iterable[torch.Tensor] | None = None) -> None:
        """Clamp the averaged gradients to ``[-clip_value, clip_value]`` (elementwise:
        each rank its slices), as ``torch.nn.utils.clip_grad_value_`` does for one
        process."""
        with torch.no_grad():
            for g in self._ronde_grads(parameters):
                g.clamp_(-float(clip_value), float(clip_value))

    def before_unscale(self) -> None:
        """What a ``GradScaler.unscale_`` of this optimizer needs first (ronde's patch
        calls it): the averaged slices, with every rank's slices non-finite where any
        rank's are, so every rank skips the same steps."""
        if self._ronde_synced and not self._ronde_check_finite:
            self._ronde_check_finite = True  # synchronized by hand before the first
            agree_finite(self._ronde_buckets, self._ronde_solo, self._ronde_ps)  # agree now
        self._ronde_check_finite = True
        self.synchronize()

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of this optimizer's parameters or of its pieces."""
        return id(tensor) in self._ronde_index or id(tensor) in self._ronde_piece_index

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes per ``step()`` (see ``ShardedOptimizer``)."""
        return self._ronde_passes

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` between steps (Lightning's strategy
        follows ``accumulate_grad_batches`` with it)."""
        if int(passes) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        if self._ronde_pass or self._ronde_moving:
            raise RondeError("ShardedOptimizer.set_backward_passes_per_step() between a "
                             "backward pass and its step(); call it after step()")
        self._ronde_passes = int(passes)
        self._ronde_reduction = dataclasses.replace(self._ronde_reduction,
                                                    passes_per_step=int(passes))

    @eager
    def step(self, closure: Any = None) -> Any:
        """Run ``closure`` (if any), synchronize, step on this rank's pieces, gather them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        synced_before = self._ronde_synced  # (else synchronize() checks the parameters)
        if self._ronde_should_sync:
            self.synchronize()
        elif not self._ronde_synced:
            raise RondeError("ShardedOptimizer.step() inside skip_synchronize() needs "
                             "synchronize() first")
        if synced_before:  # a parameter replaced since: re-linked, or refused on every rank
            check_linked(self._ronde_buckets, self._ronde_params, self._ronde_solo,
                         self._ronde_ps)
        out = inner(self, _ShardedMixin, "step")()
        self._ronde_whole = None
        gather(self._ronde_buckets, self._ronde_params, self._ronde_pools, self._ronde_solo,
               self._ronde_ps)
        self._ronde_new_window()
        return loss if closure is not None else out

    step.hooked = True  # type: ignore[attr-defined]

    def _ronde_new_window(self) -> None:
        for b in self._ronde_buckets:
            b.new_window(self._ronde_pools)
        self._ronde_had = set()
        self._ronde_pass = self._ronde_next = 0
        self._ronde_synced = False
        if any(p.requires_grad != (p in self._ronde_hooks) for p in self._ronde_params):
            self._ronde_rehook()

    @eager
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the pieces'. Called between a backward and
        its step, it drops that window (waiting for what it started)."""
        self._ronde_drop()
        self._ronde_new_window()
        for group in self._ronde_full_groups:
            for p in group:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    elif p.grad.grad_fn is not None:
                        p.grad.detach_().zero_()
                    else:  # a view of the bucket (stage 1): zeroed where it lies
                        p.grad.requires_grad_(False).zero_()
        for b in self._ronde_buckets:
            for piece in b.pieces:
                piece.tensor.grad = None

    # -- what checkpoints read -------------------------------------------------------------
    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Gather the whole state on rank ``to`` of the process set (None: on every
        rank) for the next ``state_dict()`` (every rank calls it; as torch's ZeRO's)."""
        self._ronde_whole = gather_whole(self.shard_layout, self.state, self.param_groups, to)

    def state_dict(self) -> dict[str, Any]:
        """The whole state, as the wrapped optimizer's in one process (loads at any N): at
        once with one rank or no state, else where ``consolidate_state_dict()`` put it."""
        if not any(self.state.values()):  # no step yet (accelerate's device move)
            return {"state": {}, "param_groups": whole_groups(self.shard_layout,
                                                                self.param_groups)}
        if self._ronde_solo:
            return gather_whole(self.shard_layout, self.state, self.param_groups, 0)
        if self._ronde_whole is None:
            raise RondeError(
                f"ShardedOptimizer.state_dict() on rank {_api.rank()}: each rank holds 1/N of "
                "the state. Call opt.consolidate_state_dict() on every rank first (Lightning "
                "does), then state_dict() on rank 0; Hugging Face Trainer: "
                "callbacks=[hvd.ConsolidateOptimizerState()]; or hvd.save_sharded(dir, model, "
                "opt) on every rank")
        return self._ronde_whole

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (``state_dict()``'s, or a plain optimizer's over the same
        parameters, saved at any N): this rank keeps its pieces' part."""
        state, hyper = slice_whole(self.shard_layout, state_dict)
        self.state = collections.defaultdict(dict, state)
        for group, h in zip(self.param_groups, hyper):
            group.update(h)

    @property
    def stage(self) -> int:
        return self._ronde_stage

    def whole_parameters(self) -> Any:
        """Stage 3: a context in which every parameter is whole (every rank enters it:
        ``model.state_dict()``, loading weights); else one that does nothing."""
        return self._ronde_units.whole() if self._ronde_units else contextlib.nullcontext()


def sharded(optimizer: torch.optim.Optimizer, named_parameters: Any, stage: int,
            backward_passes_per_step: int, compression: Compresses,
            process_set: ProcessSet, units: Units | None = None) -> Any:
    """``optimizer`` wrapped (``ronde.torch.ShardedOptimizer``, after its checks)."""
    return wrap(optimizer, _ShardedMixin, lambda w: w._ronde_init(
        named_parameters, stage, backward_passes_per_step, compression, process_set, units),
        "ShardedOptimizer")
