"""The Ray tests' local Ray: 2 CPUs, no dashboard, the test environment's import path
in every worker; one per test module that asks for it (``local_ray``), one module at a
time across the suite's pytest workers (``ray_lock``)."""

from __future__ import annotations

import os
import sys

import pytest

# Ray runs its workers at nice 15 (RAY_worker_niceness), to keep its own daemons
# responsive. Beside the suite's other tests (at nice 0) that starved them: importing
# torch in a Ray worker took 129 s instead of 2 s with three busy processes beside it,
# and CI's digits and Lightning runs on Ray passed their 180 s limit. The workers of the
# tests' clusters compete as equals
os.environ.setdefault("RAY_worker_niceness", "0")


@pytest.fixture(scope="module")
def ray_lock():
    """One Ray at a time on this machine: the suite's pytest workers run Ray test
    modules in turn (two local clusters at once met each other)."""
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "ronde-ray-tests.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def local_ray(request, ray_lock):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    ray.cloudpickle.register_pickle_by_value(request.module)
    yield ray
    ray.shutdown()
