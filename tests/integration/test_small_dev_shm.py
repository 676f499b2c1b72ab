"""A job whose /dev/shm cannot hold its shared-memory segments still starts and trains
right, with a warning on every rank naming /dev/shm and the remedies (issue #50).

Segments are reserved in full when made (no SIGBUS later), about 260 MiB at np=2 by
default: with a container's 64 MiB /dev/shm, init() failed with a ConfigError where a
small job used to run. The job here runs in a private mount namespace whose /dev/shm is
a small tmpfs (tests run as root, CI too): at 32 MiB the segments shrink (the shm
transport stays), at 8 MiB the ranks run over tcp. Two inits each: a re-init makes new
segments, sized again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="needs root and unshare(1) to mount a small tmpfs on /dev/shm "
                       "in a private mount namespace; CI runs as root"),
]

WORKER = textwrap.dedent("""
    import numpy as np, ronde as hvd
    for round in (1, 2):
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        for count in (3, 100_000, 3_000_001):  # the last: 12 MB, more than a shrunk segment
            x = np.arange(count, dtype=np.float32) % 7 + r
            got = hvd.allreduce(x, op=hvd.Sum, name=f"a{round}.{count}")
            want = n * (np.arange(count, dtype=np.float32) % 7) + n * (n - 1) / 2
            assert np.array_equal(got, want), (round, count)
        assert hvd.allgather_object(r) == list(range(n))
        print("ROUND", round, r, hvd.active_transport(), flush=True)
        hvd.shutdown()
""")


def run_in_small_shm(tmp_path, np_: int, size: str) -> subprocess.CompletedProcess[str]:
    """``ronderun -np np_`` in a mount namespace whose /dev/shm is a tmpfs of ``size``;
    prints what is left there after the job as ``LEFT:``."""
    script = tmp_path / "job.py"
    script.write_text(WORKER)
    shell = ('mount -t tmpfs -o size="$0" tmpfs /dev/shm || exit 97; "$@"; rc=$?; '
             'echo "LEFT:$(ls -A /dev/shm | tr "\\n" " ")"; exit $rc')
    env = {k: v for k, v in os.environ.items() if not k.startswith("RONDE_")}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", shell,
                           size, sys.executable, "-m", "ronde.run", "-np", str(np_),
                           sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("np_, size, transport, outcome", [
    (2, "32m", "shm", "running with 3MiB segments instead"),
    (3, "8m", "tcp", "run over tcp"),
])
def test_a_small_dev_shm_shrinks_or_falls_back_with_a_warning(tmp_path, np_, size, transport,
                                                               outcome):
    proc = run_in_small_shm(tmp_path, np_, size)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in range(np_):
        for round in (1, 2):
            assert f"[{r}]<stdout>:ROUND {round} {r} {transport}" in proc.stdout, out[-4000:]
        warnings = [line for line in out.splitlines()
                    if line.startswith(f"[{r}]<stderr>:") and "bytes free on host" in line]
        assert len(warnings) == 2, out[-4000:]  # one a rank and init
        for part in ("/dev/shm has ", outcome, "--shm-size=", "mount -o remount,size=",
                     "RONDE_TRANSPORT=tcp"):
            assert part in warnings[0], warnings[0]
    assert "SIGBUS" not in out and "Traceback" not in out, out[-4000:]
    assert "LEFT: \n" in proc.stdout or "LEFT:\n" in proc.stdout, proc.stdout[-2000:]
