"""``RayExecutor``: start ronde workers as Ray actors and run functions on all of them.

Where it sits: the Ray counterpart of ``ronderun`` (``runner/launch.py``). The driver
process owns the rendezvous service and the job secret; the actors are the workers.
Results come back in rank order; a worker that raises makes the call raise at once
with that rank's error (the others' collectives fail too, since its ronde shuts down).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Callable, Sequence

from .._errors import ConfigError, RondeError
from ..transport.net import bind_for


@dataclasses.dataclass
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns (Horovod's settings object)."""

    timeout_s: int = 30
    placement_group_timeout_s: int = 100
    nics: Sequence[str] | None = None
    ssh_identity_file: str | None = None
    ssh_str: str | None = None


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("ronde.ray needs Ray: pip install 'ronde[ray]'") from None
    return ray


class RayExecutor:
    """Horovod's ``RayExecutor`` on ronde (see the package docstring).

    Args:
        settings: from :meth:`create_settings`.
        num_workers: number of ranks (or give ``num_hosts`` and ``num_workers_per_host``).
        num_hosts: place ``num_workers_per_host`` workers on each of this many nodes.
        num_workers_per_host: workers per node with ``num_hosts``.
        cpus_per_worker: CPUs reserved per worker.
        use_gpu: reserve GPUs (``gpus_per_worker``, default 1 with ``use_gpu``).
        gpus_per_worker: GPUs reserved per worker.
        min_workers, max_workers: an elastic job (``ronde/ray/elastic.py``): at least
            ``min_workers`` ranks, at most ``max_workers`` (default: every slot of the
            cluster); the workers are started by :meth:`run`, one per slot, and the job
            re-forms when nodes come and go or a worker fails.
        reset_limit: the most re-formations of an elastic job (default: no limit).
        cooldown_range: ``(lo, hi)`` seconds a failed node stays blacklisted (drawn
            uniformly; default: for good).
        elastic_timeout: seconds an elastic job may wait below ``min_workers``.
        override_discovery: Horovod's; the hosts are always the Ray nodes.
    """

    def __init__(self, settings: RaySettings | None = None, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1,
                 cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: int | None = None, min_workers: int | None = None,
                 max_workers: int | None = None, reset_limit: int | None = None,
                 cooldown_range: tuple[int, int] | None = None,
                 elastic_timeout: int = 600, override_discovery: bool = True) -> None:
        self.elastic = min_workers is not None or max_workers is not None
        if self.elastic:
            self.min_workers = int(min_workers if min_workers is not None else 1)
            self.max_workers = None if max_workers is None else int(max_workers)
            if self.min_workers < 1 or (self.max_workers is not None
                                        and self.max_workers < self.min_workers):
                raise ConfigError(f"RayExecutor: min_workers={min_workers}, max_workers="
                                  f"{max_workers}: need 1 <= min_workers <= max_workers")
            if num_hosts is not None:
                raise ConfigError("RayExecutor: num_hosts is not for an elastic executor "
                                  "(min_workers/max_workers): its hosts are the cluster's "
                                  "nodes")
            num_workers = num_workers or self.min_workers
        elif num_workers is None and num_hosts is None:
            raise ConfigError("RayExecutor needs num_workers (or num_hosts and "
                              "num_workers_per_host)")
        if num_workers is not None and num_hosts is not None:
            raise ConfigError("RayExecutor: give num_workers or num_hosts, not both")
        self.reset_limit = reset_limit
        self.cooldown_range = None if cooldown_range is None else \
            (float(cooldown_range[0]), float(cooldown_range[1]))
        self.elastic_timeout = elastic_timeout
        self.extra_env_vars: dict[str, str] = {}
        self._executable: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None
        self.settings = settings or RaySettings()
        self.num_hosts = num_hosts
        self.num_workers = num_workers if num_workers is not None \
            else int(num_hosts) * num_workers_per_host  # type: ignore[arg-type]
        if self.num_workers < 1:
            raise ConfigError(f"RayExecutor: num_workers must be >= 1, got {self.num_workers}")
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker if gpus_per_worker is not None \
            else (1 if use_gpu else 0)
        self.workers: list[Any] = []  # actors in rank order
        self._pg: Any = None
        self._server: Any = None
        #: the job's id, for its shared-memory segments left by killed workers
        self._job_id: str | None = None

    @staticmethod
    def create_settings(timeout_s: int = 30, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: int = 100,
                        nics: Sequence[str] | None = None) -> RaySettings:
        """Horovod's settings: ``timeout_s`` bounds start-up (the rendezvous),
        ``placement_group_timeout_s`` the wait for resources; ssh and NIC options are
        accepted and unused (Ray places the workers)."""
        return RaySettings(timeout_s, placement_group_timeout_s, nics, ssh_identity_file,
                           ssh_str)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, executable_cls: Any = None, executable_args: Sequence[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None,
              extra_env_vars: dict[str, str] | None = None) -> None:
        """Place the workers, deal the ranks, start the rendezvous; optionally build
        ``executable_cls(*args, **kwargs)`` in every worker (see :meth:`execute`). An
        elastic executor only records these: its workers start at each :meth:`run`."""
        ray = _ray()
        self.extra_env_vars = dict(extra_env_vars or {})
        if self.elastic:
            self._executable = (executable_cls, tuple(executable_args or ()),
                                dict(executable_kwargs or {}))
            return
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ..runner.env import worker_env_vars
        from ..runner.hosts import places
        from ..runner.rendezvous import RendezvousServer
        from ._actor import RondeWorker

        bundle = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        if self.num_hosts is not None:
            bundles = [{k: v * self.num_workers_per_host for k, v in bundle.items()}
                       for _ in range(self.num_hosts)]
            strategy = "STRICT_SPREAD"
        else:
            bundles, strategy = [dict(bundle) for _ in range(self.num_workers)], "PACK"
        self._pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.settings.placement_group_timeout_s)
        if not ready:
            self.shutdown()
            raise RondeError(
                f"RayExecutor: the cluster did not grant {len(bundles)} bundle(s) of {bundle}"
                f" within {self.settings.placement_group_timeout_s}s "
                "(placement_group_timeout_s); are there enough CPUs/GPUs?")
        actor_cls = ray.remote(RondeWorker)
        actors = []
        for i in range(self.num_workers):
            index = i // self.num_workers_per_host if self.num_hosts is not None else i
            actors.append(actor_cls.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=index)).remote())
        nodes = ray.get([a.node.remote() for a in actors])
        order: list[str] = []
        for node_id, _ in nodes:
            if node_id not in order:
                order.append(node_id)
        ranked = sorted(range(len(actors)), key=lambda i: (order.index(nodes[i][0]), i))
        self.workers = [actors[i] for i in ranked]
        placed = [nodes[i][0] for i in ranked]
        secret = secrets.token_bytes(32)
        driver_ip = ray.util.get_node_ip_address()
        self._server = RendezvousServer(self.num_workers, secret, host=bind_for(driver_ip),
                                        start_timeout_s=float(self.settings.timeout_s)).start()
        job_id = self._job_id = f"ronde-ray-{secrets.token_hex(4)}"
        calls = []
        for actor, where in zip(self.workers, places(placed)):
            variables = worker_env_vars(
                rank=where.rank, size=self.num_workers, local_rank=where.local_rank,
                local_size=where.local_size, cross_rank=where.cross_rank,
                cross_size=where.cross_size, host=where.host,
                rendezvous=(driver_ip, self._server.port), secret=secret, job_id=job_id)
            variables["RONDE_START_TIMEOUT"] = str(self.settings.timeout_s)
            variables.update(extra_env_vars or {})
            calls.append(actor.set_env.remote(variables))
        ray.get(calls)
        if executable_cls is not None:
            ray.get([w.start_executable.remote(executable_cls, tuple(executable_args or ()),
                                               dict(executable_kwargs or {}))
                     for w in self.workers])

    def shutdown(self) -> None:
        """Stop every worker and free their resources."""
        ray = _ray()
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._job_id is not None:  # what killed workers of this host left in /dev/shm
            from ..transport.segments import remove_job_segments

            remove_job_segments(self._job_id)
            self._job_id = None

    # -- running ---------------------------------------------------------------------------
    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; returns the Ray object refs (rank order)."""
        if self.elastic:
            from .._errors import UnsupportedError

            raise UnsupportedError("RayExecutor.run_remote: an elastic job's workers come "
                                   "and go; use run()")
        self._started()
        return [w.run.remote(fn, tuple(args or ()), dict(kwargs or {})) for w in self.workers]

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: dict[str, Any] | None = None, callbacks: Any = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order. The first
        worker to fail makes this raise with its error (``RondeError`` naming the rank,
        the worker's exception chained). Elastic: the job runs until the workers of its
        last generation return (``fn`` is an ``@hvd.elastic.run`` function or calls
        one); their results in rank order."""
        if self.elastic:
            from .elastic import run_elastic

            return run_elastic(self, fn, tuple(args or ()), dict(kwargs or {}))
        return self._gather(self.run_remote(fn, args, kwargs))

    def execute(self, fn: Callable[[Any], Any], callbacks: Any = None) -> list[Any]:
        """``fn(executable)`` on every worker (the object ``start`` built); rank order.
        Elastic: each worker builds its executable when it starts, then runs ``fn``."""
        if self.elastic:
            from .elastic import run_elastic

            return run_elastic(self, _with_executable, (fn, self._executable), {})
        self._started()
        return self._gather([w.execute.remote(fn) for w in self.workers])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        if self.elastic:
            from .._errors import UnsupportedError

            raise UnsupportedError("RayExecutor.execute_single: not for an elastic job "
                                   "(as Horovod); use execute()")
        self._started()
        return self._gather([self.workers[0].execute.remote(fn)])[0]

    def _started(self) -> None:
        if not self.workers:
            raise RondeError("RayExecutor: call start() first")

    def _gather(self, refs: list[Any]) -> list[Any]:
        ray = _ray()
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - a failure: find the first cause
                failures = [(rank_of[done[0]], exc)]
                if pending:  # the others fail right after, as a consequence: let them
                    more, _ = ray.wait(pending, num_returns=len(pending), timeout=2.0)
                    for ref in more:
                        try:
                            ray.get(ref)
                        except Exception as other:  # noqa: BLE001
                            failures.append((rank_of[ref], other))
                primary = [f for f in failures if not _secondary(f[1])] or failures
                rank, first = primary[0]
                raise RondeError(f"RayExecutor: rank {rank} failed: {_short(first)}") from first
        return ray.get(refs)


