"""The Ray tests' local Ray: 2 CPUs, no dashboard, the test environment's import path
in every worker; one per test module that asks for it (``local_ray``)."""

from __future__ import annotations

import os
import sys

import pytest


@pytest.fixture(scope="module")
def local_ray(request):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    ray.cloudpickle.register_pickle_by_value(request.module)
    yield ray
    ray.shutdown()
