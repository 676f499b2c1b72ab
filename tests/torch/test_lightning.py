"""PyTorch Lightning's ``Trainer`` on ``ronde.lightning.RondeStrategy`` under ``ronderun``.

One ``ronderun`` job at np=1 and one at np=2 each run every scenario of ``lightning_job.py``
in turn (every one with an LR scheduler: per step, per epoch, returned as lists, a
ReduceLROnPlateau on a synced metric; ``RondeStrategy()`` and ``strategy="ronde"``; Adam
with accumulation over a partial last window; the user's own ``DistributedOptimizer``;
clipping; manual optimization; and Lightning's own DDP strategy on the same run as a
witness); each is compared with one plain process (no ronde, no Lightning) on the global
batch in the ranks' joint sample order.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from ronde.testing.installed import skip_unless_installed

torch = pytest.importorskip("torch")
skip_unless_installed("lightning")  # without importing it (ronde.testing.installed)

import lightning_job as job  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
#: float32 sums in another order (two batches of 4 averaged vs one of 8); seen: 4e-7
ATOL = 2e-6
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")
Reports = dict[str, dict[int, dict[str, Any]]]  # scenario -> rank -> its report
#: the scenarios on ronde's strategy (the others are witnesses)
RONDE_CASES = [name for name, case in job.CASES.items() if case["strategy"] != "ddp"]


@pytest.fixture(scope="module", params=[1, 2], ids=["np1", "np2"])
def ran(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[Reports, str, int]:
    """The job's reports by scenario and rank, its output folder and its size."""
    np_ = request.param
    out = str(tmp_path_factory.mktemp(f"lightning{np_}"))
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARIABLES and not k.startswith(("RONDE_", "HOROVOD_"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "ronde.run", "-np", str(np_), "--timeout", "200",
           sys.executable, os.path.join(HERE, "lightning_job.py"), out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, env=env, cwd=HERE)
    assert proc.returncode == 0, f"job exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    assert "trains alone" not in proc.stdout + proc.stderr  # ronderun started it
    reports: Reports = {}
    for line in proc.stdout.splitlines():
        if line.startswith("[") and ']<stdout>:{"scenario"' in line:
            head, text = line[1:].split("]<stdout>:", 1)
            report = json.loads(text)
            reports.setdefault(report["scenario"], {})[int(head)] = report
    assert sorted(reports) == sorted(job.CASES), proc.stdout[-2000:]
    for name, by_rank in reports.items():
        assert sorted(by_rank) == list(range(np_)), f"{name}: reports from ranks {sorted(by_rank)}"
    return reports, out, np_


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(job.CASES))
def test_weights_equal_one_process_on_the_global_batch(name: str,
                                                       ran: tuple[Reports, str, int]) -> None:
    reports, NP = ran[0][name], ran[2]
    ref = job.reference(name, NP)
    want = torch.tensor(ref["params"])
    for rank in range(NP):
        got = torch.tensor(reports[rank]["params"])
        assert torch.equal(got, torch.tensor(reports[0]["params"])), f"rank {rank} differs"
        worst = float((got - want).abs().max())
        assert torch.allclose(got, want, rtol=0, atol=ATOL), f"{name}: {worst} from one process"
        # the logged epoch loss is the mean over ranks (sync_dist=True)
        assert reports[rank]["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-5)
    per_epoch = job.SAMPLES // NP
    for epoch in range(job.EPOCHS):
        both = sorted(i for rank in range(NP)
                      for i in reports[rank]["samples"][epoch * per_epoch:(epoch + 1) * per_epoch])
        assert both == list(range(job.SAMPLES)), f"{name}: epoch {epoch} trained on {both}"


@pytest.mark.timeout(240)
def test_ronde_equals_lightnings_own_ddp_strategy(ran: tuple[Reports, str, int]) -> None:
    # the same run ("object": SGD, a per-step scheduler) on RondeStrategy and DDPStrategy
    for rank in range(ran[2]):
        ours = torch.tensor(ran[0]["object"][rank]["params"])
        ddp = torch.tensor(ran[0]["ddp"][rank]["params"])
        assert ran[0]["ddp"][rank]["strategy"] == "DDPStrategy"
        assert torch.allclose(ours, ddp, rtol=0, atol=ATOL), float((ours - ddp).abs().max())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", RONDE_CASES)
def test_the_module_sees_ronde_ranks_and_collectives(name: str,
                                                     ran: tuple[Reports, str, int]) -> None:
    case, NP = job.CASES[name], ran[2]
    for rank in range(NP):
        rep = ran[0][name][rank]
        assert (rep["strategy"], rep["environment"]) == ("RondeStrategy", "RondeEnvironment")
        assert (rep["world_size"], rep["global_rank"], rep["local_rank"], rep["node_rank"]) \
            == (NP, rank, rank, 0)
        assert rep["is_global_zero"] is (rank == 0)
        assert rep["sampler"] == ["DistributedSampler", NP, rank]
        assert rep["distributed_optimizer"] is True
        assert rep["passes"] == case["accumulate"]  # backward_passes_per_step follows Lightning
        assert rep["lr"] == case["lr"]  # rank 1's own Adam lr was replaced by rank 0's
        ranks = list(range(NP))
        assert (rep["reduce_mean"], rep["reduce_sum"], rep["reduce_max"]) == \
            (sum(ranks) / NP, sum(ranks), NP - 1)
        assert rep["all_gather"] == [[r, 7] for r in ranks]
        assert rep["all_gather_scalar"] == [float(r) for r in ranks]
        assert rep["all_gather_grad"] == [NP * (rank + 1.0)]  # sum over ranks of row `rank`
        assert rep["broadcast"] == f"from {NP - 1}"
        assert (rep["any_rank_one"], rep["all_rank_one"]) == (NP > 1, False)


@pytest.mark.timeout(240)
def test_only_rank_zero_writes_checkpoints_and_logs(ran: tuple[Reports, str, int]) -> None:
    reports, out, NP = ran
    for name in job.CASES:
        zero = reports[name][0]
        assert zero["saves"] > 0, zero["saves"]
        assert zero["ckpt_dir"] == os.path.join(out, "rank0", name)
        for rank in range(1, NP):  # ModelCheckpoint broadcasts its folder: rank 0's
            assert reports[name][rank]["saves"] == 0
            assert reports[name][rank]["ckpt_dir"] == zero["ckpt_dir"]
        files = os.listdir(zero["ckpt_dir"])
        assert any(f.endswith(".ckpt") for f in files), files
        assert os.path.exists(os.path.join(out, "rank0", name, "version_0", "metrics.csv"))
    written = [os.path.join(d, f) for rank in range(1, NP)
               for d, _, fs in os.walk(os.path.join(out, f"rank{rank}")) for f in fs]
    assert written == []


@pytest.mark.timeout(240)
def test_ronde_stays_up_after_fit_and_validate_test_fit_follow(
        ran: tuple[Reports, str, int]) -> None:
    reports, _, NP = ran
    # as under DDP (its process group stays): hvd.rank() works after fit(), whoever
    # started ronde (issue #51 item 2: it was shut down when the strategy started it)
    assert all(reports[n][r]["initialized_after_fit"] for n in job.CASES for r in range(NP))
    ref = job.reference("object", NP)
    for rank in range(NP):
        rep = reports["object"][rank]
        assert rep["validate"] == pytest.approx(ref["val_loss"], abs=1e-5)
        assert rep["test"] == pytest.approx(ref["val_loss"], abs=1e-5)  # the same data
        assert rep["params_after_validate"] == rep["params"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["object", "sharded"])
def test_resuming_from_rank_zeros_checkpoint_continues_the_run(
        ran: tuple[Reports, str, int], name: str) -> None:
    # sharded: Lightning's checkpoint holds the ShardedOptimizer's whole state (it calls
    # consolidate_state_dict() on every rank), each rank loads its part (issue #52)
    reports, NP = ran[0][name], ran[2]
    want = torch.tensor(job.reference(name, NP, epochs=job.EPOCHS + 1)["params"])
    for rank in range(NP):
        got = torch.tensor(reports[rank]["resumed_params"])
        assert torch.equal(got, torch.tensor(reports[0]["resumed_params"]))
        assert torch.allclose(got, want, rtol=0, atol=ATOL), float((got - want).abs().max())
        assert len(reports[rank]["resumed_samples"]) == job.SAMPLES // NP  # the third epoch only


def test_a_strategy_alone_outside_any_launcher_warns_naming_ronderun(tmp_path) -> None:
    # issue #51 item 3: `python train.py` with strategy="ronde" trains one copy on all the
    # data; rank 0 says so, naming ronderun. Under a launcher (the jobs above) it does not.
    code = (
        "import torch, lightning.pytorch as pl, ronde.lightning, ronde.torch as hvd\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "class M(pl.LightningModule):\n"
        "    def __init__(s): super().__init__(); s.l = torch.nn.Linear(2, 1)\n"
        "    def training_step(s, b, i): return s.l(b[0]).pow(2).mean()\n"
        "    def configure_optimizers(s):\n"
        "        o = torch.optim.SGD(s.parameters(), lr=0.1)\n"
        "        return [o], [torch.optim.lr_scheduler.StepLR(o, 1)]\n"
        "t = pl.Trainer(strategy='ronde', accelerator='cpu', devices=1, max_epochs=1,\n"
        "               logger=False, enable_checkpointing=False, enable_progress_bar=False)\n"
        "t.fit(M(), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4))\n"
        "print('RANK-AFTER-FIT', hvd.rank(), hvd.size())\n")
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARIABLES and not k.startswith(("RONDE_", "HOROVOD_", "OMPI_",
                                                                "PMI_", "SLURM_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANK-AFTER-FIT 0 1" in proc.stdout
    assert proc.stderr.count("trains alone on all the data") == 1, proc.stderr[-3000:]
    assert "ronderun -np N" in proc.stderr


def test_importing_ronde_does_not_import_lightning() -> None:
    code = "import sys, ronde, ronde.torch; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    assert out == "False"


def test_the_strategy_name_and_its_errors() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from ronde.lightning import RondeStrategy

    assert StrategyRegistry["ronde"]["strategy"] is RondeStrategy
    strategy = RondeStrategy()
    assert strategy.reduce(3.0) == 3.0  # not a tensor: as it is
    with pytest.raises(ValueError, match=r"reduce_op='median' is not supported; use one of"):
        strategy.reduce(torch.ones(1), reduce_op="median")
    with pytest.raises(ValueError, match=r"group=.* is not a ronde ProcessSet; pass group=None"):
        strategy.reduce(torch.ones(1), group="world")
    with pytest.raises(ValueError, match=r"all_gather: group='world' is not supported"):
        strategy.all_gather(torch.ones(1), group="world")


@pytest.mark.elastic
@pytest.mark.timeout(240)
def test_elastic_fit_goes_on_from_the_last_epoch_after_a_killed_worker(tmp_path) -> None:
    # Under elastic ronderun (np=2, --min-np 1): the worker of 127.0.0.2 is SIGKILLed in
    # epoch 1; the survivor resumes from its commit at epoch 0's end, alone, and a third
    # host, listed 2 s later, joins at epoch 2's end (a new rank, from other weights, gets
    # the commit). The weights of both ranks of the last generation must equal one
    # process trained on the global batch of each epoch's size.
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "elastic"))
    from elastic_jobs import discovery_script

    from ronde.runner.elastic import run_elastic

    out = tmp_path / "result.json"
    script = discovery_script(tmp_path, ["127.0.0.1:1", "127.0.0.2:1"])
    env = {"LIGHTNING_OUT": str(out), "LIGHTNING_MARK": str(tmp_path / "mark"),
           "LIGHTNING_HOSTS_FILE": str(tmp_path / "hosts"), "LIGHTNING_DIE": "127.0.0.2:1:3",
           "LIGHTNING_ADD": "127.0.0.3:1", "RONDE_ELASTIC_POLL": "0.2",
           "OMP_NUM_THREADS": "1"}
    text = io.StringIO()
    # start_timeout_s: the joiner imports torch and Lightning; on a CI run twice as slow as
    # usual (every module compiled from source) it took over 20 s, was stopped, and the
    # run ended at one rank ([2, 1, 1, 1])
    res = run_elastic([sys.executable, os.path.join(HERE, "lightning_elastic_worker.py")], 2,
                      1, 2, discovery_script=str(script), env=env, start_timeout_s=60.0,
                      elastic_timeout_s=30.0, timeout_s=180.0, stdout=text, stderr=text)
    assert res.returncode == 0, text.getvalue()[-4000:]
    result = json.loads(out.read_text())
    sizes = result["sizes"]
    assert sizes == [2, 1, 1, 2], sizes  # epoch 1 ran again, alone; then two ranks
    assert result["fits"] == 3 and result["weights_equal"] and result["size"] == 2, result
    want = torch.tensor(job.reference("object", 1, epochs=4, sizes=sizes)["params"])
    got = torch.tensor(result["params"])
    assert torch.allclose(got, want, rtol=0, atol=ATOL), float((got - want).abs().max())
