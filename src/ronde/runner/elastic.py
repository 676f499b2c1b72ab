"""Elastic jobs in the launcher: hosts that come and go, workers that fail, ranks re-dealt.

``ronderun --min-np A [--max-np B] (--host-discovery-script S | -H ... | --hostfile F)``
runs an elastic job (Horovod's elastic driver, see docs/elastic.md):

* **Hosts** come from the discovery script (run about once a second; each output line
  is ``host`` or ``host:slots``, ``--slots-per-host`` when no count is given), or from
  the fixed host list. Hosts keep the order in which they were first seen.
* **Assignment**: a generation's ranks are *slots* (host, local slot). Hosts that hold
  a surviving worker come first, and on each host the survivors first, in their old
  order, so rank 0 is always a survivor and ``sync()`` copies the state from one; new
  slots fill in up to ``--max-np``. Only new slots get a new process.
* **Rendezvous** (:class:`ElasticRendezvous`): a worker registers its slot (``init()``
  after a reset does it again); when every slot of the generation has registered, each
  gets its rank, the size and the peer table. A registered slot that is no longer in
  the job is told so (the worker ends with code 0).
* **A failed worker** (non-zero exit) has its host blacklisted (for a time drawn from
  ``--blacklist-cooldown-range``, else for good), unless that would leave fewer than
  ``--min-np`` slots: then only its slot is left out. The survivors, which saw the
  peer's loss as ``HorovodInternalError``, are re-formed without it; ``--reset-limit``
  bounds how often. Fewer than ``--min-np`` slots left: the driver waits up to
  ``--elastic-timeout`` for discovery to find more, then fails the job.
* **Hosts changed** (discovery): new slots are started, and the workers are told (a
  notice with a timestamp); they raise ``HostsUpdatedInterrupt`` together at their next
  ``commit()`` and re-form.
* **Hung workers**: when some workers of a generation registered and others have not
  within ``--start-timeout`` (a stalled rank), the missing ones are stopped and count as
  failed.
* **The end**: the job is over when no worker is left. It succeeded when the workers of
  the last generation exited with 0. Once one of them exits 0 the job no longer
  re-forms: a rank that returns early makes the others' pending collectives fail with
  an error naming it (horovod#3852: no silent stop, no hang).
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from typing import IO, Any, Mapping, Sequence

from .._config import setting
from .._errors import ConfigError
from ..transport.net import bind_for, route_address
from .elastic_driver import (Blacklist, Discovery, ElasticDriver, elastic_worker_vars,
                             parse_cooldown)
from .elastic_rendezvous import ElasticRendezvous, Slot
from .hosts import RankSlot, is_local, resolve_hosts
from .launch import SETTLE_S, LaunchResult, _Job
from .workers import Worker as _Worker, remote_worker
from .summary import failure_lines, reported_cause

__all__ = ["ElasticJob", "parse_cooldown", "run_elastic"]


class ElasticJob(_Job):
    """``launch._Job`` with a changing set of workers, driven by :class:`ElasticDriver`.
    Workers are numbered in the order they start (the ``[N]`` of their output lines)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__([], *args, **kwargs)
        self.failed_workers: list[Any] = []
        self.driver: ElasticDriver | None = None

    def run(self) -> LaunchResult:
        assert self.driver is not None
        restore = self._catch_signals()
        reason = ""
        start = time.monotonic()
        running: list[int] = []
        try:
            try:
                self.driver.start()
            except ConfigError as exc:
                self.driver.fatal = str(exc)
                reason = "failure"
            while not reason:
                self._record(0.1)
                if self.signals:
                    reason = "signal"
                elif self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                    reason = "timeout"
                else:
                    reason = self.driver.step()
            if reason == "failure":
                settle = time.monotonic() + SETTLE_S
                while any(w.alive for w in self.workers) and time.monotonic() < settle:
                    self._record(0.05)
            running = [w.slot.rank for w in self.workers if w.alive]
            if reason != "done":
                self._stop_all()
        finally:
            self._kill_all()
            for num, old in restore.items():
                signal.signal(num, old)
        for w in self.workers:
            for t in w.threads:
                t.join(timeout=2.0)
        if reason == "failure":
            return self._failed(running)
        return self._result(reason, running)

    def _failed(self, running: list[int]) -> LaunchResult:
        codes = [w.returncode for w in self.workers]
        failed = [w for w in self.workers if w.returncode not in (None, 0)
                  and not w.signalled] or self.failed_workers
        first, message = self._cause()
        reported = first is not None  # then its line leads: the driver's follows from it
        if first is None and failed:
            first = min(failed, key=lambda w: w.exit_time or 0.0)
        if first is not None:
            code, cause, lines = failure_lines(first, message, self.workers)
        else:
            first, code, cause, lines = None, 1, "", []
        fatal = self.driver.fatal if self.driver else ""
        if fatal:
            cause = fatal if not cause else f"{cause}; {fatal}" if reported else \
                f"{fatal}; {cause}"
            at = 1 if reported else 0
            lines = [*lines[:at], f"ronderun: {fatal}", *lines[at:]]
        return self._finish(LaunchResult(code, first.slot.rank if first else None, codes,
                                         cause), lines)

    def _cause(self) -> tuple[Any | None, str]:
        """The worker that ended the newest generation by its ranks' reports (a primary
        failure, or the rank their errors name: one that left early or stopped
        answering), as :func:`~ronde.runner.summary.reported_cause` decides for a
        fixed job; ``(None, "")`` when no report decides."""
        assert self.driver is not None
        server = self.driver.server
        ranked = [self.driver.by_slot.get(s) for s in server.formed()]
        if not ranked or None in ranked:
            return None, ""
        reports = [f for f in list(server.failures) if f.get("time", 0.0) >= server.formed_at]
        return reported_cause(ranked, reports)


