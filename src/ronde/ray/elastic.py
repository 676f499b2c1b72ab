"""Elastic training on Ray: ``RayExecutor(min_workers=..., max_workers=...)``.

Where it sits: the same elastic driver as ``ronderun --min-np`` (``runner/elastic.py``:
slots, survivors first, blacklist, ``--min-np`` waits, reset limit, host notices) with
Ray actors for processes:

* **Hosts** are the cluster's alive nodes (``ray.nodes()``, asked about once a second),
  named by the first 12 hex digits of their node id; a node's slots are its CPUs divided by ``cpus_per_worker`` (and, with
  ``use_gpu``, no more than its GPUs divided by ``gpus_per_worker``), as Horovod's
  ``RayHostDiscovery``.
* **A worker** is one actor pinned to its node (``NodeAffinitySchedulingStrategy``,
  hard), running the training function once; the function is elastic itself
  (``@hvd.elastic.run``), so a reset happens inside the actor.
* **A failure**: the function raises (the actor is then killed, so its peers see a lost
  peer and re-form at once), or the actor or its node dies. The node is blacklisted as
  a failed host would be; the survivors re-form without it.
* **The end**: when every worker of the last generation has returned, ``run`` returns
  their results in rank order; when the job cannot go on (every node failed, fewer than
  ``min_workers`` for ``elastic_timeout`` seconds, the reset limit), ``run`` raises with
  the driver's reason and the first worker's error chained.
"""

from __future__ import annotations

import math
import secrets
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from .._errors import RondeError
from ..runner.elastic_driver import (Blacklist, ElasticDriver, drive, elastic_worker_vars,
                                    last_results)
from ..runner.elastic_rendezvous import ElasticRendezvous, Slot
from ..runner.hosts import HostSpec, RankSlot
from ..transport.net import bind_for

if TYPE_CHECKING:
    from .executor import RayExecutor


