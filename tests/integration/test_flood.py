"""A connection flood against every listener of a tcp job cannot end it (issue #50).

1500 connections a second that send a valid-looking hello and then stall, against every
rank's listener and rank 0's rendezvous (``flooder.py``, bounded in rate, count and time,
on 127.0.0.1 only): before, each listener's handshake table filled with them and it
closed the real peers' connections, hello unread, so they got a reset: the first tcp
allreduce failed with ``LinkError: Connection reset by peer`` and start-up died with a
raw ``ConnectionResetError``. Now the oldest connection that has not proved the secret
makes room (transport/admission.py), and a peer dropped before its verdict connects again.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from .test_intruders import finish

pytestmark = pytest.mark.timeout(150)

FLOODER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flooder.py")

#: a rank: rank 0 starts at once (it serves the rendezvous); the others once the flood is
#: on; init (start-up under the flood), then the first allreduces (their links opened
#: under it), each checked against numpy
WORKER = r"""
import os, sys, time, numpy as np
if os.environ["RANK"] != "0":
    while not os.path.exists(os.environ["GO_PATH"]):
        time.sleep(0.02)
import ronde as hvd
hvd.init()
r, n = hvd.rank(), hvd.size()
base = np.arange(1 << 20, dtype=np.float32)
big = hvd.allreduce(base + r, op=hvd.Sum, name="big")
small = hvd.allreduce(np.array([r + 1.0]), op=hvd.Sum, name="small")
ok = np.array_equal(big, n * base + n * (n - 1) / 2) and small[0] == n * (n + 1) / 2
print("RESULT", r, n, ok, flush=True)
hvd.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _flooded_job(size: int, tmp_path) -> tuple[list[str], dict]:
    """Run a tcp job of ``size`` ranks (torchrun's way, with a secret) under the flood;
    return every rank's output and the flooder's report."""
    port, go, ready = _free_port(), tmp_path / f"go{size}", tmp_path / f"ready{size}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RONDE_", "HOROVOD_"))}
    procs, secret = [], os.urandom(16).hex()
    for r in range(size):
        env = dict(base, RANK=str(r), WORLD_SIZE=str(size), LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_RUN_ID="flood", RONDE_SECRET=secret,
                   RONDE_TRANSPORT="tcp", RONDE_START_TIMEOUT="30", GO_PATH=str(go))
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    flood = subprocess.Popen(
        [sys.executable, FLOODER, "--pids", ",".join(str(p.pid) for p in procs),
         "--rate", "1500", "--seconds", "40", "--count", "45000", "--ready", str(ready)],
        stdout=subprocess.PIPE, text=True)
    outs: list[str] = []
    try:
        while not ready.exists() and flood.poll() is None and procs[0].poll() is None:
            time.sleep(0.02)  # until rank 0's listeners are flooded
        go.touch()
        outs = finish(procs, timeout_s=100)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        report, _ = flood.communicate(timeout=30)
    return outs, json.loads(report)


def test_a_hello_and_stall_flood_against_every_listener_ends_no_tcp_job(tmp_path) -> None:
    for size in (2, 4):
        outs, report = _flooded_job(size, tmp_path)
        for r, out in enumerate(outs):
            assert f"RESULT {r} {size} True" in out, (size, r, out[-3000:])
            assert "Traceback" not in out, (size, r, out[-3000:])
        # every rank's listener and the rendezvous were flooded, and overflowed
        assert len(report["targets"]) == size + 1, report
        assert "made room for a newer connection" in outs[0], outs[0][-3000:]


#: an elastic worker: steps (an allreduce checked against the size) until it has run 5
#: steps at 3 ranks; rank 0 lists a third host once the flood is on
ELASTIC_WORKER = r"""
import os, time, numpy as np, ronde as hvd
from ronde.elastic import ObjectState, run
hvd.init()

@run
def train(state):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        n = hvd.size()
        got = hvd.allreduce(np.full(1 << 16, hvd.rank() + 1.0, np.float32), op=hvd.Sum,
                            name="x")
        assert np.all(got == n * (n + 1) / 2), (n, got[:3])
        if n == 3:
            state.at3 += 1
            if state.at3 >= 5:
                return n
        elif hvd.rank() == 0 and os.path.exists(os.environ["READY"]):
            with open(os.environ["HOSTS"], "a+") as f:
                f.seek(0)
                if "127.0.0.3" not in f.read().split():
                    f.write("127.0.0.3\n")
        state.commit()
        time.sleep(0.05)
    return n

print("DONE", hvd.rank(), train(ObjectState(at3=0)), flush=True)
"""


def test_an_elastic_job_admits_a_joining_host_under_the_flood(tmp_path) -> None:
    """The same flood against the elastic launcher's rendezvous and every worker's
    listener, of each generation (``--tree``): a host found by discovery joins, the mesh
    re-forms, every step's allreduce is right (before: the start-up died of a reset)."""
    (tmp_path / "worker.py").write_text(ELASTIC_WORKER)
    hosts, ready = tmp_path / "hosts", tmp_path / "ready"
    hosts.write_text("127.0.0.1\n127.0.0.2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RONDE_", "HOROVOD_"))}
    env.update(RONDE_TRANSPORT="tcp", RONDE_ELASTIC_POLL="0.2", READY=str(ready),
               HOSTS=str(hosts))
    job = subprocess.Popen(
        [sys.executable, "-m", "ronde.run", "-np", "2", "--min-np", "2", "--max-np", "3",
         "--host-discovery-script", str(discover), "--start-timeout", "30",
         sys.executable, str(tmp_path / "worker.py")],
        env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    flood = subprocess.Popen(
        [sys.executable, FLOODER, "--pids", str(job.pid), "--tree", "--rate", "1500",
         "--seconds", "60", "--count", "45000", "--ready", str(ready)],
        stdout=subprocess.PIPE, text=True)
    try:
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        report = json.loads(flood.communicate(timeout=30)[0])
    assert job.returncode == 0, out[-4000:]
    assert "generation 2: 127.0.0.1[0], 127.0.0.2[0], 127.0.0.3[0]" in out, out[-4000:]
    for r in range(3):
        assert f"DONE {r} 3" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    # the rendezvous and the listeners of both generations' workers
    assert len(report["targets"]) >= 4, report
