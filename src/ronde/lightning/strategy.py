"""PyTorch Lightning on ronde: ``Trainer(strategy="ronde")`` (:class:`RondeStrategy`).

Lightning 2.0 removed Horovod's ``strategy="horovod"``; this module is its successor on
ronde's engine. Every process runs the same script, started by a launcher (``ronderun``,
``mpirun``, ``srun``, ``torchrun``...); Lightning does not start processes here::

    import lightning.pytorch as pl
    import ronde.lightning  # registers strategy="ronde"

    trainer = pl.Trainer(strategy="ronde", accelerator="cpu", devices=1, max_epochs=5)
    trainer.fit(model, train_loader)

    # ronderun -np 4 python train.py

What :class:`RondeStrategy` does, in Lightning's order (docs/lightning.md has the
details and what differs from ``DDPStrategy``):

* **Ranks.** ``hvd.init()`` when the Trainer is built (Lightning asks for the ranks
  then) and again, if it was shut down, at ``setup_environment``; ``global_rank``,
  ``world_size``, ``local_rank`` and ``node_rank`` are ronde's ``rank``, ``size``,
  ``local_rank`` and ``cross_rank`` (:class:`RondeEnvironment`), so ``is_global_zero``,
  rank-zero logging and checkpointing follow ronde's rank 0.
* **Data.** Lightning puts a ``DistributedSampler(num_replicas=size, rank=rank)`` into
  every data loader, as under DDP.
* **Model and optimizers.** At ``setup`` the model's ``state_dict()`` is broadcast from
  rank 0, and each optimizer from ``configure_optimizers`` is wrapped in
  ``ronde.torch.DistributedOptimizer`` (named by the module's ``named_parameters``)
  unless it is one already; its hyperparameters, and its state where it has one, come
  from rank 0. ``backward_passes_per_step`` follows ``Trainer(accumulate_grad_batches)``
  under automatic optimization. No learning rate is rescaled (Horovod's strategy
  multiplied it by the size; DDP does not).
* **Step.** Gradients are averaged while backward runs; in ``optimizer_step`` the
  averaging is waited for right after Lightning's closure (forward and backward), so
  ``on_before_optimizer_step`` hooks and gradient clipping see the averaged gradients,
  as under DDP; the optimizer then steps without reducing again. The user's own
  ``ShardedOptimizer`` is kept as it is: ``gradient_clip_val`` reaches its global-norm
  clip (Lightning's precision plugin calls ``torch.nn.utils.clip_grad_norm_``, which
  ronde routes to it: ``ronde.torch._sharded_patches``), ``accumulate_grad_batches`` its
  ``backward_passes_per_step``, and only rank 0's hyperparameters are sent (each rank's
  state is its own slice).
* **Collectives.** ``reduce`` (``self.log(..., sync_dist=True)``) is an allreduce
  (mean by default, ``"sum"``, ``"max"``, ``"min"``, ``"product"``), ``all_gather`` an
  allgather (shape ``(world_size, *shape)``), ``broadcast`` ``broadcast_object``,
  ``barrier`` ronde's barrier.
* **Teardown.** A barrier (nothing after a failure); ronde keeps running, as DDP's
  process group and Horovod's strategy did: after ``fit`` the script may use
  ``hvd.rank()``, save on rank 0, ``trainer.test(...)`` or ``fit`` again; ronde shuts
  down when the process exits or the script calls ``hvd.shutdown()``.
* **Alone.** A strategy that finds itself the only process, started by no launcher,
  warns on rank 0 naming ``ronderun -np N`` (it would train one copy on the whole data).

Importing ``ronde`` never imports this module (nor Lightning).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional, TypeVar, Union

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ronde.lightning needs PyTorch Lightning 2.x (the `lightning` package): "
                      "pip install 'ronde[lightning]'") from exc

import torch
from torch import Tensor

from .. import torch as hvd
from .._state import launcher
from ..process_sets import ProcessSet

__all__ = ["RondeEnvironment", "RondeStrategy", "COMMITTED"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: the ``ckpt_path`` that resumes from the checkpoint given to
#: :meth:`RondeStrategy.resume_from` (held in memory: ``ronde.lightning.elastic``)
COMMITTED = "ronde-elastic:committed"

#: Lightning's names for reductions -> ronde's ops
_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max,
        "min": hvd.Min, "product": hvd.Product}


class RondeEnvironment(ClusterEnvironment):
    """Lightning's view of a ronde job: the ranks are ronde's.

    :meth:`start` runs ``hvd.init()`` (once per job: a no-op while ronde runs) and
    remembers the topology, which the rank methods return from then on (Lightning asks
    for ranks during its own teardown too).
    """

    def __init__(self) -> None:
        #: rank, size, local rank, local size, cross rank, cross size
        self._topology: tuple[int, int, int, int, int, int] | None = None

    def start(self) -> None:
        """Initialise ronde if it is not running, and read the topology."""
        if not hvd.is_initialized():
            hvd.init()
        self._topology = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                          hvd.cross_rank(), hvd.cross_size())

    def stop(self) -> None:
        """A barrier: no rank leaves a stage while another still reduces or saves. ronde
        keeps running (the process's exit, or ``hvd.shutdown()``, ends it)."""
        if hvd.is_initialized():
            hvd.barrier()

    def _topo(self) -> tuple[int, int, int, int, int, int]:
        if self._topology is None:
            self.start()
        assert self._topology is not None
        return self._topology

    @property
    def creates_processes_externally(self) -> bool:
        """Always: a launcher started every process."""
        return True

    @property
    def main_address(self) -> str:
        """torchrun's ``MASTER_ADDR`` (set by ``hvd.init()``); ronde does not use it."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """torchrun's ``MASTER_PORT`` (set by ``hvd.init()``); ronde does not use it."""
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        """True in a process that ``ronderun`` started, or where ronde runs."""
        return "RONDE_RANK" in os.environ or hvd.is_initialized()

    def world_size(self) -> int:
        """``hvd.size()``."""
        return self._topo()[1]

    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher decides the size."""

    def global_rank(self) -> int:
        """``hvd.rank()``."""
        return self._topo()[0]

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher decides the rank."""

    def local_rank(self) -> int:
        """``hvd.local_rank()``."""
        return self._topo()[2]

    def local_size(self) -> int:
        """``hvd.local_size()``: processes on this host."""
        return self._topo()[3]

    def node_rank(self) -> int:
        """``hvd.cross_rank()``: this host's index."""
        return self._topo()[4]

    def num_nodes(self) -> int:
        """``hvd.cross_size()``: hosts in the job."""
        return self._topo()[5]


class _AllGatherGrad(torch.autograd.Function):
    """``all_gather(sync_grads=True)`` with DDP's backward: the gradients of every rank
    summed, this rank's row."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, rank: int) -> Tensor:  # type: ignore[override]
        ctx.rank = rank
        return hvd.allgather(tensor.unsqueeze(0))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return hvd.allreduce(grad.contiguous(), op=hvd.Sum)[ctx.rank], None


def _unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _is_distributed(optimizer: Any) -> bool:
    """A ronde ``DistributedOptimizer`` (or its Adasum form) already."""
    return callable(getattr(optimizer, "synchronize", None))


def _process_set(group: Any) -> ProcessSet:
    if group is None:
        return hvd.global_process_set
    if isinstance(group, ProcessSet):
        return group
    raise ValueError(f"RondeStrategy: group={group!r} is not a ronde ProcessSet; pass "
                     "group=None (every rank) or a ProcessSet from hvd.add_process_set()")


class RondeStrategy(ParallelStrategy):
    """Data-parallel training on ronde, one device per process (see the module docstring).

    Args:
        accelerator: as for any strategy (usually chosen by ``Trainer(accelerator=...)``).
        parallel_devices: the devices of this host's ranks, one per local rank; usually
            left to ``Trainer(devices=...)``. With one device, every rank uses it, except
            that a CUDA device with at least ``local_size`` GPUs visible becomes
            ``cuda:<local_rank>`` (Horovod's pinning).
        checkpoint_io: written on rank 0 only (Lightning's default
            ``TorchCheckpointIO`` unless given).
        precision_plugin: as for any strategy.
    """

    strategy_name = "ronde"
    #: the warning of a job that runs alone is given once per process
    _warned_alone = False

    def __init__(self, accelerator: Optional["pl.accelerators.Accelerator"] = None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=RondeEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._failed = False
        self._committed: dict[str, Any] | None = None
        #: ids of the optimizers whose gradients manual_backward averaged since their step
        self._averaged: set[int] = set()

    def resume_from(self, checkpoint: dict[str, Any] | None) -> None:
        """What ``fit(ckpt_path=COMMITTED)`` loads: a checkpoint held in memory (a
        Lightning checkpoint dict, as ``dump_checkpoint`` makes it)."""
        self._committed = checkpoint

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None
                        ) -> dict[str, Any]:
        """The checkpoint given to :meth:`resume_from` for ``COMMITTED``, else Lightning's
        (every rank reads the file)."""
        if checkpoint_path == COMMITTED:
            if self._committed is None:
                raise ValueError("RondeStrategy: ckpt_path=COMMITTED without a checkpoint "
                                 "given to resume_from()")
            return self._committed
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    # -- where this process sits -------------------------------------------------------
    @property
    def _environment(self) -> RondeEnvironment:
        env = self.cluster_environment
        if not isinstance(env, RondeEnvironment):
            raise ValueError(f"RondeStrategy: cluster environment {env!r} is not a "
                             "RondeEnvironment; ronde decides the ranks, pass no other")
        return env

    @property
    def is_distributed(self) -> bool:
        """Always True: Lightning then adds distributed samplers and syncs logged values."""
        return True

    @property
    def num_nodes(self) -> int:
        """Hosts in the job (``hvd.cross_size()``), whatever ``Trainer(num_nodes)`` says."""
        return self._environment.num_nodes()

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        """Ignored: the launcher decides the hosts."""

    @property
    def root_device(self) -> torch.device:
        """This rank's device: ``parallel_devices[local_rank]``, or the one device given
        (``cuda:<local_rank>`` when it is CUDA and enough GPUs are visible)."""
        devices = list(self.parallel_devices or [torch.device("cpu")])
        env = self._environment
        local_rank, local_size = env.local_rank(), env.local_size()
        if len(devices) > 1:
            if local_rank >= len(devices):
                raise ValueError(
                    f"RondeStrategy: {len(devices)} devices given for {local_size} ranks on "
                    f"this host (local rank {local_rank} has none); the launcher starts "
                    "the processes: pass Trainer(devices=1)")
            return devices[local_rank]
        device = devices[0]
        if device.type == "cuda" and local_size > 1 and torch.cuda.device_count() >= local_size:
            return torch.device("cuda", local_rank)
        return device

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One shard per rank of the job."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Start ronde (Lightning calls this when the Trainer is built) and make
        Lightning's rank-zero-only functions follow ronde's rank 0."""
        self._environment.start()
        rank_zero_only.rank = self.global_rank
        # one process that no launcher started (a plain `python train.py`): one copy
        if hvd.size() == 1 and launcher() == "single" and not RondeStrategy._warned_alone:
            RondeStrategy._warned_alone = True
            rank_zero_warn(
                "RondeStrategy: this process is the whole job (world size 1, started by no "
                "launcher), so it trains alone on all the data. Start N processes with "
                "`ronderun -np N python <your script>` (or mpirun, srun, torchrun) to "
                "train data-parallel.")
        try:  # lightning_utilities keeps its own copy
            from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

            utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        except ImportError:  # pragma: no cover
            pass

    def setup_environment(self) -> None:
        """``hvd.init()`` (again after a previous stage's teardown), then the device."""
        self._failed = False
        self.set_world_ranks()
        reset_seed()  # as DDPStrategy: the seed of seed_everything() again, if any
        super().setup_environment()

    # -- model and optimizers ----------------------------------------------------------
    def model_to_device(self) -> None:
        """Move the model to :attr:`root_device`."""
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: "pl.Trainer") -> None:
        """Lightning's set-up, then rank 0's weights everywhere and, when fitting, the
        optimizers wrapped and their hyperparameters (and state) from rank 0."""
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        wrapped = [self._distributed(_unwrap(opt)) for opt in self.optimizers]
        for config in self.lr_scheduler_configs:  # schedulers step the wrapper's groups
            for original, new in zip(self.optimizers, wrapped):
                if getattr(config.scheduler, "optimizer", None) is _unwrap(original):
                    config.scheduler.optimizer = new  # type: ignore[union-attr]
        self.optimizers = wrapped
        self._match_accumulation()

    def _distributed(self, optimizer: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        if not _is_distributed(optimizer):
            mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
            named = [(n, p) for n, p in module.named_parameters() if id(p) in mine]
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named)
        # rank 0's hyperparameters; its state only where it has one: creating the state
        # first (Horovod's zero-gradient step) would count one Adam step too many
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        has_state, hyper = hvd.broadcast_object((len(optimizer.state) > 0, hyper), root_rank=0)
        for group, values in zip(optimizer.param_groups, hyper):
            group.update(values)
        if has_state:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return optimizer

    def _match_accumulation(self) -> None:
        """Under automatic optimization Lightning runs ``accumulate_grad_batches``
        backward passes per ``optimizer.step()``: reduce once per window."""
        module = self.lightning_module
        if module is None or getattr(module, "_trainer", None) is None \
                or not module.automatic_optimization:
            return
        passes = module.trainer.accumulate_grad_batches
        for opt in self.optimizers:
            opt = _unwrap(opt)
            if getattr(opt, "backward_passes_per_step", 1) == passes:
                continue
            if not callable(getattr(opt, "set_backward_passes_per_step", None)):
                raise ValueError(f"RondeStrategy: {type(opt).__name__} cannot change its "
                                 "backward_passes_per_step (a DistributedOptimizer with "
                                 f"op=Adasum); make it with backward_passes_per_step="
                                 f"{passes}, or use accumulate_grad_batches=1")
            logger.info("RondeStrategy: backward_passes_per_step %d -> %d, as "
                        "accumulate_grad_batches", opt.backward_passes_per_step, passes)
            opt.set_backward_passes_per_step(passes)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follow a ``GradientAccumulationScheduler`` (it changes the window per epoch)."""
        self._match_accumulation()

    def post_backward(self, closure_loss: Tensor) -> None:
        """Under manual optimization, wait for the averaged gradients at the end of every
        ``manual_backward``, as DDP's backward does: the module may read or clip them
        (``self.clip_gradients``) before ``opt.step()``. Automatic optimization waits in
        :meth:`optimizer_step` instead (after the closure), which lets accumulated
        passes reduce once per window."""
        module = self.lightning_module
        if module is None or module.automatic_optimization:
            return
        for optimizer in self.optimizers:
            opt = _unwrap(optimizer)
            if callable(getattr(opt, "skip_synchronize", None)) and any(
                    p.grad is not None for g in opt.param_groups for p in g["params"]):
                opt.synchronize()
                self._averaged.add(id(opt))

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
                       **kwargs: Any) -> Any:
        """Run the closure, wait for the averaged gradients (unless ``manual_backward``
        waited for them already), then let Lightning's precision plugin clip (if asked)
        and step without reducing again."""
        opt = _unwrap(optimizer)
        if not callable(getattr(opt, "skip_synchronize", None)):  # plain, or Adasum's
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        averaged = id(opt) in self._averaged
        self._averaged.discard(id(opt))

        def closure_then_average() -> Any:
            loss = closure()
            if not averaged:
                opt.synchronize()
            return loss

        with opt.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    # -- collectives -------------------------------------------------------------------
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[Any, str]] = "mean") -> Union[Tensor, Any]:
        """Allreduce ``tensor`` (anything else is returned as it is).

        Args:
            tensor: the same shape and dtype on every rank.
            group: None (every rank) or a ronde ``ProcessSet``.
            reduce_op: ``"mean"``/``"avg"``/None (default), ``"sum"``, ``"max"``,
                ``"min"``, ``"product"``, or the same ``torch.distributed.ReduceOp``.
                The mean of an integer tensor is a float tensor.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        name = "mean" if reduce_op is None else \
            (reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", str(reduce_op)))
        op = _OPS.get(name.lower())
        if op is None:
            raise ValueError(f"RondeStrategy.reduce: reduce_op={reduce_op!r} is not supported; "
                             f"use one of {sorted(_OPS)}")
        if op is hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.to(torch.get_default_dtype())
        return hvd.allreduce(tensor, op=op, process_set=_process_set(group))

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None,
                   sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor`` stacked: shape ``(world_size, *tensor.shape)``.

        With ``sync_grads`` the gradient flows back as under DDP (every rank's
        gradient of this rank's row, summed); without, the result has no gradient.
        """
        if group is not None:
            raise ValueError(f"RondeStrategy.all_gather: group={group!r} is not supported; "
                             "pass group=None (every rank)")
        if sync_grads:
            return _AllGatherGrad.apply(tensor, self.global_rank)
        return hvd.allgather(tensor.detach().unsqueeze(0))

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` from rank ``src`` (pickled) on every rank."""
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: Optional[str] = None) -> None:
        """Return once every rank reached it."""
        hvd.barrier()

    # -- the end -------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """After a failure teardown skips the barrier (the other ranks may never come)."""
        self._failed = True

    def teardown(self) -> None:
        """The optimizers' gradient hooks off the model (a later fit wraps it anew: an
        elastic retry, or ``fit`` again), Lightning's teardown, then a barrier (not after
        a failure: the other ranks may never come; the launcher, or the elastic loop,
        decides what follows). ronde keeps running."""
        for opt in self.optimizers:
            remove = getattr(_unwrap(opt), "remove_hooks", None)
            if callable(remove):
                remove()
        super().teardown()
        if not self._failed:
            self._environment.stop()


if "ronde" not in StrategyRegistry:
    StrategyRegistry.register("ronde", RondeStrategy,
                              description="data-parallel training on ronde (ronde.lightning)")
