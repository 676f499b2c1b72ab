"""The opt-in ``horovod.*`` -> ``ronde.*`` import alias of ``python -m ronde.compat``.

Each check runs in a fresh interpreter, so the alias (a ``sys.meta_path`` finder) never
leaks into the test process; the scripts import no framework.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

SCRIPT = """\
import horovod
import horovod.runner.util.threads as t
from horovod.common.exceptions import HorovodInternalError
import ronde, ronde._errors
assert HorovodInternalError is ronde._errors.HorovodInternalError
t.in_thread(lambda: None).join()
print("ok")
"""


def test_script_runs_with_horovod_imports_answered_by_ronde(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "uses_horovod.py"
    script.write_text(SCRIPT, encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "ronde.compat", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ok"]


def test_importing_ronde_installs_no_alias() -> None:
    code = ("import ronde, ronde.compat, sys; "
            "assert 'horovod' not in sys.modules; "
            "assert not any(type(f).__name__ == 'HorovodAlias' for f in sys.meta_path)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
