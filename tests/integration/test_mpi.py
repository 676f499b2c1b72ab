"""The same collective suite with MPI moving the bytes (ronderun --mpi, mpi4py + MPICH)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None and (
    os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    or shutil.which("mpiexec") is not None)
pytestmark = pytest.mark.skipif(not HAVE_MPI, reason="needs mpi4py and mpiexec")


def run_mpi(tmp_path, np_: int, worker: str) -> dict[int, object]:
    script = tmp_path / "job.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from tests.integration import workers\n"
        f"sys.stdout.write('RESULT ' + json.dumps(workers.{worker}()) + chr(10))\n")
    proc = subprocess.run([sys.executable, "-m", "ronde.run", "--mpi", "-np", str(np_),
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=150, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = {}
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            rank = int(line[line.index("[") + 1: line.index("]")])
            results[rank] = json.loads(line.split("RESULT ", 1)[1])
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_", [2, 3])
def test_every_collective_over_mpi(tmp_path, np_):
    assert run_mpi(tmp_path, np_, "collectives") == {r: "ok" for r in range(np_)}


@pytest.mark.timeout(120)
def test_process_sets_and_steady_state_over_mpi(tmp_path):
    ids = run_mpi(tmp_path, 4, "process_sets")
    assert len({json.dumps(v) for v in ids.values()}) == 1
    assert run_mpi(tmp_path, 3, "steady_state") == {r: "ok" for r in range(3)}


@pytest.mark.timeout(120)
def test_an_allgather_into_its_own_output_over_mpi(tmp_path):
    # ShardedOptimizer's flat parameters: each rank sends its own block of the output;
    # MPICH refused those aliased buffers (MPI.Exception) before the in-place form
    pytest.importorskip("torch")
    assert run_mpi(tmp_path, 3, "inplace_allgather") == {r: "ok" for r in range(3)}


@pytest.mark.timeout(60)
def test_topology_reports_mpi(tmp_path):
    out = run_mpi(tmp_path, 2, "topology")
    assert [out[r][0] for r in range(2)] == [0, 1] and {out[r][7] for r in range(2)} == {"mpi"}


@pytest.mark.timeout(60)
def test_init_with_an_mpi4py_communicator(tmp_path):
    out = run_mpi(tmp_path, 3, "mpi_comm_init")
    assert out == {r: [3.0, True, False] for r in range(3)}


SECRET_OVER_MPI = """
import ronde as hvd, numpy as np
from ronde.runner import meeting
hvd.init()
s = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
server = meeting._rank0_server
import os
with open(os.path.join(os.environ["OUT_DIR"], f"rank{hvd.rank()}"), "w") as fh:
    fh.write(f"{hvd.rank()} {int(s[0])} {len(meeting._open_secret or b'')} "
             f"{server is None or server._open_gen is None}")
hvd.shutdown()
"""


@pytest.mark.timeout(120)
def test_mpirun_without_a_secret_gets_rank0s_random_one_over_mpi(tmp_path):
    """A job started by mpiexec with a rendezvous address and no RONDE_SECRET: rank 0
    makes a random secret and broadcasts it over MPI itself (issue #32; it was sha256 of
    public job identifiers); no open start-up is needed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RONDE_", "HOROVOD_"))}
    env.update({"RONDE_RENDEZVOUS_ADDR": "127.0.0.1", "RONDE_RENDEZVOUS_PORT": str(port),
                "OUT_DIR": str(tmp_path)})
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", SECRET_OVER_MPI],
                          capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert got == ["0 3 32 True", "1 3 32 True"], proc.stdout
    assert "RONDE_OPEN_STARTUP" not in proc.stderr
