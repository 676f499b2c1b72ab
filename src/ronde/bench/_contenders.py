"""The contenders and how one job of each is launched.

A contender is one library configuration measured by the same worker loop: ronde over
one transport, started through ``ronderun -np N --transport T``, or a peer library:
``gloo`` (started by :mod:`ronde.bench._gloo`), ``mpich`` or ``openmpi`` (mpi4py in a
venv of its own, started by :mod:`ronde.bench._mpi`). :meth:`Contender.run` runs one
job and returns rank 0's summary, or raises :class:`JobFailedError`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .._private_files import private_dir
from ._gloo import launch_gloo, torch_available
from ._mpi import MPI_PEERS, default_cache_dir, ensure_venv, launch_mpi
from ._timing import Settings
from ._worker import worker_argv

#: ronde configurations: a transport, or ``shm+timeline`` (shm with the timeline on, to
#: measure its cost); ``gloo`` and ``mpi`` put ronde's engine over those engines, so
#: they show the overhead ronde adds to the raw peers measured beside them
TRANSPORTS = ("shm", "tcp", "gloo", "mpi", "shm+timeline")
PEERS = ("gloo", "mpich", "openmpi")


class JobFailedError(RuntimeError):
    """A contender's job exited non-zero or wrote no result."""


def ronderun_command() -> list[str]:
    """``ronderun`` next to this interpreter, else ``python -m ronde.run`` (the same CLI)."""
    script = Path(sys.executable).parent / "ronderun"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ronde.run"]


@dataclass(frozen=True)
class Contender:
    """One column of the results: ``kind`` is ``"ronde"`` or a peer name."""

    kind: str
    transport: str  # ronde transport, or the peer's name
    venv: str | None = None  # the MPI peers' virtual environment

    @property
    def is_mpi(self) -> bool:
        """True for the MPI peers."""
        return self.kind in MPI_PEERS

    @property
    def impl(self) -> str:
        """The label in JSON lines: ``ronde-shm``, ``ronde-tcp``, ``gloo``, ``mpich``..."""
        return f"ronde-{self.transport}" if self.kind == "ronde" else self.kind

    @property
    def short(self) -> str:
        """The label in table headers and ratios: ``shm``, ``tcp``, ``gloo``...

        ronde over Gloo or MPI is ``ronde-gloo``/``ronde-mpi``, so that it cannot be
        mistaken for the raw peer measured beside it."""
        if self.kind == "ronde" and self.transport in ("gloo", "mpi"):
            return f"ronde-{self.transport}"
        return self.transport

    def command(self, np_: int, flags: Sequence[str], timeout_s: float) -> list[str]:
        """The ronde job's command line (peers are started by their own launcher)."""
        how = ["--transport", self.transport]
        if self.transport == "mpi":
            how = ["--mpi"]
        elif self.transport == "shm+timeline":
            tl = Path(private_dir()) / "bench-timeline-{rank}.json"
            how = ["--transport", "shm", "--timeline-filename", str(tl)]
        return [*ronderun_command(), "-np", str(np_), *how,
                "--timeout", str(int(timeout_s)), sys.executable, "-m", "ronde.bench._worker",
                *flags]

    def run(self, np_: int, cases: Sequence[str], sizes: Sequence[int], settings: Settings,
            timeout_s: float, coll_sizes: Sequence[int] | None = None) -> dict[str, Any]:
        """Run one job of ``np_`` ranks; rank 0's summary (see ``_worker.write_result``)."""
        with tempfile.TemporaryDirectory(prefix="ronde-bench-") as tmp:
            out = Path(tmp) / "result.json"
            flags = worker_argv(cases, sizes, settings, out, coll_sizes)
            if self.is_mpi and self.venv is not None:
                rc, log = launch_mpi(self.kind, Path(self.venv), np_, flags, timeout_s)
            elif self.kind == "ronde":
                cmd = self.command(np_, flags, timeout_s)
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, timeout=timeout_s + 30)
                rc, log = proc.returncode, proc.stdout[-3000:]
            else:
                rc, log = launch_gloo(np_, flags, timeout_s)
            if rc != 0 or not out.exists():
                raise JobFailedError(f"{self.impl} job failed (exit code {rc}):\n{log}")
            doc: dict[str, Any] = json.loads(out.read_text())
            if self.transport == "shm+timeline":
                for leftover in Path(private_dir()).glob("bench-timeline-*.json"):
                    leftover.unlink()
        expected = "ronde-shm" if self.transport == "shm+timeline" else self.impl
        if self.kind == "ronde" and doc.get("impl") != expected:
            raise JobFailedError(f"asked for {self.impl} but the job ran {doc.get('impl')}; "
                                 "check RONDE_TRANSPORT and the transport's requirements")
        return doc


def select_contenders(transports: Sequence[str], peers: Sequence[str],
                      cache_dir: Path | None = None) -> list[Contender]:
    """The contenders to run, in column order; peers that cannot run are skipped with a note.

    The MPI peers' venvs are created here, on first use, under ``cache_dir``.
    """
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad:
        raise ValueError(f"unknown transport(s) {', '.join(bad)}; choose from "
                         f"{', '.join(TRANSPORTS)}")
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ValueError(f"unknown peer(s) {', '.join(bad)}; choose from {', '.join(PEERS)} "
                         "or 'none'")
    chosen = [Contender("ronde", t) for t in transports]
    for peer in peers:
        if peer == "gloo" and not torch_available():
            print("note: torch is not installed, skipping the gloo peer "
                  "(pip install 'torch==2.13.0' to compare against it)", file=sys.stderr)
            continue
        if peer in MPI_PEERS:
            venv = ensure_venv(peer, cache_dir or default_cache_dir())
            if venv is not None:
                chosen.append(Contender(peer, peer, str(venv)))
            continue
        chosen.append(Contender(peer, peer))
    return chosen