def run_elastic(command: Sequence[str], np: int | None, min_np: int, max_np: int | None,
                hosts: str | None = None, hostfile: str | None = None,
                discovery_script: str | None = None, slots_per_host: int = 1,
                elastic_timeout_s: float = 600.0, reset_limit: int | None = None,
                cooldown: tuple[float, float] | None = None,
                env: Mapping[str, str] | None = None, start_timeout_s: float = 30.0,
                output_dir: str | None = None, timeout_s: float | None = None,
                ssh_port: int | None = None, ssh_identity: str | None = None,
                stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> LaunchResult:
    """Run ``command`` as an elastic job (see the module docstring); what ``ronderun
    --min-np ...`` calls. Returns how the job ended, as ``launch.run`` does."""
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    command = list(command)
    if not command:
        raise ConfigError("no command given; write e.g. ronderun -np 2 --min-np 1 python train.py")
    if min_np < 1 or (max_np is not None and max_np < min_np):
        raise ConfigError(f"--min-np {min_np} / --max-np {max_np}: need 1 <= min <= max")
    if discovery_script is None and not (hosts or hostfile):
        hosts = f"localhost:{max(np or 0, max_np or 0, min_np)}"
    discovery = Discovery(None if discovery_script else resolve_hosts(hosts, hostfile),
                          discovery_script, slots_per_host)
    local_only = discovery_script is None and all(is_local(h.name)
                                                  for h in discovery.fixed or [])
    bind_env = str(setting("bind_addr") or "")  # checked: an address or a name that resolves
    remote = [h.name for h in discovery.fixed or [] if not is_local(h.name)]
    # the address the workers are told; with a discovery script the hosts are not known
    # yet: every interface (set RONDE_BIND_ADDR to narrow it)
    bind = "127.0.0.1" if local_only else (
        bind_env or (bind_for(route_address(remote[0])) if remote else "0.0.0.0"))
    secret = secrets.token_bytes(32)
    job_id = f"ronde-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        server = ElasticRendezvous(secret, host=bind, start_timeout_s=start_timeout_s)
    except OSError as exc:
        raise ConfigError(f"the rendezvous service cannot listen on {bind}: {exc.strerror}; "
                          "check --bind-addr / RONDE_BIND_ADDR") from None
    out_dir = os.fspath(output_dir) if output_dir else None
    try:
        server.start()

        def make_worker(wid: int, slot: Slot, where: RankSlot) -> _Worker:
            local = is_local(slot[0])
            advertise = "127.0.0.1" if local else (
                bind_env if bind_env and bind_env not in ("0.0.0.0", "::")
                else route_address(slot[0]))
            variables = elastic_worker_vars(
                slot, where, len(driver.assignment), (advertise, server.port), secret, job_id,
                elastic_timeout_s, start_timeout_s, reset_limit)
            variables["PYTHONUNBUFFERED"] = "1"
            variables.update(env or {})
            shown_slot = RankSlot(wid, slot[0], slot[1], where.local_size, where.cross_rank,
                                  where.cross_size)
            if out_dir is not None:
                os.makedirs(os.path.join(out_dir, f"rank.{wid}"), exist_ok=True)
            if local:
                return _Worker(shown_slot, command, {**os.environ, **variables}, command)
            return remote_worker(shown_slot, slot[0], command, variables, ssh_port,
                                 ssh_identity)

        job = ElasticJob(stdout, stderr, out_dir, timeout_s, server)
        driver = ElasticDriver(job, discovery, min_np, max_np, np, make_worker,
                               elastic_timeout_s, reset_limit, Blacklist(cooldown),
                               start_timeout_s)
        job.driver = driver
        return job.run()
    finally:
        discovery.close()
        server.close()
        from ..transport.segments import remove_job_segments

        remove_job_segments(job_id)
