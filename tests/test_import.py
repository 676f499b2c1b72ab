"""`import ronde` stays light: no framework, no MPI, not even numpy until first use."""

from __future__ import annotations

import subprocess
import sys


def test_import_pulls_in_no_framework():
    code = ("import sys, ronde; heavy = [m for m in ('numpy', 'torch', 'tensorflow', 'jax', "
            "'mxnet', 'mpi4py', 'keras') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_facade_exports_the_horovod_names():
    import ronde

    for name in ("init", "shutdown", "rank", "size", "local_rank", "local_size", "cross_rank",
                 "cross_size", "is_homogeneous", "allreduce", "allreduce_async",
                 "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
                 "barrier", "join", "broadcast_object", "allgather_object", "poll",
                 "synchronize", "ProcessSet", "add_process_set", "Average", "Sum", "Min", "Max",
                 "Product", "global_process_set", "is_initialized"):
        assert hasattr(ronde, name), name
    assert set(ronde.__all__) <= set(dir(ronde))


def test_calls_before_init_say_what_to_do():
    import pytest

    import ronde

    if ronde.is_initialized():
        ronde.shutdown()
    with pytest.raises(ronde.NotInitializedError, match=r"call ronde.init\(\) first"):
        ronde.rank()


def test_import_ronde_torch_costs_no_more_than_torch():
    # ronde's optimizer methods were decorated with torch.compiler.disable, which imports
    # Dynamo (1.2 s of CPU, as much as torch itself) in every rank of every job; ronde's
    # `eager` makes the disabled form only where Dynamo is loaded
    code = "import sys, ronde.torch; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