class ElasticRayExecutor:
    """Horovod's older elastic Ray API (deprecated there since 0.25), kept for scripts
    that use it: ``ElasticRayExecutor(ElasticRayExecutor.create_settings(min_num_proc=2),
    cpus_per_slot=1).start(); .run(worker_fn)``. It is a :class:`RayExecutor` with
    ``min_workers``/``max_workers``."""

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None,
                        reset_limit: int | None = None, elastic_timeout: int = 600,
                        timeout_s: int = 30, ssh_identity_file: str | None = None,
                        nics: Any = None, min_np: int | None = None,
                        max_np: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """The job's limits (``min_np``/``max_np`` are the deprecated spellings)."""
        return {"min": min_np if min_np is not None else min_num_proc,
                "max": max_np if max_np is not None else max_num_proc,
                "reset_limit": reset_limit, "elastic_timeout": elastic_timeout,
                "timeout_s": timeout_s}

    def __init__(self, settings: dict[str, Any], use_gpu: bool = False,
                 cpus_per_slot: int = 1, gpus_per_slot: int | None = None,
                 env_vars: dict[str, str] | None = None, override_discovery: bool = True
                 ) -> None:
        if gpus_per_slot and not use_gpu:
            raise ConfigError("ElasticRayExecutor: gpus_per_slot is set but use_gpu is False")
        self._executor = RayExecutor(
            RaySettings(timeout_s=settings["timeout_s"]), cpus_per_worker=cpus_per_slot,
            use_gpu=use_gpu, gpus_per_worker=gpus_per_slot, min_workers=settings["min"],
            max_workers=settings["max"], reset_limit=settings["reset_limit"],
            elastic_timeout=settings["elastic_timeout"])
        self._env = dict(env_vars or {})

    def start(self) -> None:
        self._executor.start(extra_env_vars=self._env)

    def run(self, worker_fn: Callable[[], Any], callbacks: Any = None) -> list[Any]:
        """``worker_fn()`` on every worker of the elastic job; the last generation's
        results in rank order."""
        return self._executor.run(worker_fn)

    def shutdown(self) -> None:
        self._executor.shutdown()


def _with_executable(fn: Callable[[Any], Any],
                     executable: tuple[Any, tuple[Any, ...], dict[str, Any]] | None) -> Any:
    cls, args, kwargs = executable or (None, (), {})
    return fn(cls(*args, **kwargs) if cls is not None else None)


def _secondary(exc: BaseException) -> bool:
    """A failure caused by another rank's (a lost peer, a peer that shut down)."""
    text = str(exc)
    return "ShutdownError" in text or "PeerLostError" in text


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    tail = [line for line in text if line.strip()][-1:] if text else [type(exc).__name__]
    return tail[0][:500]
