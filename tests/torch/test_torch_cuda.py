"""CUDA tensors through ``ronde.torch``: NCCL where each rank has a GPU of its own, the
host path where ranks share one. Marked ``gpu``; skipped where torch sees no GPU (CI).

Run on a GPU machine with ``pytest -m gpu tests/torch/test_torch_cuda.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import os  # noqa: E402
import sys  # noqa: E402

from ronde.testing import run_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_workers as workers  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU"),
]


@pytest.mark.timeout(180)
def test_cuda_collectives_through_nccl_on_one_rank():
    # one rank, one GPU: NCCL's communicator of one; the whole device path runs on CUDA
    assert run_ranks(1, workers.device_path, "cuda", timeout_s=150) == ["ok nccl"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np_", [2, 3])
def test_cuda_collectives_at_several_ranks(np_):
    # a GPU per rank where the machine has them (NCCL); ranks that must share a GPU take
    # the host path, all of them alike, instead of NCCL's "Duplicate GPU detected"
    want = "ok nccl" if torch.cuda.device_count() >= np_ else "ok host"
    assert run_ranks(np_, workers.device_path, "cuda", timeout_s=200) == [want] * np_


@pytest.mark.timeout(240)
def test_cuda_training_matches_one_process():
    configs = [("sgd", 1, "none", False), ("adam", 2, "none", False)]
    diffs = run_ranks(2, workers.equivalence, configs, device="cuda", timeout_s=200)
    for per_rank in diffs:
        for cfg, diff in zip(configs, per_rank):
            assert diff <= 1e-9, (cfg, diff)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np_", [1, 2])
def test_cuda_tensors_written_on_a_side_stream(np_):
    # ronde works on the default stream: it must wait for the caller's stream, and the
    # caller's stream for it (np=1: NCCL's path; np=2 on one GPU: the host path)
    assert run_ranks(np_, workers.side_stream, timeout_s=200) == ["ok"] * np_


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np_", [2, 3])
def test_cuda_collectives_on_a_process_set(np_):
    # the even ranks' set: one member at np=2 (a NCCL group of one), two at np=3 (NCCL
    # with a GPU each, else the host path), beside the global set on the same GPU(s)
    members = [r for r in range(np_) if r % 2 == 0]
    own = len(members) == 1 or torch.cuda.device_count() >= np_
    want = ["ok -" if r % 2 else ("ok nccl" if own else "ok host") for r in range(np_)]
    assert run_ranks(np_, workers.device_path_process_set, "cuda", timeout_s=200) == want
