"""Workers find their rank from ronderun, torchrun, Open MPI, MPICH and Slurm variables."""

from __future__ import annotations

import pytest

from ronde import ConfigError
from ronde.runner.env import detect


def test_single_process_without_launcher():
    w = detect({})
    assert (w.rank, w.size, w.source, w.rendezvous_mode) == (0, 1, "single", "none")


def test_ronderun():
    w = detect({"RONDE_RANK": "2", "RONDE_SIZE": "4", "RONDE_LOCAL_RANK": "0",
                "RONDE_LOCAL_SIZE": "2", "RONDE_RENDEZVOUS_ADDR": "10.0.0.1",
                "RONDE_RENDEZVOUS_PORT": "1234", "RONDE_SECRET": "ab" * 16,
                "RONDE_HOSTNAME": "b"})
    assert (w.rank, w.size, w.local_rank, w.host) == (2, 4, 0, "b")
    assert w.rendezvous == ("10.0.0.1", 1234) and w.secret == bytes.fromhex("ab" * 16)


def test_torchrun():
    w = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "abc"})
    assert (w.rank, w.size, w.local_rank, w.source) == (1, 2, 1, "torchrun")
    # one host and no secret: rank 0's random secret in a file only this user reads
    assert w.rendezvous_mode == "file" and w.secret is None


def test_torchrun_across_hosts_derives_no_secret_from_public_values():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    w = detect(env)
    assert w.rendezvous == ("10.1.2.3", 29501) and w.rendezvous_mode == "rank0"
    assert w.secret is None  # not sha256 of the public values, as before
    w = detect({**env, "RONDE_SECRET": "5e" * 32})
    assert w.secret == bytes.fromhex("5e" * 32) and w.rendezvous_mode == "rank0"


def test_secrets_that_can_be_guessed_or_misread_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"RONDE_SECRET holds 4 bytes; at least 16.*token_hex"):
        detect({"RONDE_SECRET": "abcd1234"})
    with pytest.raises(ConfigError, match="RONDE_SECRET is not hexadecimal"):
        detect({"RONDE_SECRET": "correct horse battery staple!"})
    f = tmp_path / "secret"
    f.write_text("7a" * 32 + "\n")
    assert detect({"RONDE_SECRET_FILE": str(f)}).secret == bytes.fromhex("7a" * 32)
    with pytest.raises(ConfigError, match="RONDE_SECRET_FILE .* cannot be read"):
        detect({"RONDE_SECRET_FILE": str(tmp_path / "missing")})


def test_open_mpi():
    w = detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                "PMIX_NAMESPACE": "job7"})
    assert (w.rank, w.size, w.local_rank, w.source) == (3, 4, 3, "openmpi")
    assert w.rendezvous_mode == "file" and "job7" in w.job_id


def test_mpich_hydra():
    w = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                "MPI_LOCALNRANKS": "2"})
    assert (w.rank, w.size, w.local_rank, w.source) == (1, 2, 1, "mpich")


def test_slurm():
    w = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                "SLURM_JOB_ID": "99", "SLURM_GTIDS": "4,5,6,7",
                "RONDE_RENDEZVOUS_ADDR": "node1", "RONDE_RENDEZVOUS_PORT": "7000"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.source) == (5, 8, 1, 4, "slurm")
    assert w.rendezvous == ("node1", 7000)
    assert w.secret is None and w.rendezvous_mode == "rank0"


def test_multi_host_mpi_without_rendezvous_address_says_what_to_set():
    with pytest.raises(ConfigError, match="RONDE_RENDEZVOUS_ADDR"):
        detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_bad_integer_is_named():
    with pytest.raises(ConfigError, match="RONDE_SIZE='two'"):
        detect({"RONDE_RANK": "0", "RONDE_SIZE": "two"})
