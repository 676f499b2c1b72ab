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


CONTRACT = """
import os, ronde as hvd
hvd.init()
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
print(" ".join(os.environ.get(n, "-") for n in names), int(os.environ["MASTER_PORT"]) > 0,
      flush=True)
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # env://, as Lightning and Hugging Face do
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
dist.destroy_process_group()
hvd.shutdown()
hvd.init()  # again: still the Open MPI job, not taken for a torchrun one
print("again", hvd.rank(), hvd.size(), hvd._api.runtime().wenv.source, t.item(), flush=True)
hvd.shutdown()
"""


@pytest.mark.timeout(90)
def test_init_gives_every_launcher_the_torchrun_contract():
    """Not only ronderun: after hvd.init() a worker started by mpirun (and elastic, Ray,
    Spark) has torchrun's variables, so a trainer reading them runs distributed
    (issue #35); the launcher's own variables still decide a re-init."""
    pytest.importorskip("torch")
    job = uuid.uuid4().hex
    procs = [subprocess.Popen([sys.executable, "-c", CONTRACT], text=True,
                              env={**os.environ, "OMPI_COMM_WORLD_RANK": str(r),
                                   "OMPI_COMM_WORLD_SIZE": "2",
                                   "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                                   "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": job},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=80)
        assert p.returncode == 0, err
        lines = out.strip().splitlines()
        assert lines[0] == f"{r} 2 {r} 2 0 127.0.0.1 True"
        assert lines[1] == f"again {r} 2 openmpi 3.0"
