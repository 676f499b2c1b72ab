"""Hugging Face ``transformers.Trainer`` and ``accelerate`` under ``ronderun``.

Two ways, both checked against one plain process training on the global batch
(``huggingface_job.py`` holds the training; see docs/huggingface.md):

* as torchrun would run them: ``ronderun`` exports torchrun's variables, so accelerate
  (and Trainer, which runs on it) start torch.distributed and shard the data themselves;
* one process per Accelerator/Trainer (torchrun's variables removed), each rank feeding
  its own shard, ronde's ``DistributedOptimizer`` averaging the gradients.

Three jobs in all (about 15 s on two cores): the reference, and one ``ronderun -np 2``
per way, each running every scenario of its way in turn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from ronde.testing.installed import skip_unless_installed

skip_unless_installed("torch", "accelerate", "transformers")  # without importing them (ronde.testing.installed)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "huggingface_job.py")
NP = 2
#: huggingface_job.py's data and batches
SAMPLES, BATCH, EPOCHS = 32, 4, 2
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID")
#: float32 sums in a different order (one batch of 8 vs two of 4, averaged)
ATOL = 1e-5
Scenarios = dict[str, dict[int, dict[str, Any]]]  # scenario -> rank -> its report


def _env() -> dict[str, str]:
    """The suite's environment, without a launcher's variables of its own (the suite
    may itself run under torchrun or ronderun), offline, one thread per process."""
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARIABLES and not k.startswith(("RONDE_", "HOROVOD_"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _reports(stdout: str, launched: bool) -> Scenarios:
    """The JSON reports in a job's output, by scenario and rank (the ``[rank]<stdout>:``
    prefix of ronderun; rank 0 for a plain process)."""
    out: Scenarios = {}
    for line in stdout.splitlines():
        rank = 0
        if launched:
            if not (line.startswith("[") and "]<stdout>:" in line):
                continue
            head, line = line[1:].split("]<stdout>:", 1)
            rank = int(head)
        if line.startswith('{"scenario"'):
            report = json.loads(line)
            out.setdefault(report["scenario"], {})[rank] = report
    return out


def _run(mode: str) -> Scenarios:
    launched = mode != "single"
    cmd = [sys.executable, JOB, "single", str(NP)]
    if launched:  # a hard limit on the ranks too: ronderun kills them all on expiry
        cmd = [sys.executable, "-m", "ronde.run", "-np", str(NP), "--timeout", "150",
               sys.executable, JOB, mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env(),
                          cwd=HERE)
    assert proc.returncode == 0, f"{mode} job exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return _reports(proc.stdout, launched)


@pytest.fixture(scope="module")
def reference() -> Scenarios:
    """One process, global batch ``BATCH * NP``."""
    return _run("single")


@pytest.fixture(scope="module")
def torchrun_job() -> Scenarios:
    return _run("torchrun")


@pytest.fixture(scope="module")
def ronde_job() -> Scenarios:
    return _run("ronde")


def _check(job: Scenarios, name: str, ref: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """Every rank reported ``name`` after ``steps`` steps, with the same weights, and
    those of the reference; the ranks trained on disjoint halves of every epoch."""
    assert sorted(job.get(name, {})) == list(range(NP)), f"{name}: reports {sorted(job)}"
    ranks = [job[name][r] for r in range(NP)]
    for r, rep in enumerate(ranks):
        assert rep["steps"] == steps, f"{name}: rank {r} took {rep['steps']} steps"
        assert rep["params"] == ranks[0]["params"], f"{name}: rank {r}'s weights differ"
        per_epoch = len(rep["seen"]) // EPOCHS
        assert per_epoch == SAMPLES // NP, f"{name}: rank {r} trained on {len(rep['seen'])}"
    for e in range(EPOCHS):
        epoch = sorted(i for rep in ranks for i in rep["seen"][e * SAMPLES // NP:
                                                             (e + 1) * SAMPLES // NP])
        assert epoch == list(range(SAMPLES)), f"{name}: epoch {e} saw {epoch}"
    assert ref["steps"] == steps
    worst = max(abs(a - b) for a, b in zip(ranks[0]["params"], ref["params"]))
    assert worst <= ATOL, f"{name}: {worst} away from one process on the global batch"
    return ranks


ACCELERATE = ["accumulate1", "accumulate2", "accumulate2/clip1"]


def _accumulation(case: str) -> int:
    return int(case.split("/")[0].removeprefix("accumulate"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ACCELERATE)
def test_accelerate_runs_distributed(case: str, torchrun_job: Scenarios,
                                     reference: Scenarios) -> None:
    steps = EPOCHS * SAMPLES // (BATCH * NP * _accumulation(case))
    ranks = _check(torchrun_job, f"accelerate/{case}", reference[f"accelerate/{case}"][0], steps)
    assert [rep["rank"] for rep in ranks] == list(range(NP))
    assert {rep["size"] for rep in ranks} == {NP}


@pytest.mark.timeout(300)
def test_trainer_runs_distributed(torchrun_job: Scenarios, reference: Scenarios) -> None:
    # Trainer's own sampler (seeded, shuffled) sharded by accelerate: the ranks' batches
    # of a step make up the one process's batch of that step
    ranks = _check(torchrun_job, "trainer", reference["trainer"][0],
                   EPOCHS * SAMPLES // (BATCH * NP))
    assert {rep["mode"] for rep in ranks} == {"ParallelMode.DISTRIBUTED"}
    assert [(rep["rank"], rep["size"]) for rep in ranks] == [(r, NP) for r in range(NP)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ACCELERATE)
def test_ronde_optimizer_in_single_process_accelerate(case: str, ronde_job: Scenarios,
                                                      reference: Scenarios) -> None:
    steps = EPOCHS * SAMPLES // (BATCH * NP * _accumulation(case))
    _check(ronde_job, f"accelerate+ronde/{case}", reference[f"accelerate/{case}"][0], steps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_ronde_optimizer_in_single_process_trainer(accumulation: int, ronde_job: Scenarios,
                                                   reference: Scenarios) -> None:
    # Trainer clips to norm 1 (its default): RondeTrainer averages before it measures
    _check(ronde_job, f"trainer+ronde/accumulate{accumulation}",
           reference[f"trainer/sequential/accumulate{accumulation}"][0],
           EPOCHS * SAMPLES // (BATCH * NP * accumulation))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_plain_trainer_given_a_sharded_optimizer(stage: int, accumulation: int,
                                                   ronde_job: Scenarios,
                                                   reference: Scenarios) -> None:
    # issue #52: Trainer(optimizers=(hvd.ShardedOptimizer(...), None)), one process per
    # rank: its clipping (max_grad_norm=1) is the global norm's, as in one process
    _check(ronde_job, f"trainer+sharded/stage{stage}/accumulate{accumulation}",
           reference[f"trainer/sequential/accumulate{accumulation}"][0],
           EPOCHS * SAMPLES // (BATCH * NP * accumulation))


@pytest.mark.timeout(300)
def test_a_sharded_optimizer_under_trainers_ddp_is_refused(torchrun_job: Scenarios) -> None:
    # under ronderun as under torchrun, Trainer wraps the model in DDP: refused on every
    # rank at the first step, naming the cause and the fix
    for stage in (1, 2):
        for rank in range(NP):
            error = torchrun_job[f"trainer+sharded/ddp/stage{stage}"][rank]["error"]
            assert error.startswith("ModifiedGradientsError") \
                and "DistributedDataParallel" in error and "RONDE_TORCHRUN_ENV=0" in error, error


def test_trainers_own_checkpoint_of_a_sharded_optimizer_resumes_the_run(
        ronde_job: Scenarios) -> None:
    # issue #52: Trainer saves optimizer.state_dict() itself; with
    # hvd.ConsolidateOptimizerState() that is the whole state (SGD momentum buffers), and a
    # new Trainer resumed from step 2 ends where the uninterrupted run did, on every rank
    whole = ronde_job["trainer+sharded/momentum"]
    resumed = ronde_job["trainer+sharded/momentum/resumed"]
    assert sorted(whole) == sorted(resumed) == list(range(NP))
    for r in range(NP):
        assert resumed[r]["steps"] == whole[r]["steps"] > 2, (whole[r], resumed[r])
        assert resumed[r]["params"] == resumed[0]["params"], f"rank {r} differs"
        worst = max(abs(a - b) for a, b in zip(resumed[r]["params"], whole[r]["params"]))
        assert worst <= 1e-6, worst
