"""Lightning's fit under elastic ``ronderun`` (``test_lightning.py``): the "object" case
of ``lightning_job.py`` (SGD and a per-step LR scheduler) trained by ``ronde.lightning.elastic_fit``.

* ``LIGHTNING_DIE=host:epoch:batch``: the worker on that host, on its first life, is
  SIGKILLed at the start of that batch (after the commit at the previous epoch's end);
  its host leaves discovery then, and ``LIGHTNING_ADD`` (a host) is listed 2 s later.
* The survivor, alone, waits at epoch 2's end until the launcher has told it of the
  added host, so that the job re-forms there at 2 ranks (a new one) for the last epoch.
* Every epoch's size is kept by a callback whose state goes into Lightning's checkpoint,
  so an epoch that was interrupted and run again counts at the size that completed it.
* The last generation's rank 0 writes ``LIGHTNING_OUT`` (JSON): its weights, whether
  every rank's are equal to them, the sizes per epoch, and how many fits it started.

Every rank starts from other weights (seed + rank): the strategy's broadcast (first fit)
and the commit (later ones) must make them equal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_job as job  # noqa: E402
import ronde.torch as hvd  # noqa: E402
from ronde.lightning import elastic_fit  # noqa: E402

EPOCHS = int(os.environ.get("LIGHTNING_EPOCHS", "4"))
HOST = os.environ.get("RONDE_HOSTNAME", "")
MARK = os.environ["LIGHTNING_MARK"]
FIRST_LIFE = not os.path.exists(f"{MARK}.{HOST}")
START_RANK = int(os.environ["RONDE_RANK"])


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = job.make_net(job.SEED + START_RANK)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        # the "object" case's: SGD and a per-step scheduler, whose state the commit carries
        case = job.CASES["object"]
        opt = torch.optim.SGD(self.parameters(), lr=case["lr"])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": job.make_scheduler(case, opt),
                                                   "interval": "step"}}


class Sizes(pl.Callback):
    """The job's size in each completed epoch, kept in the checkpoint."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.sizes.append(trainer.world_size)

    def state_dict(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sizes = list(state_dict["sizes"])


class Die(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        plan = os.environ.get("LIGHTNING_DIE", "")
        if FIRST_LIFE and plan == f"{HOST}:{trainer.current_epoch}:{batch_idx}":
            open(f"{MARK}.{HOST}", "w").close()
            hosts = os.environ["LIGHTNING_HOSTS_FILE"]
            with open(hosts) as f:
                left = [h for h in f.read().split() if not h.startswith(HOST + ":")]
            with open(hosts, "w") as f:
                f.write("".join(h + "\n" for h in left))
            if os.environ.get("LIGHTNING_ADD"):  # listed 2 s later (elastic_jobs)
                with open(hosts + ".pending", "w") as f:
                    f.write(os.environ["LIGHTNING_ADD"] + "\n")
            os.kill(os.getpid(), signal.SIGKILL)


class AwaitHost(pl.Callback):
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from ronde.elastic import notify

        if trainer.current_epoch == 2 and trainer.world_size == 1:
            deadline = time.monotonic() + 60
            while notify.latest()[0] <= notify.baseline() and time.monotonic() < deadline:
                time.sleep(0.05)


sizes = Sizes()


def make_trainer() -> pl.Trainer:
    return pl.Trainer(strategy="ronde", accelerator="cpu", devices=1, max_epochs=EPOCHS,
                      callbacks=[sizes, Die(), AwaitHost()], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


x, y = job.data()
model = Module()
state = elastic_fit(make_trainer, model, DataLoader(TensorDataset(x, y), batch_size=job.BATCH))
params = job.flat(model.net)
everyone = hvd.allgather_object(params)
if hvd.rank() == 0:
    with open(os.environ["LIGHTNING_OUT"], "w") as f:
        json.dump({"params": params, "weights_equal": all(p == params for p in everyone),
                   "sizes": sizes.sizes, "fits": state.fits, "size": hvd.size()}, f)
hvd.shutdown()
