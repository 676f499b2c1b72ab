"""The worker environment contract, and how a worker finds its place in the job.

``ronderun`` gives every worker these variables (this docstring is the contract;
docs/launcher.md repeats it for users):

=========================  ===========================================================
``RONDE_RANK``             global rank, 0..size-1
``RONDE_SIZE``             number of workers
``RONDE_LOCAL_RANK``       rank among the workers on the same host
``RONDE_LOCAL_SIZE``       number of workers on this host
``RONDE_CROSS_RANK``       index of this host among hosts (Horovod's cross rank)
``RONDE_CROSS_SIZE``       number of hosts
``RONDE_HOSTNAME``         the host's name as written in ``-H``/``--hostfile``
``RONDE_RENDEZVOUS_ADDR``  address of the launcher's rendezvous service
``RONDE_RENDEZVOUS_PORT``  its port
``RONDE_SECRET``           per-job secret (hex) every ronde connection authenticates with
``RONDE_JOB_ID``           identifier of this job (names shared-memory segments and logs)
``RONDE_ELASTIC``          ``1`` in an elastic job (``--min-np``...): rank and size are
                           handed out by the rendezvous at every ``init()``
``RONDE_SLOT``             an elastic worker's slot on its host
``RONDE_NODE``             the machine an elastic worker runs on, where its slot's host
                           is a logical name (``ronde.spark.run_elastic``); ranks on one
                           machine share memory
=========================  ===========================================================

The ``HOROVOD_RANK``/``HOROVOD_SIZE``/... equivalents are set too, for scripts that
read them. Workers started without ``ronderun`` are recognised from the variables of
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...), Open MPI
(``OMPI_COMM_WORLD_*``), MPICH/Hydra (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``)
and Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``); see
:func:`detect`. Without any of them the process is a job of one.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from typing import TYPE_CHECKING, Mapping, MutableMapping, Sequence

if TYPE_CHECKING:
    from .hosts import RankSlot

from .._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
    """Where this process sits in the job, as its launcher told it."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str
    source: str  # "ronderun", "torchrun", "openmpi", "mpich", "slurm", "single"
    rendezvous: tuple[str, int] | None = None
    secret: bytes | None = None
    job_id: str = ""
    #: how to rendezvous without a launcher service: "server", "rank0", "file" or "none"
    rendezvous_mode: str = "server"
    #: an elastic job's worker: rank and size come from the rendezvous at each init()
    elastic: bool = False
    #: its slot on its host (elastic jobs)
    slot: int = 0
    #: the machine it runs on when ``host`` is a logical slot name (``RONDE_NODE``)
    node: str = ""
    #: per rank, the CPUs the ranks of its host may use together (from the rendezvous
    #: table; 0 where unknown)
    host_cores: tuple[int, ...] = ()
    #: the launcher's newest host notice when this generation formed (elastic jobs)
    notice: float = 0.0
    #: rank 0's address and a port free there, for torch.distributed's store
    #: (``MASTER_ADDR``/``MASTER_PORT``: see :func:`export_torchrun`)
    master: tuple[str, int] | None = None


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"{name} is required in the worker environment but is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


#: the shortest secret accepted: 128 bits, beyond guessing even offline
MIN_SECRET_BYTES = 16
_SECRET_FIX = ("generate one with `python -c \"import secrets; print(secrets.token_hex(32))\"` "
               "and give the same value to every rank")


def job_secret(env: Mapping[str, str]) -> bytes | None:
    """The secret the user gave (``RONDE_SECRET``, hex, or ``RONDE_SECRET_FILE``, a file
    holding it), or None. Never derived from public values: a job given none either
    makes one (ronderun, a job on one host) or warns that start-up is open (see
    docs/security.md)."""
    raw, name = env.get("RONDE_SECRET", ""), "RONDE_SECRET"
    if not raw and env.get("RONDE_SECRET_FILE"):
        name = f"RONDE_SECRET_FILE ({env['RONDE_SECRET_FILE']})"
        try:
            with open(env["RONDE_SECRET_FILE"], "rb") as fh:
                raw = fh.read(4096).decode("ascii", "replace").strip()
        except OSError as exc:
            raise ConfigError(f"{name} cannot be read: {exc.strerror}") from None
    if not raw:
        return None
    try:
        secret = bytes.fromhex(raw.strip())
    except ValueError:
        raise ConfigError(f"{name} is not hexadecimal; {_SECRET_FIX}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{name} holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} "
                          f"({2 * MIN_SECRET_BYTES} hex digits) are needed, or the secret "
                          f"can be guessed; {_SECRET_FIX}")
    return secret


