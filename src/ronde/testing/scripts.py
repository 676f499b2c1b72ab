"""Run a whole training script through ``ronderun`` and read what rank 0 reported.

For tests of examples and user scripts: :func:`run_script` starts ``python SCRIPT
ARGS...`` on ``np`` ranks exactly as a user would (``ronderun -np N``), fails with the
launcher's stderr if the job fails, and :func:`rank0_metric` reads a number rank 0
printed (only rank 0 is expected to print it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Mapping


def run_script(np: int, script: str | os.PathLike[str], *args: str,
               env: Mapping[str, str] | None = None, timeout_s: float = 100.0) -> str:
    """Run ``script`` on ``np`` ranks through ``ronderun``; return the job's stdout.

    Raises:
        AssertionError: the job exited non-zero (the message ends with its stderr).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "ronde.run", "-np", str(np), sys.executable, os.fspath(script),
         *args], capture_output=True, text=True, timeout=timeout_s,
        env=None if env is None else {**os.environ, **env})
    if proc.returncode != 0:
        raise AssertionError(f"{script} on {np} ranks exited {proc.returncode}:\n"
                             f"{proc.stderr[-3000:]}")
    return proc.stdout


def rank0_metric(stdout: str, label: str) -> float:
    """The number after ``label`` on rank 0's output; asserts no other rank printed it."""
    pattern = re.escape(label) + r" ([0-9.]+)"
    found = {int(m.group(1)): float(m.group(2)) for m in
             re.finditer(r"^\[(\d+)\]<stdout>:.*?" + pattern, stdout, re.MULTILINE)}
    assert 0 in found, f"rank 0 printed no {label!r}:\n{stdout[-2000:]}"
    assert list(found) == [0], f"ranks {sorted(found)} printed {label!r}; only rank 0 should"
    return found[0]
