"""The worker of tests/runner/test_zygote.py: reports how it was started, then does what
its first argument says."""

import json
import os
import signal
import sys
import time

how = sys.argv[1]
marker = sys.modules.get("zygote_marker")
report = {
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "name": __name__,
    "rank": os.environ.get("RONDE_RANK"),
    "extra": os.environ.get("ZYGOTE_TEST_VAR"),
    "forked": marker is not None and marker.IMPORTED_IN != os.getpid(),
    "session": os.getsid(0) == os.getpid(),
    "lifeline": None,
}
import numpy as np  # noqa: E402

from ronde.runner import lifeline  # noqa: E402

report["lifeline"] = lifeline._pipe_fd(os.environ.get("RONDE_LAUNCHER_FD", "")) is not None
report["draw"] = float(np.random.random())  # unseeded: each process its own
print(json.dumps(report))
print("to stderr", file=sys.stderr)
if how == "exit3":
    sys.exit(3)
if how == "raise":
    # the interpreter hands an uncaught exception to sys.excepthook (ronde.init()
    # installs its failure report there): a forked worker must too
    sys.excepthook = lambda *exc: print("HOOK", exc[0].__name__, file=sys.stderr,
                                         flush=True)
    raise ValueError("raised in the worker")
if how == "sigkill" and os.environ.get("RONDE_RANK") == "1":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "hang":
    time.sleep(600)
