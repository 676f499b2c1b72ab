"""Where the test suite's CPU goes: every Python process that starts with this folder on
``PYTHONPATH`` appends one line to ``$SUITE_CPU_LOG`` when it exits (its CPU seconds, wall
seconds, which frameworks it imported, the pytest test that started it, its command).
``ronde.testing`` passes ``PYTHONPATH`` on to the ranks it launches, so workers count too::

    SUITE_CPU_LOG=/tmp/cpu.txt PYTHONPATH=scripts/suite_cpu bash scripts/test.sh
    python scripts/suite_cpu/report.py /tmp/cpu.txt

A process that ends with ``os._exit`` or a signal is not counted (docs/testing.md).
"""

import atexit
import os
import sys
import time

_START = time.time()
_FRAMEWORKS = ("torch", "tensorflow", "jax", "keras", "mxnet", "pyspark", "ray", "lightning",
               "transformers")


def _report() -> None:
    log = os.environ.get("SUITE_CPU_LOG")
    if not log:
        return
    try:
        t = os.times()
        mods = ",".join(m for m in _FRAMEWORKS if m in sys.modules)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        argv = " ".join(sys.argv)[:200].replace("\t", " ")
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\t{t.user + t.system:.2f}\t{time.time() - _START:.2f}\t"
                    f"{mods}\t{test}\t{argv}\n")
    except OSError:
        pass


atexit.register(_report)
