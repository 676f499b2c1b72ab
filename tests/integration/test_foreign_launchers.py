"""Workers started by mpirun-, torchrun- or srun-style launchers, without ronderun."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

SCRIPT = ("import numpy as np, ronde as hvd; hvd.init(); "
          "s = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum); "
          "print(hvd.rank(), hvd.size(), hvd.local_rank(), int(s[0]), flush=True); hvd.shutdown()")


def spawn(n: int, env_of) -> list[str]:
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env={**os.environ, **env_of(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(out.strip())
    return outs


@pytest.mark.timeout(90)
def test_open_mpi_environment_single_host():
    job = uuid.uuid4().hex
    outs = spawn(3, lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "3",
                               "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                               "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "PMIX_NAMESPACE": job})
    assert outs == [f"{r} 3 {r} 6" for r in range(3)]


@pytest.mark.timeout(90)
def test_mpich_environment_single_host():
    job = uuid.uuid4().hex
    outs = spawn(2, lambda r: {"PMI_RANK": str(r), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(r),
                               "MPI_LOCALNRANKS": "2", "PMI_KVSNAME": job})
    assert outs == [f"{r} 2 {r} 3" for r in range(2)]


@pytest.mark.timeout(90)
def test_torchrun_environment():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = spawn(2, lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(port - 1), "TORCHELASTIC_RUN_ID": "t"})
    assert outs == [f"{r} 2 {r} 3" for r in range(2)]


@pytest.mark.timeout(90)
def test_open_mpi_with_explicit_rendezvous_address_rank0_serves():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = uuid.uuid4().hex
    outs = spawn(2, lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                               "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": job,
                               "RONDE_RENDEZVOUS_ADDR": "127.0.0.1",
                               "RONDE_RENDEZVOUS_PORT": str(port), "RONDE_SECRET": "cd" * 16})
    assert outs == [f"{r} 2 {r} 3" for r in range(2)]
