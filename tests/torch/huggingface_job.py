"""The training jobs of ``test_huggingface.py``: one script, run three ways.

``python huggingface_job.py MODE``, MODE being

* ``torchrun``: under ``ronderun -np N``, where the worker has torchrun's variables
  (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...): an ``accelerate`` loop, then a
  ``transformers.Trainer``, both run distributed by torch.distributed (gloo), not by
  ronde. ronde is initialised at the end only to check that the ranks agree.
* ``ronde``: under ``ronderun -np N``, with the torchrun variables removed after
  ``hvd.init()`` (which exports them where they are missing) and before accelerate
  looks at them, so that accelerate and Trainer see one process each; every rank feeds
  its own shard and ronde's ``DistributedOptimizer`` averages the gradients.
* ``single``: one plain process on the global batch, the reference for both.

Each scenario prints one JSON line (``{"scenario": ..., "params": [...], ...}``); the
test compares them across ranks and with the reference. Nothing is downloaded
(``HF_HUB_OFFLINE=1``); the model is a plain ``nn.Module``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

#: samples in the data set; per-device batch under ronderun, global batch = 4 * N
SAMPLES, BATCH, EPOCHS, LR = 32, 4, 2, 0.1
#: the variables that make accelerate (and so Trainer) start torch.distributed
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


class Samples(torch.utils.data.Dataset):
    """``SAMPLES`` regression samples, the same in every process; each knows its index."""

    def __init__(self, indices: list[int] | None = None) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, 4, generator=g)
        noise = 0.1 * torch.randn(SAMPLES, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + noise
        self.indices = list(range(SAMPLES)) if indices is None else indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = self.indices[i]
        return {"x": self.x[j], "labels": self.y[j], "idx": torch.tensor(j)}


class Tiny(nn.Module):
    """A two-layer regressor that Trainer can drive: ``forward`` returns ``loss`` and
    ``logits``, and records which samples it trained on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same start in every process and every scenario
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                idx: torch.Tensor | None = None) -> dict[str, Any]:
        if self.training and idx is not None:
            self.seen.extend(int(i) for i in idx)
        out = self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)
        loss = F.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


