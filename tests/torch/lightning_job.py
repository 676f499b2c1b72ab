"""The training of ``test_lightning.py``: Lightning under ``ronderun``, and its reference.

``ronderun -np 2 python lightning_job.py OUTDIR`` runs every scenario of :data:`CASES`
in turn, each a ``Trainer`` on ``RondeStrategy`` with ``BATCH`` samples per rank, and
prints one JSON line per scenario and rank (``{"scenario": ..., "params": [...], ...}``).
:func:`reference` trains the same model in one plain process, without ronde or
Lightning, on the global batch ``BATCH * size`` in the order the ranks' distributed
samplers make up together (rank ``r`` gets samples ``r, r + size, ...`` of the epoch's
order), so the weights must agree.

Every rank starts from different weights (seed + rank) and, in the Adam case, a
different learning rate: the strategy's broadcasts from rank 0 must make them equal.
Importing this module imports neither Lightning nor ronde.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SAMPLES, VAL_SAMPLES, BATCH, EPOCHS, SEED = 64, 16, 4, 2, 0
#: scenario -> how it trains (the reference reads the same table). Every scenario has an
#: LR scheduler (``scheduler``: "step" a StepLR stepped every optimizer step, "epoch"
#: one stepped every epoch, "lists" returned as ``([opt], [sched])``, "plateau" a
#: ReduceLROnPlateau monitoring the synced epoch loss)
CASES: dict[str, dict[str, Any]] = {
    # RondeStrategy(), plain SGD, logging with sync_dist, checkpoints; validate(), test()
    # and a second fit after the first
    "object": dict(strategy="object", optimizer="sgd", lr=0.1, accumulate=1, clip=None,
                   wrap=False, scheduler="step"),
    # strategy="ronde", Adam (rank 1 asks for another lr), a partial last window (8 = 3+3+2
    # batches an epoch), a per-epoch scheduler
    "string": dict(strategy="ronde", optimizer="adam", lr=0.01, accumulate=3, clip=None,
                   wrap=False, scheduler="epoch"),
    # the user's own DistributedOptimizer (momentum SGD), accumulation 2, gradient clipping
    # by norm (of the averaged gradient), a per-step LR scheduler; ronde started by the user
    "wrapped": dict(strategy="ronde", optimizer="momentum", lr=0.1, accumulate=2, clip=0.05,
                    wrap=True, scheduler="step"),
    # configure_optimizers returns lists; momentum SGD, clipping, the strategy's wrapper
    "lists": dict(strategy="ronde", optimizer="momentum", lr=0.1, accumulate=1, clip=0.05,
                  wrap=False, scheduler="lists"),
    # ReduceLROnPlateau on the epoch loss synced over ranks (mode="max" on a falling loss:
    # it halves the lr after every epoch but the first); three epochs
    "plateau": dict(strategy="ronde", optimizer="sgd", lr=0.1, accumulate=1, clip=None,
                    wrap=False, scheduler="plateau", epochs=3),
    # manual optimization: self.optimizers(), manual_backward, self.clip_gradients, step,
    # self.lr_schedulers().step() every step
    "manual": dict(strategy="ronde", optimizer="momentum", lr=0.1, accumulate=1, clip=0.05,
                   wrap=False, scheduler="step", manual=True),
    # the user's own ShardedOptimizer (stage 2, Adam; rank 1 asks for another lr): Lightning's
    # gradient_clip_val clips by the global norm, accumulate_grad_batches is its
    # backward_passes_per_step (issue #52: the rank's slice norm, and a refusal naming Adasum)
    "sharded": dict(strategy="ronde", optimizer="adam", lr=0.01, accumulate=2, clip=0.05,
                    wrap="sharded", scheduler="step"),
    # Lightning's own DDP strategy (Gloo) on the same run as "object": ronde's equals it
    "ddp": dict(strategy="ddp", optimizer="sgd", lr=0.1, accumulate=1, clip=None,
                wrap=False, scheduler="step"),
}


def data(n: int = SAMPLES, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=g)
    return x, y


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def make_optimizer(case: dict[str, Any], params: Any, lr: float) -> torch.optim.Optimizer:
    if case["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9 if case["optimizer"] == "momentum" else 0)


def make_scheduler(case: dict[str, Any], opt: torch.optim.Optimizer) -> Any:
    if case["scheduler"] == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5,
                                                          patience=0)
    if case["scheduler"] == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)  # per epoch


def flat(module: nn.Module) -> list[float]:
    return [float(v) for p in module.parameters() for v in p.detach().reshape(-1)]


def epoch_order(epoch: int) -> list[int]:
    """The order the distributed sampler deals an epoch's samples in: Lightning shuffles
    training data (whatever the loader says, as under DDP) with seed 0 + epoch."""
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)).tolist()


def reference(name: str, size: int, epochs: int | None = None,
              sizes: list[int] | None = None) -> dict[str, Any]:
    """One process on the global batch: the final weights, the last epoch's mean loss
    and the validation loss at the end; ``sizes``: the job's size in each epoch, where
    it changed (an elastic job's)."""
    case = CASES[name]
    x, y = data()
    net = make_net(SEED)
    opt = make_optimizer(case, net.parameters(), case["lr"])
    sched = make_scheduler(case, opt) if case["scheduler"] else None
    n, step = case["accumulate"], BATCH * size
    losses: list[float] = []
    if epochs is None:
        epochs = case.get("epochs", EPOCHS)
    for epoch in range(epochs):
        order, losses = epoch_order(epoch), []
        if sizes is not None:
            step = BATCH * sizes[epoch]
        batches = SAMPLES // step
        for k in range(batches):
            idx = order[k * step:(k + 1) * step]
            loss = F.mse_loss(net(x[idx]).squeeze(-1), y[idx])
            losses.append(loss.item())
            (loss / n).backward()
            if (k + 1) % n == 0 or k == batches - 1:
                if case["clip"]:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), case["clip"])
                opt.step()
                opt.zero_grad()
                if case["scheduler"] == "step":
                    sched.step()
        if case["scheduler"] == "plateau":
            sched.step(sum(losses) / len(losses))
        elif case["scheduler"] in ("epoch", "lists"):
            sched.step()
    vx, vy = data(VAL_SAMPLES, seed=99)
    with torch.no_grad():
        val = float(F.mse_loss(net(vx).squeeze(-1), vy))
    return {"params": flat(net), "train_loss": sum(losses) / len(losses), "val_loss": val}


