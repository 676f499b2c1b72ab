"""The Ray tests' local Ray: 2 CPUs, no dashboard, the test environment's import path
in every worker; one per test module that asks for it (``local_ray``), one module at a
time across the suite's pytest workers (``ray_lock``)."""

from __future__ import annotations

import os
import sys

import pytest


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
