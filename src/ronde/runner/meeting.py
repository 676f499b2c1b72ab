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
  MPI (mpi4py); without one no rank starts (a ``ConfigError`` whose first line is the
  fix), unless ``RONDE_OPEN_STARTUP=1`` asks for an *open* start-up that hands rank 0's
  random one out (see runner/rendezvous.py and docs/security.md);
* ``"server"``: someone else serves (``RONDE_RENDEZVOUS_ADDR`` with its secret).

The server lives for the process (re-initialisations register with it again).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

from .. import _config, _private_files
from .._errors import ConfigError, PeerLostError, RendezvousError
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
    rank 0's random one sent over MPI where the job has it; without either every rank
    refuses to start (:func:`no_secret`), unless ``RONDE_OPEN_STARTUP=1`` asks for an
    *open* first start-up that hands rank 0's random one out (see runner/rendezvous.py)."""
    global _rank0_server, _open_secret
    assert wenv.rendezvous is not None
    secret = wenv.secret or _open_secret or _secret_over_mpi(wenv)
    if secret is None and not cfg.open_startup:
        raise ConfigError(no_secret(wenv))
    if wenv.rank == 0:
        if _rank0_server is None:
            open_gen = int(info["generation"]) if secret is None else None
            if open_gen is not None:
                log.warning(
                    "ronde: this %s job has no secret and RONDE_OPEN_STARTUP=1: until every "
                    "rank has joined, any process that reaches %s:%d can join it in a rank's "
                    "place, as with torch.distributed's own store. Give every rank the same "
                    "RONDE_SECRET to authenticate them (docs/security.md)",
                    wenv.source, *wenv.rendezvous)
            bind = cfg.bind_addr or wenv.rendezvous[0]
            try:
                _rank0_server = rendezvous.RendezvousServer(
                    wenv.size, secret or secrets.token_bytes(32), host=bind,
                    port=wenv.rendezvous[1], start_timeout_s=cfg.start_timeout_s,
                    open_generation=open_gen, on_taken=_taken).start()
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


def no_secret(wenv: WorkerEnv) -> str:
    """Why a job across hosts with no secret does not start; the first line is the fix."""
    assert wenv.rendezvous is not None
    mpi = " (or install mpi4py: rank 0 then sends one over MPI)" \
        if wenv.source in ("openmpi", "mpich") else ""
    return (
        "export one RONDE_SECRET to every rank of this job on every host: "
        "export RONDE_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))') "
        "once where the job is launched, the same value on each host (srun and mpirun -x "
        "pass it on), or RONDE_SECRET_FILE naming a 0600 file every host reads" + mpi + "\n"
        f"This {wenv.source} job's ranks span hosts ({wenv.local_size} of its {wenv.size} "
        "on this one) and it was given no secret: any process "
        f"that reaches rank 0's rendezvous ({wenv.rendezvous[0]}:{wenv.rendezvous[1]}) "
        "during start-up could take a rank's place and run code in the job, so no rank "
        "starts. RONDE_OPEN_STARTUP=1 starts it anyway, trusting that network as "
        "torch.distributed does (docs/security.md).")


#: rank 0 of an open start-up: how to end the running job (``watch``), and why it ended
_fail: Callable[[BaseException], None] | None = None
_taken_error: PeerLostError | None = None
_taken_lock = threading.Lock()


def _taken(message: str, rank: int) -> None:
    """Rank 0's rendezvous saw a rank of its formed open start-up claimed again: end the
    job (on a thread of its own: ``Engine.fail`` tells every rank, which may wait)."""
    global _taken_error
    with _taken_lock:
        if _taken_error is None:
            _taken_error = PeerLostError(message, rank=rank)
        fail, error = _fail, _taken_error
    if fail is not None:
        threading.Thread(target=fail, args=(error,), name="ronde-rendezvous-taken",
                         daemon=True).start()


def watch(fail: Callable[[BaseException], None]) -> None:
    """The runtime of a new generation: ``fail(error)`` ends it (every rank, told by
    ``Engine.fail``) when a rank of this rank's open start-up turns out to have been
    taken, now or later (only rank 0 of an open start-up ever sees one)."""
    global _fail
    with _taken_lock:
        _fail, error = fail, _taken_error
    if error is not None:
        fail(error)


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
