"""ronde.torch collectives in real processes: dtypes, in-place, async, zero-copy, gradients."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import os  # noqa: E402
import sys  # noqa: E402

from ronde.testing import run_ranks, run_ranks_many  # noqa: E402

# tests/torch has no __init__.py on purpose: as a package named "torch" it would
# shadow the real torch for everything that puts tests/ on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_workers as workers  # noqa: E402


@pytest.mark.timeout(90)
def test_collectives_on_torch_tensors_in_one_process():
    assert run_ranks(1, workers.collectives, timeout_s=80) == ["ok"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_on_torch_tensors_and_their_gradients(np_):
    # one launch per size for both scenarios
    collectives, gradients = run_ranks_many(np_, [workers.collectives, workers.gradients],
                                            timeout_s=140)
    assert collectives == ["ok"] * np_ and gradients == ["ok"] * np_


def test_import_ronde_imports_no_framework():
    import subprocess
    import sys

    code = "import ronde, sys; ronde.Average; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_staging_a_cpu_tensor_calls_no_torch_operator_unless_needed():
    # torch lets go of the GIL around every operator call (detach, contiguous...), and
    # a control thread waiting for it then runs first: submitting ResNet-50's 161
    # gradients took 2.2 ms instead of 1.1. A gradient (no grad of its own, contiguous)
    # is used as it is; only what needs it is detached or made contiguous.
    import torch

    from ronde.torch._tensors import host

    g = torch.ones(3, 4)
    assert host(g, "allreduce") is g
    w = torch.ones(3, 4, requires_grad=True)
    got = host(w, "allreduce")
    assert not got.requires_grad and got.data_ptr() == w.data_ptr()
    t = torch.ones(4, 3).t()
    got = host(t, "allreduce")
    assert got.is_contiguous() and torch.equal(got, t)
