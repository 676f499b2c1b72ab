"""The device path (CUDA tensors through NCCL), exercised on the CPU with Gloo.

``RONDE_TORCH_DEVICE_PATH=always`` sends CPU tensors through the same code CUDA tensors
take (fusion on the device, a torch.distributed process group, scale factors on the
device), with Gloo instead of NCCL, so the path is tested on machines without GPUs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import os  # noqa: E402
import sys  # noqa: E402

from ronde.testing import run_ranks, run_ranks_many  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_workers as workers  # noqa: E402

DEVICE = {"RONDE_TORCH_DEVICE_PATH": "always"}


@pytest.mark.timeout(120)
def test_collectives_and_optimizer_on_the_device_path_in_one_process():
    # np=1 too: a job of one rank tears its process group down at shutdown like any other
    assert run_ranks(1, workers.device_path, timeout_s=100, env=DEVICE) == ["ok"]


@pytest.mark.timeout(240)
def test_at_two_ranks_the_device_path_trains_and_serves_process_sets():
    # one launch for the two-rank scenarios (each inits and shuts ronde down)
    configs = [("sgd", 1, "none", False), ("adam", 2, "none", False),
               ("sgd", 1, "fp16", False)]
    tolerance = {("sgd", 1, "none", False): 1e-12, ("adam", 2, "none", False): 1e-12,
                 ("sgd", 1, "fp16", False): 1e-3}
    collectives, equivalence, process_set, prepared = run_ranks_many(2, [
        workers.device_path, (workers.equivalence, configs), workers.device_path_process_set,
        workers.device_path_prepared_at_construction], timeout_s=220, env=DEVICE)
    assert collectives == ["ok"] * 2  # collectives and the optimizer on the device path
    for diffs in equivalence:  # training equals one process on the device path
        for cfg, diff in zip(configs, diffs):
            assert diff <= tolerance[cfg], (cfg, diff)
    assert process_set == ["ok"] * 2  # the device path on a process set
    assert prepared == ["ok"] * 2  # the optimizer prepares it before any hook runs


@pytest.mark.timeout(200)
def test_at_three_ranks_the_device_path_and_a_process_set():
    collectives, process_set = run_ranks_many(
        3, [workers.device_path, workers.device_path_process_set], timeout_s=180, env=DEVICE)
    assert collectives == ["ok"] * 3 and process_set == ["ok"] * 3


def test_ranks_sharing_a_gpu_are_found_by_identity():
    # NCCL refuses two ranks of one communicator on one GPU; the device path finds them
    # from the identities every member reported (global ranks of a process set here)
    from ronde.torch._device import shared_gpus

    assert shared_gpus(["GPU-a", "GPU-b"], [0, 1]) == {}
    assert shared_gpus(["GPU-a", "GPU-a", "GPU-b"], [0, 2, 5]) == {"GPU-a": [0, 2]}
    assert shared_gpus(["h0 pci 0:1:0", "h1 pci 0:1:0", "h0 pci 0:1:0", "h1 pci 0:1:0"],
                       [0, 1, 2, 3]) == {"h0 pci 0:1:0": [0, 2], "h1 pci 0:1:0": [1, 3]}


def test_fusion_helpers_match_their_python_fallbacks():
    import torch

    from ronde.torch import _device

    parts = [torch.arange(12.0).view(3, 4), torch.ones(5), torch.full((2, 1, 2), 7.0),
             torch.zeros(0)]
    flat = _device._flatten(parts)
    assert torch.equal(flat, _device._flatten_py(parts))
    views = _device._unflatten(flat, parts)
    for view, py, part in zip(views, _device._unflatten_py(flat, parts), parts):
        assert view.shape == py.shape == part.shape and torch.equal(view, py)
        if part.numel():
            assert view.data_ptr() >= flat.data_ptr()  # views of the fused buffer, not copies