def detect(env: Mapping[str, str] | None = None) -> WorkerEnv:
    """Work out rank, size and rendezvous from the environment (see module docstring)."""
    env = os.environ if env is None else env
    hostname = env.get("RONDE_HOSTNAME") or socket.gethostname()
    explicit_rdv = None
    if env.get("RONDE_RENDEZVOUS_ADDR"):
        explicit_rdv = (env["RONDE_RENDEZVOUS_ADDR"], _int(env, "RONDE_RENDEZVOUS_PORT"))
    secret = job_secret(env)

    if "RONDE_RANK" in env:
        size = _int(env, "RONDE_SIZE")
        return WorkerEnv(
            rank=_int(env, "RONDE_RANK"), size=size,
            local_rank=_int(env, "RONDE_LOCAL_RANK", 0), local_size=_int(env, "RONDE_LOCAL_SIZE", 1),
            host=hostname, source="ronderun", rendezvous=explicit_rdv, secret=secret,
            job_id=env.get("RONDE_JOB_ID", ""),
            rendezvous_mode="server" if explicit_rdv else ("none" if size == 1 else "file"),
            elastic=env.get("RONDE_ELASTIC") == "1" and explicit_rdv is not None,
            slot=_int(env, "RONDE_SLOT", 0), node=env.get("RONDE_NODE", ""),
        )
    by_ronde = set(env.get(TORCHRUN_SET, "").split(","))
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env
                                        and "MASTER_ADDR" in env and "RANK" not in by_ronde):
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT", 29500)
        run_id = env.get("TORCHELASTIC_RUN_ID", "none")
        rdv_port = _int(env, "RONDE_RENDEZVOUS_PORT", port + 1)
        local_size = _int(env, "LOCAL_WORLD_SIZE", 1)
        if size == 1:
            mode = "none"
        elif explicit_rdv:
            mode = "server"
        elif local_size == size and secret is None:
            mode = "file"  # one host: a random secret in a file only this user reads
        else:
            mode = "rank0"
        return WorkerEnv(
            rank=rank, size=size, local_rank=_int(env, "LOCAL_RANK", 0),
            local_size=local_size, host=hostname, source="torchrun",
            rendezvous=explicit_rdv or (addr, rdv_port), secret=secret,
            job_id=f"torchrun-{run_id}-{port}", rendezvous_mode=mode,
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        source = "openmpi"
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
        job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or f"ppid{os.getppid()}"
    elif "PMI_RANK" in env:
        source = "mpich"
        rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_rank = _int(env, "MPI_LOCALRANKID", 0)
        local_size = _int(env, "MPI_LOCALNRANKS", 1)
        job = env.get("PMI_KVSNAME") or env.get("PMIX_NAMESPACE") or f"ppid{os.getppid()}"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        source = "slurm"
        rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID", 0)
        local_size = len(env.get("SLURM_GTIDS", "0").split(",")) if env.get("SLURM_GTIDS") else 1
        job = f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
    else:
        return WorkerEnv(rank=0, size=1, local_rank=0, local_size=1, host=hostname,
                         source="single", rendezvous=explicit_rdv, secret=secret,
                         rendezvous_mode="none")
    if size == 1:
        mode = "none"
    elif explicit_rdv:
        mode = "server"
    elif local_size == size:
        mode = "file"
    else:
        raise ConfigError(
            f"this {source} job spans several hosts and ronde cannot find a rendezvous "
            "address: launch it with ronderun, or export RONDE_RENDEZVOUS_ADDR/"
            "RONDE_RENDEZVOUS_PORT (rank 0 serves there) and RONDE_SECRET to every rank")
    return WorkerEnv(
        rank=rank, size=size, local_rank=local_rank, local_size=local_size, host=hostname,
        source=source, rendezvous=explicit_rdv, secret=secret,
        job_id=env.get("RONDE_JOB_ID") or f"{source}-{job}",
        # under ronderun --mpi the launcher serves the rendezvous; otherwise, with an
        # explicit address, rank 0 serves it
        rendezvous_mode=("server" if env.get("RONDE_LAUNCHER") == "ronderun" else "rank0")
        if mode == "server" else mode,
    )


#: the torchrun variables ronde set itself (a comma-separated list): ronde may update
#: them (an elastic job's next generation); the user's own are left alone
TORCHRUN_SET = "RONDE_TORCHRUN_SET"


def export_torchrun(env: "MutableMapping[str, str]", values: Mapping[str, str],
                    update: Sequence[str] = ()) -> None:
    """Put torchrun's variables ``values`` into ``env`` (``os.environ`` at ``init()``):
    those not set yet, and those in ``update`` that ronde set itself; what the user set
    stays. Every process ``init()`` joined to a job of several then has the contract,
    whoever launched it (elastic generations, Ray, Spark, mpirun, srun)."""
    mine = {n for n in env.get(TORCHRUN_SET, "").split(",") if n}
    for name, value in values.items():
        if name not in env or (name in mine and name in update):
            env[name] = value
            mine.add(name)
    env[TORCHRUN_SET] = ",".join(sorted(mine))


def torchrun_vars(*, rank: int, size: int, local_rank: int, local_size: int, node_rank: int,
                  nodes: int, master: tuple[str, int]) -> dict[str, str]:
    """torchrun's worker contract, which ``ronderun`` sets too (unless the user's
    environment already does), so that trainers reading it (Lightning, Hugging Face
    ``Trainer`` and ``accelerate``, a plain ``init_process_group``) run distributed
    instead of training one copy per process. ``GROUP_RANK`` is the host's index in
    the host list, ``MASTER_ADDR:MASTER_PORT`` a free port on rank 0's host for
    torch.distributed's store (ronde's own rendezvous does not use it)."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size),
        "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
    }


def worker_env_vars(
    *, rank: int, size: int, local_rank: int, local_size: int, cross_rank: int, cross_size: int,
    host: str, rendezvous: tuple[str, int], secret: bytes, job_id: str,
) -> dict[str, str]:
    """The variables ``ronderun`` sets for one worker (the contract above)."""
    values = {
        "RANK": rank, "SIZE": size, "LOCAL_RANK": local_rank, "LOCAL_SIZE": local_size,
        "CROSS_RANK": cross_rank, "CROSS_SIZE": cross_size,
    }
    out = {f"RONDE_{k}": str(v) for k, v in values.items()}
    out.update({f"HOROVOD_{k}": str(v) for k, v in values.items()})
    out.update({
        "RONDE_HOSTNAME": host,
        "HOROVOD_HOSTNAME": host,
        "RONDE_RENDEZVOUS_ADDR": rendezvous[0],
        "RONDE_RENDEZVOUS_PORT": str(rendezvous[1]),
        "RONDE_SECRET": secret.hex(),
        "RONDE_JOB_ID": job_id,
    })
    return out


def torchrun_env(slots: Sequence["RankSlot"], rendezvous_addr: str,
                 env: Mapping[str, str] | None) -> list[dict[str, str]]:
    """Per rank, the torchrun variables (``RANK``, ``MASTER_ADDR``...: see
    :func:`ronde.runner.env.torchrun_vars`) that ``-x`` does not set (and
    ``MASTER_ADDR``/``MASTER_PORT`` where the launcher's environment has them). ``MASTER_PORT`` is a port free on this machine now when rank 0
    runs here; for a remote rank 0 a random high port (``-x MASTER_PORT=...`` pins one)."""
    from ..transport.net import free_port
    from .hosts import is_local

    # -x wins for every name; the launcher's own environment only for MASTER_ADDR and
    # MASTER_PORT: a RANK or WORLD_SIZE left in a shell cannot be right for every rank
    # (WORLD_SIZE=1 exported made a -np 2 job crash in gloo)
    given = set(env or {}) | {n for n in ("MASTER_ADDR", "MASTER_PORT") if n in os.environ}
    host0 = slots[0].host
    if is_local(host0):
        master = "127.0.0.1" if all(is_local(s.host) for s in slots) else rendezvous_addr
        port = free_port("127.0.0.1" if master == "127.0.0.1" else "")
    else:
        master, port = host0, 20000 + secrets.randbelow(30000)
    nodes: list[str] = []
    for s in slots:
        if s.host not in nodes:
            nodes.append(s.host)
    out = []
    for s in slots:
        values = torchrun_vars(rank=s.rank, size=len(slots), local_rank=s.local_rank,
                               local_size=s.local_size, node_rank=nodes.index(s.host),
                               nodes=len(nodes), master=(master, port))
        mine = {k: v for k, v in values.items() if k not in given}
        mine[TORCHRUN_SET] = ",".join(sorted(mine))
        out.append(mine)
    return out