def params(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def report(scenario: str, model: nn.Module, **extra: Any) -> None:
    print(json.dumps({"scenario": scenario, "params": params(model), "seen": model.seen,
                      **extra}), flush=True)


def shard(rank: int, size: int) -> list[int]:
    """Rank ``rank``'s samples when each step's global batch is ``BATCH * size``
    consecutive samples: per step, the ``rank``-th run of ``BATCH``."""
    return [i for i in range(SAMPLES) if (i // BATCH) % size == rank]


# -- accelerate ------------------------------------------------------------------------
def accelerate_loop(batch: int, accumulation: int, clip: float | None = None,
                    indices: list[int] | None = None, ronde: bool = False
                    ) -> tuple[Any, Tiny, int]:
    """``EPOCHS`` epochs of SGD in an ``Accelerator(cpu=True)`` loop over the samples
    ``indices`` (all by default) in order, ``accumulation`` micro-batches of ``batch``
    a step, gradients clipped to norm ``clip`` if given. With ``ronde``, the optimizer
    is ronde's ``DistributedOptimizer`` (one process per Accelerator, ronde averages)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    assert accelerator.gradient_accumulation_steps == accumulation
    model = Tiny()
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=LR)
    averaging = contextlib.nullcontext()
    if ronde:
        import ronde.torch as hvd

        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             backward_passes_per_step=accumulation)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if clip is not None:  # average before clipping: synchronize(), then steps that skip it
            ronde_optimizer, averaging = optimizer, optimizer.skip_synchronize()
    loader = torch.utils.data.DataLoader(Samples(indices), batch_size=batch, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    with averaging:
        for _ in range(EPOCHS):
            for inputs in loader:
                with accelerator.accumulate(model):
                    loss = model(**inputs)["loss"]
                    accelerator.backward(loss)
                    if clip is not None and accelerator.sync_gradients:
                        if ronde:
                            ronde_optimizer.synchronize()
                        accelerator.clip_grad_norm_(model.parameters(), clip)
                    optimizer.step()
                    optimizer.zero_grad()
                    steps += accelerator.sync_gradients
    return accelerator, accelerator.unwrap_model(model), steps


#: the accelerate scenarios: (accumulation, clip)
ACCELERATE_CASES = ((1, None), (2, None), (2, 1.0))


def accelerate_name(accumulation: int, clip: float | None) -> str:
    return f"accumulate{accumulation}" + (f"/clip{clip:g}" if clip is not None else "")


# -- transformers.Trainer ----------------------------------------------------------------
def ronde_trainer_class() -> type:
    """``RondeTrainer``: a one-process ``Trainer`` whose optimizer is ronde's
    ``DistributedOptimizer`` (the recipe of docs/huggingface.md).

    ronde averages each gradient in place, in the background, from the moment backward
    produced it until ``step()``. Trainer reads and scales the gradients in between (its
    gradient norm, its clipping: ``clip_grad_norm_`` multiplies in place even with
    ``max_grad_norm=0``), which would race with the averaging and clip each rank by its
    own norm. So the step's last ``training_step`` waits for the averages
    (``synchronize()``) and the optimizer steps without reducing again
    (``skip_synchronize()`` around the whole of ``train()``).
    """
    from transformers import Trainer

    import ronde.torch as hvd

    class RondeTrainer(Trainer):
        def create_optimizer(self, model: Any = None) -> Any:
            optimizer = super().create_optimizer(model)
            if not hasattr(optimizer, "synchronize"):  # Trainer's own choice, wrapped
                mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
                named = [(n, p) for n, p in (model or self.model).named_parameters()
                         if id(p) in mine]
                self.optimizer = hvd.DistributedOptimizer(
                    optimizer, named_parameters=named,
                    backward_passes_per_step=self.args.gradient_accumulation_steps)
            return self.optimizer

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.accelerator.sync_gradients:  # the step's last micro-batch
                self.ronde_optimizer.synchronize()
            return loss

        def train(self, *args: Any, **kwargs: Any) -> Any:
            self.ronde_optimizer = self.create_optimizer()
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
            with self.ronde_optimizer.skip_synchronize():
                return super().train(*args, **kwargs)

    return RondeTrainer


def trainer_run(batch: int, indices: list[int] | None = None, sequential: bool = False,
                ronde: bool = False, accumulation: int = 1) -> tuple[Any, Tiny]:
    """``EPOCHS`` epochs of ``transformers.Trainer``: SGD, linear LR decay, gradients
    clipped to norm 1 (Trainer's default), over ``indices`` (all samples by default),
    shuffled as Trainer does or, with ``sequential``, in order."""
    from transformers import Trainer, TrainingArguments

    base: type = ronde_trainer_class() if ronde else Trainer

    class OrderedTrainer(base):  # type: ignore[misc,valid-type]
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            if sequential:  # the ranks' shards add up to the global batches, in order
                return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)
            return super()._get_train_sampler(train_dataset)

    model = Tiny()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="ronde-hf-"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, num_train_epochs=EPOCHS, learning_rate=LR,
        optim="sgd", max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, seed=0, dataloader_drop_last=True,
        ddp_find_unused_parameters=False)
    trainer = OrderedTrainer(model=model, args=args, train_dataset=Samples(indices))
    trainer.train()
    return trainer, model


def sharded_trainer_run(batch: int, indices: list[int] | None, stage: int,
                        accumulation: int = 1, momentum: float = 0.0,
                        save_steps: int | None = None, resume: str | None = None
                        ) -> tuple[Any, Tiny]:
    """A plain ``Trainer`` given ``optimizers=(hvd.ShardedOptimizer(SGD), None)`` (no
    subclass: Trainer's clipping to norm 1 reaches the optimizer's global-norm clip through
    torch.nn.utils.clip_grad_norm_), in order over ``indices`` (issue #52). ``save_steps``:
    Trainer's own checkpoints, with ronde's callback; ``resume``: from that checkpoint."""
    from transformers import Trainer, TrainingArguments

    import ronde.torch as hvd

    class OrderedTrainer(Trainer):
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    model = Tiny()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum),
                               stage=stage, named_parameters=model.named_parameters(),
                               backward_passes_per_step=accumulation)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="ronde-hf-"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, num_train_epochs=EPOCHS, learning_rate=LR,
        max_grad_norm=1.0, use_cpu=True, report_to=[],
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        logging_strategy="no", disable_tqdm=True, seed=0, dataloader_drop_last=True,
        ddp_find_unused_parameters=False)
    trainer = OrderedTrainer(model=model, args=args, train_dataset=Samples(indices),
                             optimizers=(opt, None),
                             callbacks=[hvd.ConsolidateOptimizerState()])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


# -- the three modes ---------------------------------------------------------------------
def run_torchrun() -> None:
    from accelerate.utils import DistributedType
    from transformers.training_args import ParallelMode

    n = int(os.environ["RONDE_SIZE"])  # ronderun's -np, whatever torchrun's variables say
    for accumulation, clip in ACCELERATE_CASES:
        accelerator, model, steps = accelerate_loop(BATCH, accumulation, clip)
        assert accelerator.num_processes == n, accelerator.num_processes
        assert accelerator.distributed_type == DistributedType.MULTI_CPU, \
            accelerator.distributed_type
        assert steps == EPOCHS * SAMPLES // (BATCH * n * accumulation), steps
        report(f"accelerate/{accelerate_name(accumulation, clip)}", model,
               rank=accelerator.process_index, size=accelerator.num_processes, steps=steps)

    trainer, model = trainer_run(BATCH)
    args = trainer.args
    assert args.world_size == n and args.parallel_mode == ParallelMode.DISTRIBUTED, \
        (args.world_size, args.parallel_mode)
    assert trainer.state.global_step == EPOCHS * SAMPLES // (BATCH * n), trainer.state.global_step
    report("trainer", model, rank=args.process_index, size=args.world_size,
           steps=trainer.state.global_step, mode=str(args.parallel_mode))

    import torch.distributed as dist

    import ronde.torch as hvd

    hvd.init()  # alongside torch.distributed's group: the ranks agree on the weights
    assert (hvd.rank(), hvd.size()) == (dist.get_rank(), dist.get_world_size())
    sums = hvd.allgather_object(sum(params(model)))
    assert len(set(sums)) == 1, sums
    # a ShardedOptimizer given to Trainer, which wraps the model in DDP here: refused on
    # every rank at the first step (DDP would average into ronde's buckets)
    for stage in (1, 2):
        try:
            sharded_trainer_run(BATCH, None, stage)
            error = "accepted"
        except hvd.RondeError as exc:
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"scenario": f"trainer+sharded/ddp/stage{stage}", "error": error}),
              flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


def run_ronde() -> None:
    import ronde.torch as hvd

    hvd.init()
    # one process per Accelerator/Trainer (ronde averages): after init(), which puts
    # torchrun's variables back where they are missing
    for name in TORCHRUN_VARIABLES:
        os.environ.pop(name, None)
    r, n = hvd.rank(), hvd.size()
    for accumulation, clip in ACCELERATE_CASES:
        accelerator, model, steps = accelerate_loop(BATCH, accumulation, clip, shard(r, n),
                                                    ronde=True)
        assert accelerator.num_processes == 1, accelerator.num_processes
        report(f"accelerate+ronde/{accelerate_name(accumulation, clip)}", model, rank=r, size=n,
               steps=steps)
    for accumulation in (1, 2):
        trainer, model = trainer_run(BATCH, shard(r, n), sequential=True, ronde=True,
                                     accumulation=accumulation)
        assert trainer.args.world_size == 1, trainer.args.world_size
        report(f"trainer+ronde/accumulate{accumulation}", model, rank=r, size=n,
               steps=trainer.state.global_step)
    for stage in (1, 2):  # Trainer given a ShardedOptimizer, no subclass (issue #52)
        for accumulation in (1, 2):
            trainer, model = sharded_trainer_run(BATCH, shard(r, n), stage, accumulation)
            report(f"trainer+sharded/stage{stage}/accumulate{accumulation}", model, rank=r,
                   size=n, steps=trainer.state.global_step)
    # Trainer's own checkpoints of a ShardedOptimizer with momentum (state to save): saved
    # at step 2 with ronde's callback, resumed from there by a new Trainer and optimizer;
    # the test compares it with the uninterrupted run (issue #52)
    trainer, model = sharded_trainer_run(BATCH, shard(r, n), 2, momentum=0.9, save_steps=2)
    report("trainer+sharded/momentum", model, rank=r, size=n, steps=trainer.state.global_step)
    ckpt = os.path.join(trainer.args.output_dir, "checkpoint-2")
    trainer, model = sharded_trainer_run(BATCH, shard(r, n), 2, momentum=0.9, resume=ckpt)
    report("trainer+sharded/momentum/resumed", model, rank=r, size=n,
           steps=trainer.state.global_step)
    hvd.shutdown()


def run_single(n: int) -> None:
    """The reference: one process, global batch ``BATCH * n``."""
    for accumulation, clip in ACCELERATE_CASES:
        _, model, steps = accelerate_loop(BATCH * n, accumulation, clip)
        report(f"accelerate/{accelerate_name(accumulation, clip)}", model, steps=steps)
    trainer, model = trainer_run(BATCH * n)
    report("trainer", model, steps=trainer.state.global_step)
    for accumulation in (1, 2):
        trainer, model = trainer_run(BATCH * n, sequential=True, accumulation=accumulation)
        report(f"trainer/sequential/accumulate{accumulation}", model,
               steps=trainer.state.global_step)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "torchrun":
        run_torchrun()
    elif mode == "ronde":
        run_ronde()
    else:
        run_single(int(sys.argv[2]))
