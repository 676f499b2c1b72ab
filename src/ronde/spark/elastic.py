"""``ronde.spark.run_elastic``: an elastic job whose workers are Spark tasks.

Where it sits: the elastic driver of ``ronderun --min-np`` (``runner/elastic_driver.py``)
with Spark tasks for processes:

* **Slots** are the cluster's task slots now (``spark.default.parallelism``: the cores
  of the registered executors, which changes as executors come and go), named
  ``spark0``, ``spark1``, ... (logical hosts of one slot each). Spark places a task on
  any free core, so a slot is not a machine: each worker tells the rendezvous the
  machine it landed on (``RONDE_NODE``), and ranks on one machine share memory.
* **A worker** is one task of a one-task Spark job, submitted from a driver thread in
  its own job group; stopping it cancels the group (Spark kills the task's Python
  worker). The function is elastic itself (``@hvd.elastic.run``).
* **A failure**: the function raises (the task reports its traceback to the driver and
  ends its Python worker, so the peers see a lost peer and re-form at once), or the
  task's process or executor dies. As Spark retries a failed task, the slot gets a new
  worker (named ``spark<k>.<n>``) up to ``spark.task.maxFailures`` times (default 4);
  Spark's own retry of the task is not used (it returns at once).
* **The end**: when every worker of the last generation returned, the results in rank
  order; else ``RondeError`` with the driver's reason and the first failure's traceback.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Mapping

from .._errors import ConfigError, RondeError
from ..runner.elastic_driver import (Blacklist, ElasticDriver, drive, elastic_worker_vars,
                                    last_results)
from ..runner.elastic_rendezvous import ElasticRendezvous, Slot
from ..runner.hosts import HostSpec, RankSlot
from ..transport.net import bind_for
from .runner import seconds


class SparkDiscovery:
    """The slots of an elastic Spark job (see the module docstring)."""

    dynamic = True
    script = None
    #: a failed slot's host is blacklisted and the slot offered again under a new name
    replaces_failed = True

    def __init__(self, sc: Any, blacklist: Blacklist, max_failures: int,
                 max_slots: int | None) -> None:
        self.sc, self.blacklist = sc, blacklist
        self.max_failures, self.max_slots = max_failures, max_slots

    def find(self) -> list[HostSpec]:
        slots = int(self.sc.defaultParallelism)
        if self.max_slots is not None:
            slots = min(slots, self.max_slots)
        hosts = []
        for k in range(slots):
            for attempt in range(self.max_failures):
                name = f"spark{k}" if attempt == 0 else f"spark{k}.{attempt}"
                if not self.blacklist.blocked(name):
                    hosts.append(HostSpec(name, 1))
                    break
        return hosts


class _TaskWorker:
    """One elastic worker: a one-task Spark job run from a driver thread."""

    def __init__(self, slot: RankSlot, env: dict[str, str], group: str) -> None:
        self.slot, self.env, self.group = slot, env, group
        self.started = False
        self.returncode: int | None = None
        self.exit_time: float | None = None
        self.signalled = False
        self.result: Any = None
        self.error: str | None = None
        self.threads: list[threading.Thread] = []
        self.sc: Any = None

    @property
    def alive(self) -> bool:
        return self.started and self.returncode is None

    def killpg(self, sig: int) -> None:
        if self.sc is not None and self.alive:
            self.sc.cancelJobGroup(self.group)


class SparkElasticJob:
    """What :class:`~ronde.runner.elastic_driver.ElasticDriver` drives, on Spark tasks."""

    name = "ronde.spark"

    def __init__(self, sc: Any, task: Callable[..., Any], server: ElasticRendezvous,
                 stderr: Any) -> None:
        self.sc, self.task, self.server, self.stderr = sc, task, server, stderr
        self.workers: list[_TaskWorker] = []
        self.failed_workers: list[_TaskWorker] = []
        self.signals: list[int] = []
        self.out_lock = threading.Lock()

    def _spawn(self, w: _TaskWorker) -> None:
        w.sc, w.started = self.sc, True
        slot_name = w.elastic_slot[0]  # type: ignore[attr-defined]
        task, env = self.task, w.env  # what the task's closure carries (never w: its sc)

        def one_task(_: Any) -> Any:
            yield task(env, slot_name)

        def run() -> None:
            try:
                self.sc.setJobGroup(w.group, f"ronde elastic worker {slot_name}",
                                    interruptOnCancel=True)
                rows = self.sc.parallelize([0], 1).mapPartitions(one_task).collect()
                kind, value = rows[0]
                if kind == "ok":
                    w.result, w.returncode = value, 0
                else:  # Spark retried a task ronde had given up: count it as failed
                    w.error, w.returncode = str(value), 1
            except Exception as exc:  # noqa: BLE001 - the task or its executor died
                w.error = self.server.reported_error((slot_name, 0)) or str(exc)[-4000:]
                w.returncode = -15 if w.signalled else 1
            w.exit_time = time.monotonic()

        t = threading.Thread(target=run, name=f"ronde-spark-{slot_name}", daemon=True)
        w.threads.append(t)
        t.start()

    def run(self, driver: ElasticDriver) -> list[Any]:
        try:
            reason = drive(driver, time.sleep)
        finally:
            for w in self.workers:
                if w.alive:
                    w.signalled = True
                    w.killpg(15)
            for w in self.workers:
                for t in w.threads:
                    t.join(timeout=10)
        if reason == "done":
            return last_results(self.workers, self.server)
        failed = sorted((w for w in self.workers if w.error is not None and not w.signalled),
                        key=lambda w: w.exit_time or 0.0)
        first = (f"; the first failure, worker {failed[0].slot.rank} "
                 f"({failed[0].elastic_slot[0]}):\n{failed[0].error}"  # type: ignore
                 if failed else "")
        raise RondeError(f"ronde.spark.run_elastic: {driver.fatal or 'the job failed'}{first}")


def run_elastic(fn: Callable[..., Any], args: tuple[Any, ...] = (),
                kwargs: Mapping[str, Any] | None = None, num_proc: int | None = None,
                min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: Mapping[str, str] | None = None,
                stdout: Any = None, stderr: Any = None, verbose: int = 1, nics: Any = None,
                prefix_output_with_timestamp: bool = False, min_np: int | None = None,
                max_np: int | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job on Spark tasks (Horovod's
    ``horovod.spark.run_elastic``; see the module docstring); the last generation's
    results in rank order.

    Args:
        fn: the training function; it calls ``init()`` and runs an
            ``@hvd.elastic.run`` function.
        num_proc: ranks to aim for (default: the cluster's task slots).
        min_num_proc: fewer ranks than this and the job waits (default ``num_proc``).
        max_num_proc: never more ranks than this (default: no limit).
        start_timeout: seconds the ranks may take to meet (default 30).
        elastic_timeout: seconds the job may wait below ``min_num_proc`` (default
            ``RONDE_ELASTIC_TIMEOUT``, else 600).
        reset_limit: the most re-formations (default: no limit).
        env: variables set in every task before ``fn`` runs.
        stdout, stderr, verbose, nics, prefix_output_with_timestamp: Horovod's; the
            tasks' output goes to Spark's executor logs. ``min_np``/``max_np``: the
            deprecated spellings of ``min_num_proc``/``max_num_proc``.
    """
    from .runner import _spark_context

    sc = _spark_context()
    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    num_proc = int(sc.defaultParallelism) if num_proc is None else int(num_proc)
    min_n = int(min_num_proc if min_num_proc is not None else num_proc)
    if min_n < 1 or (max_num_proc is not None and max_num_proc < min_n):
        raise ConfigError(f"ronde.spark.run_elastic: min_num_proc={min_n}, max_num_proc="
                          f"{max_num_proc}: need 1 <= min <= max")
    timeout = seconds(start_timeout, "start_timeout_s", "HOROVOD_SPARK_START_TIMEOUT", 30.0)
    wait_s = seconds(elastic_timeout, "elastic_timeout_s", "HOROVOD_ELASTIC_TIMEOUT", 600.0)
    secret = secrets.token_bytes(32)
    job_id = f"ronde-spark-{secrets.token_hex(4)}"
    driver = sc.getConf().get("spark.driver.host") or socket.gethostname()
    server = ElasticRendezvous(secret, host=bind_for(driver), start_timeout_s=timeout).start()
    rdv = (driver, server.port)
    call = (fn, tuple(args), dict(kwargs or {}))
    extra = dict(env or {})

    def task(variables: dict[str, str], slot_name: str) -> tuple[str, Any]:
        return _run_task(call, variables, slot_name, rdv, secret)

    job = SparkElasticJob(sc, task, server, sys.stderr)
    blacklist = Blacklist()
    max_failures = int(sc.getConf().get("spark.task.maxFailures", "4") or 4)
    discovery = SparkDiscovery(sc, blacklist, max(1, max_failures), max_num_proc)

    def make_worker(wid: int, slot: Slot, where: RankSlot) -> _TaskWorker:
        variables = elastic_worker_vars(slot, where, len(driver.assignment), rdv, secret,
                                        job_id, wait_s, timeout, reset_limit)
        variables.update(extra)
        return _TaskWorker(RankSlot(wid, slot[0], slot[1], where.local_size, where.cross_rank,
                                    where.cross_size), variables, f"{job_id}-{wid}")

    driver = ElasticDriver(job, discovery, min_n, max_num_proc, num_proc, make_worker,
                           wait_s, reset_limit, blacklist, timeout)
    try:
        return job.run(driver)
    finally:
        server.close()


def _run_task(call: tuple[Any, ...], variables: dict[str, str], slot_name: str,
              rdv: tuple[str, int], secret: bytes) -> tuple[str, Any]:
    """In a Spark task: be the worker of ``slot_name`` (see the module docstring)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is not None and ctx.attemptNumber() > 0:
        return "retry", f"Spark retried the task of {slot_name}; ronde replaces it itself"
    saved = {k: os.environ.get(k) for k in [*variables, "RONDE_NODE"]}
    os.environ.update(variables)
    os.environ["RONDE_NODE"] = socket.gethostname()
    fn, args, kwargs = call
    from .. import _api

    try:
        try:
            result = fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
            result = None  # removed from the re-formed job: not a failure
    except BaseException:  # noqa: BLE001 - reported, then this worker ends as a lost peer
        text = traceback.format_exc()
        try:
            from ..runner.rendezvous import query

            query(rdv, secret, {"what": "failed", "host": slot_name, "slot": 0,
                                "error": text})
        finally:
            sys.stderr.write(text)
            sys.stderr.flush()
            os._exit(1)  # the peers see a lost peer and re-form; Spark sees the task fail
    try:
        _api.shutdown()
    finally:
        for k, v in saved.items():  # Spark reuses its Python workers
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return "ok", result
