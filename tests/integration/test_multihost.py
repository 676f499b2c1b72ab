"""A multi-host job on simulated hosts (network namespaces): tcp across, shm within."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ronde.testing import netns

pytestmark = pytest.mark.skipif(not netns.available(), reason="needs root and iproute2")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _on_two_hosts(script, **env: str) -> subprocess.CompletedProcess:
    """Run ``script`` with ronderun on two simulated hosts, two ranks each."""
    with netns.SimulatedHosts(2) as hosts:
        return subprocess.run(
            [sys.executable, "-m", "ronde.run", "-H", hosts.spec(2), "--start-timeout", "30",
             sys.executable, str(script)],
            capture_output=True, text=True, timeout=100, env={**hosts.env(), **env}, cwd=ROOT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cma", ["1", "0"])
def test_two_hosts_two_ranks_each(tmp_path, cma):
    script = tmp_path / "job.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from tests.integration import workers\n"
        "print('RESULT', json.dumps(workers.multihost()), flush=True)\n")
    proc = _on_two_hosts(script, RONDE_CMA=cma)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        if "<stdout>:RESULT " in line:
            rank = int(line[1:line.index("]")])
            results[rank] = json.loads(line.split("RESULT ", 1)[1])
    assert sorted(results) == [0, 1, 2, 3]
    # ranks 0,1 on the first host, 2,3 on the second
    assert [results[r][:4] for r in range(4)] == [[0, 2, 0, 2], [1, 2, 0, 2], [0, 2, 1, 2],
                                                  [1, 2, 1, 2]]
    assert {results[r][4] for r in range(4)} == {"hierarchical"}
    if cma == "0":
        assert {results[r][5] for r in range(4)} == {False}


@pytest.mark.timeout(120)
def test_torch_device_path_process_set_on_the_second_host(tmp_path):
    # A process set's own process group is served by its first member, which here is on
    # the second host: the store must be offered at that rank's address (it was offered
    # at rank 0's, where nothing listened)
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(
        "import torch\n"
        "import ronde.torch as hvd\n"
        "hvd.init()\n"
        "r = hvd.rank()\n"
        "second = hvd.add_process_set([2, 3])\n"
        "if r in (2, 3):\n"
        "    got = hvd.allreduce(torch.full((4,), float(r)), op=hvd.Sum, process_set=second)\n"
        "    assert got.tolist() == [5.0] * 4, got\n"
        "hvd.shutdown()\n"
        "print('OK', flush=True)\n")
    proc = _on_two_hosts(script, RONDE_TORCH_DEVICE_PATH="always")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("<stdout>:OK") == 4
