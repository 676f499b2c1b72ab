"""A Ray Train ``TorchTrainer`` worker (Ray's torch environment: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``LOCAL_RANK``...) finds its place with a plain
``ronde.torch.init()``, and ronde's collectives and ``DistributedOptimizer`` work there
beside Ray's own torch.distributed group."""

from __future__ import annotations

import json
import os

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
try:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
except ImportError:  # ray without its [train] extra
    pytest.skip("Ray Train needs ray[train]", allow_module_level=True)

pytestmark = [pytest.mark.timeout(240), pytest.mark.ray]


@pytest.fixture(scope="module", autouse=True)
def _ray(local_ray):  # tests/ray/conftest.py
    yield


def _train_loop(config):
    import ronde.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())  # different starts: the broadcast must fix that
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size()),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.arange(8.0).reshape(2, 4) + hvd.rank()  # each rank its own shard
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    ranks = hvd.allgather_object(hvd.rank())
    out = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
           "ranks": ranks, "weight": model.weight.detach().flatten().tolist()}
    with open(os.path.join(config["out"], f"{hvd.rank()}.json"), "w") as f:
        json.dump(out, f)
    hvd.shutdown()


def test_a_torch_trainer_worker_runs_ronde_with_a_plain_init(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    trainer = TorchTrainer(_train_loop, train_loop_config={"out": str(out)},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=str(tmp_path / "store")))
    trainer.fit()
    got = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    assert [(g["rank"], g["size"], g["local_rank"]) for g in got] == [(0, 2, 0), (1, 2, 1)]
    assert got[0]["ranks"] == [0, 1]
    assert got[0]["weight"] == got[1]["weight"]  # averaged gradients, same start