# -- the ronderun side ------------------------------------------------------------------
def run(name: str, out: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.plugins import TorchCheckpointIO
    from torch.utils.data import DataLoader, Dataset

    import ronde.torch as hvd
    from ronde.lightning import RondeStrategy

    case = CASES[name]
    rank = int(os.environ["RONDE_RANK"])  # before the Trainer: only to differ per rank
    seen: dict[str, Any] = {}

    class Samples(Dataset):
        def __init__(self, n: int, seed: int) -> None:
            self.x, self.y = data(n, seed)

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
            return self.x[i], self.y[i], i

    class CountingIO(TorchCheckpointIO):
        saves = 0

        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            CountingIO.saves += 1
            super().save_checkpoint(*args, **kwargs)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(SEED + rank)
            self.samples: list[int] = []
            self.automatic_optimization = not case.get("manual", False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, idx = batch
            self.samples.extend(int(i) for i in idx)
            loss = F.mse_loss(self.net(x).squeeze(-1), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            if not self.automatic_optimization:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=case["clip"],
                                    gradient_clip_algorithm="norm")
                opt.step()
                self.lr_schedulers().step()
            return loss

        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y, _ = batch
            self.log("test_loss", F.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y, _ = batch
            self.log("val_loss", F.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

        def configure_optimizers(self) -> Any:
            lr = case["lr"] * (10 if rank == 1 and case["optimizer"] == "adam" else 1)
            opt = make_optimizer(case, self.parameters(), lr)
            if case["wrap"] == "sharded":
                opt = hvd.ShardedOptimizer(opt, named_parameters=self.named_parameters(),
                                           stage=2)
            elif case["wrap"]:
                opt = hvd.DistributedOptimizer(opt, named_parameters=self.named_parameters())
            sched = make_scheduler(case, opt)
            if case["scheduler"] == "lists":
                return [opt], [sched]
            if case["scheduler"] == "plateau":
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched,
                                                           "monitor": "train_loss"}}
            interval = "epoch" if case["scheduler"] == "epoch" else "step"
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched,
                                                       "interval": interval}}

        def on_train_start(self) -> None:
            st = self.trainer.strategy
            opt = self.trainer.optimizers[0]
            sampler = self.trainer.train_dataloader.sampler
            r = torch.tensor(float(self.global_rank))
            mine = torch.tensor([self.global_rank + 1.0], requires_grad=True)
            # DDP's rule: this rank's row of every rank's gradient, summed
            weights = torch.arange(1.0, self.trainer.world_size + 1).reshape(-1, 1)
            (self.all_gather(mine, sync_grads=True) * weights).sum().backward()
            seen.update(
                strategy=type(st).__name__, environment=type(st.cluster_environment).__name__,
                world_size=self.trainer.world_size, global_rank=self.global_rank,
                local_rank=self.local_rank, node_rank=self.trainer.node_rank,
                is_global_zero=self.trainer.is_global_zero,
                sampler=[type(sampler).__name__, sampler.num_replicas, sampler.rank],
                distributed_optimizer=callable(getattr(opt, "synchronize", None)),
                passes=getattr(opt, "backward_passes_per_step", None),
                lr=opt.param_groups[0]["lr"],
                reduce_mean=float(st.reduce(r)), reduce_sum=float(st.reduce(r, reduce_op="sum")),
                reduce_max=float(st.reduce(r, reduce_op="max")),
                all_gather=self.all_gather(torch.tensor([self.global_rank, 7])).tolist(),
                all_gather_scalar=self.all_gather(r).tolist(), all_gather_grad=mine.grad.tolist(),
                broadcast=st.broadcast(f"from {self.global_rank}", src=self.trainer.world_size - 1),
                any_rank_one=st.reduce_boolean_decision(self.global_rank == 1, all=False),
                all_rank_one=st.reduce_boolean_decision(self.global_rank == 1),
            )

    if name == "wrapped":
        hvd.init()  # the user's own init: the strategy must leave ronde running
    root = os.path.join(out, f"rank{rank}")
    io = CountingIO()
    checkpoint = ModelCheckpoint(dirpath=os.path.join(root, name), monitor="val_loss",
                                 save_last=True)

    def trainer(epochs: int) -> Any:
        strategy: Any = RondeStrategy() if case["strategy"] == "object" else case["strategy"]
        return pl.Trainer(
            # Lightning's DDP takes this host's processes as its devices
            strategy=strategy, accelerator="cpu", max_epochs=epochs,
            devices=int(os.environ["RONDE_LOCAL_SIZE"]) if strategy == "ddp" else 1,
            accumulate_grad_batches=case["accumulate"],
            gradient_clip_val=None if case.get("manual") else case["clip"],
            default_root_dir=root, logger=CSVLogger(root, name=name), callbacks=[checkpoint],
            plugins=[io], enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0)

    first = trainer(case.get("epochs", EPOCHS))
    model = Module()
    train = DataLoader(Samples(SAMPLES, 1234), batch_size=BATCH)
    val = DataLoader(Samples(VAL_SAMPLES, 99), batch_size=BATCH)
    first.fit(model, train, val)
    report = dict(scenario=name, rank=rank, params=flat(model.net), samples=model.samples,
                  train_loss=float(first.callback_metrics["train_loss"]), saves=io.saves,
                  ckpt_dir=checkpoint.dirpath, initialized_after_fit=hvd.is_initialized(), **seen)
    if name == "object":  # more stages: ronde again after the first one's shutdown
        report["validate"] = first.validate(model, val, verbose=False)[0]["val_loss"]
        report["params_after_validate"] = flat(model.net)
        report["test"] = first.test(model, val, verbose=False)[0]["test_loss"]
    if name in ("object", "sharded"):
        # rank 0's last checkpoint, one epoch more (sharded: Lightning consolidated the
        # whole optimizer state into it, and each rank loads its part)
        resumed = Module()
        trainer(EPOCHS + 1).fit(resumed, train, val, ckpt_path=checkpoint.last_model_path)
        report["resumed_params"] = flat(resumed.net)
        report["resumed_samples"] = resumed.samples
    return report


def check_ranks(reports: list[dict[str, Any]], name: str) -> None:
    """What a job of ``len(reports)`` ranks must show, launched by anything (Ray, Spark):
    ronde's ranks in Lightning, the distributed sampler, weights equal on every rank and
    to one process on the global batch, checkpoints written by rank 0 only."""
    size = len(reports)
    ref = torch.tensor(reference(name, size)["params"])
    for rank, rep in enumerate(reports):
        assert (rep["world_size"], rep["global_rank"], rep["is_global_zero"]) == \
            (size, rank, rank == 0), rep
        assert rep["sampler"] == ["DistributedSampler", size, rank]
        assert rep["params"] == reports[0]["params"], f"rank {rank} differs"
        assert torch.allclose(torch.tensor(rep["params"]), ref, rtol=0, atol=2e-6)
    assert reports[0]["saves"] > 0 and all(rep["saves"] == 0 for rep in reports[1:])


def main() -> None:
    torch.set_num_threads(1)
    out = sys.argv[1]
    for name in CASES:
        print(json.dumps(run(name, out)), flush=True)


if __name__ == "__main__":
    main()
