"""One worker process of a job, as the launcher holds it, and how remote ones start.

A :class:`Worker` is one rank's process: its command and environment, its output pumps,
its exit status, and its lifeline (a pipe the launcher holds and never writes, see
runner/lifeline.py). Local workers are started directly; remote ones through the remote
shell (``ssh`` by default, ``RONDE_REMOTE_SHELL``), with the job's secret on the remote
shell's standard input rather than on any command line (:func:`remote_worker`).
``launch._Job`` starts and stops them.
"""

from __future__ import annotations

import collections
import os
import shlex
import signal
import subprocess
import threading
import time
from typing import Mapping, Sequence

from .hosts import RankSlot
from .zygote import ZygoteProcess

DEFAULT_REMOTE_SHELL = "ssh -o BatchMode=yes -o StrictHostKeyChecking=no {host}"
#: stderr lines kept per rank for the failure summary.
TAIL_LINES = 50


class Worker:
    """One rank's process, its output pumps and its exit status."""

    def __init__(self, slot: RankSlot, argv: list[str], env: dict[str, str],
                 shown: list[str], stdin_line: str | None = None) -> None:
        self.slot = slot
        self.argv = argv
        self.env = env
        self.shown = shown  # the command as --verbose prints it
        #: a remote worker's first line of standard input (its secret: never in argv)
        self.stdin_line = stdin_line
        #: the launcher's end of the worker's lifeline (see ``_spawn``)
        self.lifeline: int | None = None
        #: the process: started by subprocess, or forked by a zygote (``zygote.py``)
        self.proc: subprocess.Popen[bytes] | ZygoteProcess | None = None
        self.returncode: int | None = None
        self.exit_time: float | None = None
        self.signalled = False  # the launcher asked it to stop
        #: when the launcher first signalled it (``time.monotonic()``), or None
        self.signalled_at: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.threads: list[threading.Thread] = []

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.returncode is None

    def killpg(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group; a SIGTERM is followed by SIGCONT,
        so that a stopped worker (SIGSTOP, a debugger's ^Z) takes it now, not at the
        SIGKILL a grace period later."""
        if self.proc is None:
            return
        if self.signalled and self.signalled_at is None:
            self.signalled_at = time.monotonic()
        try:
            os.killpg(self.proc.pid, sig)
            if sig == signal.SIGTERM:
                os.killpg(self.proc.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass


def _remote_argv(host: str, command: Sequence[str], variables: Mapping[str, str],
                 ssh_port: int | None, ssh_identity: str | None) -> list[str]:
    """The remote shell's command line for a remote worker. ``RONDE_SECRET`` is not in
    it (every user of either host could read it with ``ps``): the remote shell reads
    it from its standard input, where the launcher writes it (``_Worker.stdin_line``),
    and that input stays open as the worker's lifeline (``RONDE_LAUNCHER_FD=0``)."""
    template = os.environ.get("RONDE_REMOTE_SHELL")
    if not template:
        template = DEFAULT_REMOTE_SHELL
        if ssh_port is not None:
            template = template.replace(" {host}", f" -p {int(ssh_port)} {{host}}")
        if ssh_identity:
            template = template.replace(" {host}", f" -i {shlex.quote(ssh_identity)} {{host}}")
    public = {k: v for k, v in variables.items() if k != "RONDE_SECRET"}
    public["RONDE_LAUNCHER_FD"] = "0"
    assigns = " ".join(shlex.quote(f"{k}={v}") for k, v in public.items())
    remote = (f"cd {shlex.quote(os.getcwd())} && IFS= read -r RONDE_SECRET && "
              f"export RONDE_SECRET && exec env {assigns} {shlex.join(command)}")
    return [*shlex.split(template.replace("{host}", host)), remote]


def remote_worker(slot: RankSlot, host: str, command: Sequence[str],
                  variables: Mapping[str, str], ssh_port: int | None,
                  ssh_identity: str | None) -> Worker:
    """A worker started through the remote shell, its secret sent on standard input."""
    argv = _remote_argv(host, command, variables, ssh_port, ssh_identity)
    return Worker(slot, argv, dict(os.environ), argv, stdin_line=variables["RONDE_SECRET"])


