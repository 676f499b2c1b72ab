"""Failures end every rank quickly with a typed error, and ronderun leads with the cause."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest

from ronde.transport.segments import job_key

RONDERUN = [sys.executable, "-m", "ronde.run"]


def ronderun(tmp_path, np_: int, body: str, *flags: str, timeout: float = 60.0,
             env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    t = time.monotonic()
    proc = subprocess.run([*RONDERUN, "-np", str(np_), *flags, sys.executable, str(script)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return proc, time.monotonic() - t


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sigkilled_rank_raises_peer_lost_on_survivors(tmp_path, transport):
    proc, elapsed = ronderun(tmp_path, 3, """
        import os, signal, sys, time
        import numpy as np
        import ronde as hvd
        hvd.init()
        if hvd.rank() == 0:
            print("JOB", os.environ["RONDE_JOB_ID"], flush=True)
        x = np.ones(1_000_000, np.float32)
        t0 = None
        try:
            for i in range(100000):
                if hvd.rank() == 1 and i == 20:
                    os.kill(os.getpid(), signal.SIGKILL)
                if i == 20:
                    t0 = time.monotonic()
                hvd.allreduce(x, name=f"step{i % 4}")
        except hvd.PeerLostError as exc:
            print(f"PEERLOST rank={exc.rank} after {time.monotonic() - t0:.2f}s: {exc}",
                  flush=True)
            sys.exit(5)
    """, env={"RONDE_TRANSPORT": transport})
    assert proc.returncode != 0
    out = proc.stdout
    for r in (0, 2):
        line = next(l for l in out.splitlines() if l.startswith(f"[{r}]<stdout>:PEERLOST"))
        assert "rank=1" in line and "host localhost" in line, line
        assert float(line.split(" after ")[1].split("s")[0]) < 10.0
    last = proc.stderr.strip().splitlines()
    summary = [l for l in last if l.startswith("ronderun: rank")][0]
    assert "rank 1" in summary and "SIGKILL" in summary, proc.stderr[-2000:]
    # this job's segments only (the suite's other workers run jobs meanwhile)
    job = next(l for l in out.splitlines() if l.startswith("[0]<stdout>:JOB ")).split()[-1]
    left = glob.glob(f"/dev/shm/ronde-{job_key(job)}-*")
    assert not left, f"shared memory left behind: {left}"


@pytest.mark.timeout(60)
def test_exception_on_one_rank_is_reported_first(tmp_path):
    proc, elapsed = ronderun(tmp_path, 3, """
        import numpy as np
        import ronde as hvd
        hvd.init()
        hvd.allreduce(np.ones(3), name="warmup")
        if hvd.rank() == 2:
            raise ValueError("bad batch on rank two")
        hvd.allreduce(np.ones(3), name="next")
    """)
    assert proc.returncode == 1
    tail = proc.stderr.strip().splitlines()
    lead = [l for l in tail if l.startswith("ronderun: rank")][0]
    assert "rank 2" in lead
    assert "ValueError: bad batch on rank two" in "\n".join(tail[tail.index(lead):])


@pytest.mark.timeout(60)
def test_missing_rank_at_start_is_named(tmp_path):
    proc, elapsed = ronderun(tmp_path, 3, """
        import time
        import ronde as hvd
        import os
        if os.environ["RONDE_RANK"] == "2":
            time.sleep(30)
        hvd.init()
    """, "--start-timeout", "2")
    assert proc.returncode != 0
    assert "missing rank(s) 2" in proc.stdout + proc.stderr
    assert "RendezvousError" in proc.stderr


@pytest.mark.timeout(60)
def test_exit_code_of_first_failure_is_propagated(tmp_path):
    proc, elapsed = ronderun(tmp_path, 2, """
        import sys
        import numpy as np
        import ronde as hvd
        hvd.init()
        if hvd.rank() == 1:
            sys.exit(3)
        hvd.allreduce(np.ones(3))
    """)
    assert proc.returncode == 3
    assert "rank 1" in [l for l in proc.stderr.splitlines() if l.startswith("ronderun: rank")][0]


@pytest.mark.timeout(60)
def test_mismatch_ends_every_rank_with_clear_error(tmp_path):
    proc, elapsed = ronderun(tmp_path, 3, """
        import numpy as np
        import ronde as hvd
        hvd.init()
        n = 5 if hvd.rank() == 1 else 4
        hvd.allreduce(np.ones((n, 2), np.float32), name="grad.fc1.weight")
    """)
    assert proc.returncode == 1
    for r in range(3):
        assert f"[{r}]<stderr>:ronde.TensorMismatchError: allreduce 'grad.fc1.weight'" in \
            proc.stderr, proc.stderr[-3000:]
    assert "rank 1 sent float32[5, 2]" in proc.stderr
