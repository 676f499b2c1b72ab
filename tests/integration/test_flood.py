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
    outs = []
    try:
        while not ready.exists() and flood.poll() is None and procs[0].poll() is None:
            time.sleep(0.02)  # until rank 0's listeners are flooded
        go.touch()
        for p in procs:
            try:
                out, _ = p.communicate(timeout=100)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outs.append(out)
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
