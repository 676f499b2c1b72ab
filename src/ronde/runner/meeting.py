"""How a worker meets its peers where no launcher serves the rendezvous.

``ronderun`` (and ``ronderun --mpi``, Ray, Spark) serve the rendezvous and hand every
worker the job's secret. Workers started by ``torchrun``, ``mpirun`` or ``srun`` meet
here (:func:`meet`, by ``WorkerEnv.rendezvous_mode``):

* ``"file"``, every rank on one host: rank 0 serves on 127.0.0.1 with a random secret
  and publishes both in a ``0600`` file in this user's private directory
  (``_private_files.py``: no other user can plant, swap or read it); the other ranks
  read it only once ``fstat`` showed it is this user's;
* ``"rank0"``, ranks on several hosts: rank 0 serves where the ranks are told
  (``MASTER_ADDR``, ``RONDE_RENDEZVOUS_ADDR``), bound to that address. The secret is the
  user's (``RONDE_SECRET``/``RONDE_SECRET_FILE``), else rank 0's random one broadcast over
  MPI (mpi4py), else rank 0's random one handed out by an *open* start-up, with a
  warning (see runner/rendezvous.py and docs/security.md);
* ``"server"``: someone else serves (``RONDE_RENDEZVOUS_ADDR`` with its secret).

The server lives for the process (re-initialisations register with it again).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from typing import Any

from .. import _config, _private_files
from .._errors import ConfigError, RendezvousError
from . import rendezvous
from .env import WorkerEnv

log = logging.getLogger("ronde")

_rank0_server: rendezvous.RendezvousServer | None = None
_rank0_file: str | None = None
#: the job secret this rank learnt at its first init (an open rendezvous, or over MPI)
_open_secret: bytes | None = None


def _file_name(job_id: str) -> str:
    """The rendezvous file's name in the private directory (its parts are public: the
    directory is what keeps other users out)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)
    return f"rdv-{safe}.json"


