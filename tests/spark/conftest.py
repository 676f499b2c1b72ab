"""The Spark tests' session: a ``local[2]`` Spark per test module, UI off, bound to
127.0.0.1, its Python workers on this venv's Python."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

@pytest.fixture(scope="module", autouse=True)
def spark(request):
    pyspark = pytest.importorskip("pyspark")
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java (apt-get install openjdk-17-jre-headless)")
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (SparkSession.builder.master("local[2]").appName("ronde-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(sys.path))
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    pyspark.cloudpickle.register_pickle_by_value(request.module)
    yield session
    session.stop()