class RayDiscovery:
    """The hosts of an elastic Ray job: the alive nodes and their slots."""

    dynamic = True
    script = None

    def __init__(self, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 use_gpu: bool = False) -> None:
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.use_gpu = use_gpu
        #: short name -> the node's full id
        self.node_of: dict[str, str] = {}

    def find(self) -> list[HostSpec]:
        import ray

        hosts = []
        for node in ray.nodes():
            if not node.get("Alive", node.get("alive")):
                continue
            res = node.get("Resources", {})
            slots = res.get("CPU", 0) // self.cpus_per_worker if self.cpus_per_worker \
                else math.inf
            if self.use_gpu and self.gpus_per_worker:
                slots = min(slots, res.get("GPU", 0) // self.gpus_per_worker)
            if slots and slots != math.inf:
                name = str(node["NodeID"])[:12]
                self.node_of[name] = str(node["NodeID"])
                hosts.append(HostSpec(name, int(slots)))
        return hosts


class _ActorWorker:
    """One elastic worker: a Ray actor on its node, running the function once."""

    def __init__(self, slot: RankSlot, env: dict[str, str]) -> None:
        self.slot, self.env = slot, env
        self.actor: Any = None
        self.ref: Any = None
        self.returncode: int | None = None
        self.exit_time: float | None = None
        self.signalled = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.threads: list[threading.Thread] = []

    @property
    def alive(self) -> bool:
        return self.ref is not None and self.returncode is None

    def killpg(self, sig: int) -> None:
        if self.actor is not None:
            import ray

            try:
                ray.kill(self.actor)
            except Exception:  # noqa: BLE001 - already gone
                pass


class RayElasticJob:
    """What :class:`~ronde.runner.elastic.ElasticDriver` drives, on Ray actors."""

    name = "RayExecutor"

    def __init__(self, executor: RayExecutor, call: Callable[[Any], Any],
                 server: ElasticRendezvous,
                 stderr: Any, discovery: RayDiscovery) -> None:
        self.executor, self.call, self.server, self.stderr = executor, call, server, stderr
        self.discovery = discovery
        self.workers: list[_ActorWorker] = []
        self.failed_workers: list[_ActorWorker] = []
        self.signals: list[int] = []
        self.out_lock = threading.Lock()

    def _spawn(self, w: _ActorWorker) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ._actor import RondeWorker

        ex = self.executor
        node_id = self.discovery.node_of[w.elastic_slot[0]]  # type: ignore[attr-defined]
        w.actor = ray.remote(RondeWorker).options(
            num_cpus=ex.cpus_per_worker, num_gpus=ex.gpus_per_worker,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        w.actor.set_env.remote(w.env)
        w.ref = w.actor.run_elastic.remote(self.call)

    def poll(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for workers to finish; record how each ended."""
        import ray

        running = {w.ref: w for w in self.workers if w.alive}
        if not running:
            time.sleep(timeout_s)
            return
        done, _ = ray.wait(list(running), num_returns=len(running), timeout=timeout_s)
        for ref in done:
            w = running[ref]
            try:
                w.result = ray.get(ref)
                w.returncode = 0
            except ray.exceptions.RayTaskError as exc:  # the function raised
                w.error, w.returncode = exc, 1
                w.killpg(9)  # its peers see a lost peer now, not at the driver's leisure
            except Exception as exc:  # noqa: BLE001 - the actor or its node died
                w.error, w.returncode = exc, -9
            w.exit_time = time.monotonic()

    def run(self, driver: ElasticDriver) -> list[Any]:
        try:
            reason = drive(driver, self.poll)
        finally:
            for w in self.workers:
                w.killpg(9)
        if reason == "done":
            return last_results(self.workers, self.server)
        failed = sorted((w for w in self.failed_workers + self.workers
                         if w.error is not None and not w.signalled),
                        key=lambda w: w.exit_time or 0.0)
        cause = failed[0].error if failed else None
        where = (f"; the first failure: worker {failed[0].slot.rank} on node "
                 f"{failed[0].elastic_slot[0]}: {_last_line(cause)}"  # type: ignore
                 if failed else "")
        raise RondeError(f"RayExecutor (elastic): {driver.fatal or 'the job failed'}{where}"
                         ) from cause


def run_elastic(executor: RayExecutor, fn: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job of ``executor``'s settings (what
    :meth:`RayExecutor.run` does with ``min_workers``); the last generation's results in
    rank order."""
    import ray

    secret = secrets.token_bytes(32)
    job_id = f"ronde-ray-{secrets.token_hex(4)}"
    start_timeout = float(executor.settings.timeout_s)
    driver_ip = ray.util.get_node_ip_address()
    server = ElasticRendezvous(secret, host=bind_for(driver_ip),
                               start_timeout_s=start_timeout).start()
    rdv = (driver_ip, server.port)
    call = _Call(fn, args, kwargs)
    discovery = RayDiscovery(executor.cpus_per_worker, executor.gpus_per_worker,
                             executor.gpus_per_worker > 0)
    job = RayElasticJob(executor, call, server, sys.stderr, discovery)

    def make_worker(wid: int, slot: Slot, where: RankSlot) -> _ActorWorker:
        env = elastic_worker_vars(slot, where, len(driver.assignment), rdv, secret, job_id,
                                  executor.elastic_timeout, start_timeout,
                                  executor.reset_limit)
        env.update(executor.extra_env_vars)
        return _ActorWorker(RankSlot(wid, slot[0], slot[1], where.local_size,
                                     where.cross_rank, where.cross_size), env)

    driver = ElasticDriver(job, discovery, executor.min_workers, executor.max_workers, None,
                           make_worker, float(executor.elastic_timeout),
                           executor.reset_limit, Blacklist(executor.cooldown_range),
                           start_timeout)
    try:
        return job.run(driver)
    finally:
        server.close()


class _Call:
    """``fn(*args, **kwargs)`` as one picklable callable for the actors."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __call__(self) -> Any:
        return self.fn(*self.args, **self.kwargs)


def _last_line(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:500]


__all__ = ["RayDiscovery", "RayElasticJob", "run_elastic"]
