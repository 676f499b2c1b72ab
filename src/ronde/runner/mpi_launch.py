"""``ronderun --mpi``: start the workers with the environment's ``mpiexec``/``mpirun``.

The job is launched by MPI (so mpi4py sees every rank) and moves its bytes with MPI
(``RONDE_TRANSPORT=mpi``); ronde's engine still negotiates over its own
authenticated connections, which meet through this launcher's rendezvous service.
MPICH's Hydra (``mpiexec``) and Open MPI (``mpirun``) are recognised; Open MPI gets
``--allow-run-as-root`` when run as root and ``--oversubscribe``, and every ronde
variable is passed with ``-x``. Output is tagged with the rank by MPI itself.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from typing import Mapping, Sequence

from .._errors import ConfigError
from .hosts import HostSpec, is_local, ranks_wanted, resolve_hosts
from . import summary
from .rendezvous import RendezvousServer


def find_mpiexec() -> tuple[str, str]:
    """The launcher to use and its flavour ("hydra" or "openmpi")."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    for candidate in (here, shutil.which("mpiexec"), shutil.which("mpirun")):
        if candidate and os.access(candidate, os.X_OK):
            try:
                text = subprocess.run([candidate, "--version"], capture_output=True, text=True,
                                      timeout=20).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            return candidate, "openmpi" if "Open MPI" in text or "OpenRTE" in text else "hydra"
    raise ConfigError("ronderun --mpi needs mpiexec or mpirun on PATH: pip install "
                      "'ronde[mpi]' (mpi4py and MPICH from PyPI) or load your cluster's MPI")


def mpi_argv(mpiexec: str, flavour: str, np: int, hosts: list[HostSpec] | None,
             env: Mapping[str, str], command: Sequence[str]) -> list[str]:
    """The mpiexec command line for ``np`` ranks on ``hosts`` with ``env`` exported."""
    argv = [mpiexec]
    if flavour == "openmpi":
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        argv += ["--oversubscribe", "--tag-output", "-np", str(np)]
        if hosts:
            argv += ["-H", ",".join(f"{h.name}:{h.slots}" for h in hosts)]
        for name in env:
            argv += ["-x", name]
    else:
        argv += ["-n", str(np), "-prepend-rank"]
        if hosts:
            argv += ["-hosts", ",".join(f"{h.name}:{h.slots}" for h in hosts)]
        if env:  # by name: the values (the secret) stay out of the command line
            argv += ["-genvlist", ",".join(env)]
    return argv + list(command)


def run_mpi(command: Sequence[str], np: int | None, hosts: str | None, hostfile: str | None,
            settings: Mapping[str, str], start_timeout_s: float) -> int:
    """Run ``command`` under MPI; return its exit code."""
    specs = resolve_hosts(hosts, hostfile) if (hosts or hostfile) else None
    if np is None and not specs:
        raise ConfigError("ronderun --mpi needs -np (or -H/--hostfile)")
    np = ranks_wanted(specs or [], np)
    mpiexec, flavour = find_mpiexec()
    all_local = specs is None or all(is_local(h.name) for h in specs)
    secret = secrets.token_bytes(32)
    addr = "127.0.0.1"
    if not all_local and specs:
        from ..transport.net import route_address

        addr = route_address(next(h.name for h in specs if not is_local(h.name)))
    from ..transport.net import bind_for

    server = RendezvousServer(np, secret, host="127.0.0.1" if all_local else bind_for(addr),
                              start_timeout_s=start_timeout_s).start()
    job_id = f"ronde-mpi-{os.getpid()}-{secrets.token_hex(4)}"
    env = dict(settings)
    env.setdefault("RONDE_TRANSPORT", "mpi")
    env.update({"RONDE_RENDEZVOUS_ADDR": addr, "RONDE_RENDEZVOUS_PORT": str(server.port),
                "RONDE_SECRET": secret.hex(), "RONDE_JOB_ID": job_id,
                "RONDE_LAUNCHER": "ronderun", "RONDE_START_TIMEOUT": f"{start_timeout_s:g}",
                "PYTHONUNBUFFERED": "1"})
    argv = mpi_argv(mpiexec, flavour, np, specs, env, command)
    proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        return 130
    finally:
        server.close()
        from ..transport.segments import remove_job_segments

        remove_job_segments(job_id)
    if code != 0 and server.failures:
        first = min(summary.primary_reports(list(server.failures)),
                    key=lambda f: f.get("time", 0.0), default=None)
        if first is not None:
            sys.stderr.write(f"ronderun: rank {first.get('rank')} failed first:\n"
                             f"{first.get('message', '')}\n")
    return code if code >= 0 else 128 - code