def _publish(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` whole under ``path``: a new file of random name (``O_EXCL``, 0600),
    renamed into place, so a reader never sees half of it."""
    fd, tmp = _private_files.create_file(os.path.dirname(path), ".rdv-", ".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_published(path: str) -> dict[str, Any]:
    """Rank 0's file, opened only once it proved to be this user's (``open_checked``)."""
    with os.fdopen(_private_files.open_checked(path), "r") as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def meet(wenv: WorkerEnv, cfg: _config.Config, info: dict[str, Any]
                ) -> tuple[list[dict[str, Any]], bytes]:
    """Meet the other ranks; return the peer table and the job secret."""
    global _rank0_server, _rank0_file
    mode = wenv.rendezvous_mode
    if mode == "server":
        assert wenv.rendezvous is not None
        if wenv.secret is None:
            raise ConfigError(
                f"this {wenv.source} job names a rendezvous service "
                f"({wenv.rendezvous[0]}:{wenv.rendezvous[1]}) but no secret to prove to it: "
                "export the service's RONDE_SECRET (or RONDE_SECRET_FILE) to every rank")
        return rendezvous.register(wenv.rendezvous, wenv.secret, info, cfg.start_timeout_s), \
            wenv.secret
    if mode == "rank0":
        return _rank0_rendezvous(wenv, cfg, info)
    # "file": ranks of one host meet through a 0600 file naming rank 0's service, in
    # this user's private directory
    path = os.path.join(_private_files.private_dir(), _file_name(wenv.job_id))
    if wenv.rank == 0:
        if _rank0_server is None:
            secret = secrets.token_bytes(32)
            _rank0_server = rendezvous.RendezvousServer(
                wenv.size, secret, host="127.0.0.1", start_timeout_s=cfg.start_timeout_s).start()
            _publish(path, {"port": _rank0_server.port, "secret": secret.hex()})
            _rank0_file = path
        secret = _rank0_server.secret
        return rendezvous.register(_rank0_server.address, secret, info, cfg.start_timeout_s), secret
    deadline = time.monotonic() + cfg.start_timeout_s
    while True:
        try:
            data = _read_published(path)
            secret = bytes.fromhex(data["secret"])
            return rendezvous.register(("127.0.0.1", int(data["port"])), secret, info,
                                       min(2.0, max(0.1, deadline - time.monotonic()))), secret
        except (FileNotFoundError, ValueError, KeyError, TypeError, RendezvousError):
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"rank {wenv.rank}: rank 0 of this {wenv.source} job did not publish its "
                    f"rendezvous ({path}) within {cfg.start_timeout_s:g}s; did rank 0 start "
                    "and call ronde.init()?") from None
            time.sleep(0.05)


def _rank0_rendezvous(wenv: WorkerEnv, cfg: _config.Config, info: dict[str, Any]
                      ) -> tuple[list[dict[str, Any]], bytes]:
    """Rank 0 serves the rendezvous (torchrun, or MPI/Slurm given an address), bound to
    the address the other ranks are told (``MASTER_ADDR``...), never every interface
    unless ``RONDE_BIND_ADDR`` asks. The secret is the user's (``RONDE_SECRET``), else
    rank 0's random one sent over MPI where the job has it, else rank 0's random one
    handed out by an *open* first start-up (see runner/rendezvous.py), with a warning."""
    global _rank0_server, _open_secret
    assert wenv.rendezvous is not None
    secret = wenv.secret or _open_secret or _secret_over_mpi(wenv)
    if wenv.rank == 0:
        if _rank0_server is None:
            open_start = secret is None
            if open_start:
                log.warning(
                    "ronde: this %s job was given no secret (RONDE_SECRET or "
                    "RONDE_SECRET_FILE): until every rank has joined, any process that "
                    "reaches %s:%d can join it in a rank's place, as with torch.distributed's "
                    "own store. Give every rank the same RONDE_SECRET to authenticate them "
                    "(docs/security.md)", wenv.source, *wenv.rendezvous)
            bind = cfg.bind_addr or wenv.rendezvous[0]
            try:
                _rank0_server = rendezvous.RendezvousServer(
                    wenv.size, secret or secrets.token_bytes(32), host=bind,
                    port=wenv.rendezvous[1], start_timeout_s=cfg.start_timeout_s,
                    open_start=open_start).start()
            except OSError as exc:
                raise ConfigError(
                    f"rank 0 cannot serve the rendezvous on {bind}:{wenv.rendezvous[1]} "
                    f"({exc.strerror}): the address the ranks are told (MASTER_ADDR or "
                    "RONDE_RENDEZVOUS_ADDR) must be one of rank 0's, and the port free; "
                    "RONDE_BIND_ADDR=0.0.0.0 listens on every interface") from None
        secret = _rank0_server.secret
    if secret is None:
        peers, secret = rendezvous.register_open(wenv.rendezvous, info, cfg.start_timeout_s)
        _open_secret = secret  # a later init() proves it
        return peers, secret
    return rendezvous.register(wenv.rendezvous, secret, info, cfg.start_timeout_s), secret


def _secret_over_mpi(wenv: WorkerEnv) -> bytes | None:
    """Rank 0's random secret, broadcast over MPI itself (mpi4py), in a job that
    ``mpirun`` started; None where mpi4py is not installed."""
    global _open_secret
    if wenv.source not in ("openmpi", "mpich"):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    token = secrets.token_bytes(32) if wenv.rank == 0 else None
    _open_secret = bytes(MPI.COMM_WORLD.bcast(token, root=0))
    return _open_secret


def close() -> None:
    """At exit: remove the published file, stop serving."""
    global _rank0_server
    if _rank0_file:
        try:
            os.unlink(_rank0_file)
        except OSError:
            pass
    if _rank0_server is not None:
        _rank0_server.close()
        _rank0_server = None
