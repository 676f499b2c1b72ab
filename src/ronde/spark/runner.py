"""``ronde.spark.run``: a function on N Spark tasks as N ronde ranks.

Where it sits: the Spark counterpart of ``ronderun`` (``runner/launch.py``). The
driver owns the rendezvous service and the job secret (it travels inside the pickled
task, not in the environment of the Spark processes or a log). Each task of one barrier
stage learns its rank from its partition id and the hosts of all tasks from the barrier
context, sets the worker contract's variables and calls ``fn``. A task whose ``fn``
raises shuts ronde down (the others' collectives fail at once, naming it) and returns
its traceback instead of failing the stage, so Spark neither retries the stage nor
leaves tasks waiting; ``run`` then raises with that rank's traceback.
"""

from __future__ import annotations

import os
import secrets
import socket
import traceback
from typing import Any, Callable, Mapping

from .._errors import ConfigError, RondeError
from ..transport.net import bind_for


def _spark_context() -> Any:
    try:
        from pyspark import SparkContext
    except ImportError:
        raise ImportError("ronde.spark needs pyspark: pip install 'ronde[spark]'") from None
    sc = SparkContext._active_spark_context
    if sc is None:
        raise RondeError("ronde.spark.run needs an active SparkSession (create one with "
                         "SparkSession.builder...getOrCreate() first)")
    return sc


def seconds(given: float | None, field: str, spark_name: str, default: float) -> float:
    """A time limit: the argument, else the knob's variables (range-checked as ``init()``
    checks them: NaN, infinities and absurd values are a ConfigError naming the variable),
    else Horovod's Spark spelling ``spark_name``, else ``default``."""
    from .._config import setting

    if given is not None:
        value = float(given)
        if not 0 < value < float("inf"):
            raise ConfigError(f"{field.removesuffix('_s')}={given!r}: give seconds > 0")
        return value
    found = setting(field)
    if found is None and os.environ.get(spark_name):
        found = setting(field, {"RONDE_" + spark_name.removeprefix("HOROVOD_"):
                                os.environ[spark_name]})
    return default if found is None else float(found)  # type: ignore[arg-type]


def run(fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: float | None = None,
        env: Mapping[str, str] | None = None, stdout: Any = None, stderr: Any = None,
        verbose: int = 1) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks; the results in rank order.

    Args:
        fn: the training function; it calls ``ronde.init()`` (or a binding's).
        num_proc: ranks (default: ``spark.default.parallelism``, the cluster's slots).
            More than the cluster's slots is refused at once (Spark itself would retry
            the barrier check for minutes).
        start_timeout: seconds the ranks may take to meet (default
            ``RONDE_START_TIMEOUT``, else 30; ``HOROVOD_SPARK_START_TIMEOUT`` too).
        env: variables set in every task before ``fn`` runs.
        stdout, stderr, verbose: Horovod's; the tasks' output goes to Spark's executor
            logs, as there.

    Raises:
        RondeError: a rank failed (its traceback in the message), or too many ranks.
    """
    sc = _spark_context()
    slots = int(sc.defaultParallelism)
    num_proc = slots if num_proc is None else int(num_proc)
    if num_proc < 1:
        raise ConfigError(f"ronde.spark.run: num_proc must be >= 1, got {num_proc}")
    if num_proc > slots:
        raise RondeError(f"ronde.spark.run: num_proc={num_proc} but this Spark cluster has "
                         f"{slots} task slots (spark.default.parallelism): a barrier stage "
                         "needs them all at once; lower num_proc or add executors")
    timeout = seconds(start_timeout, "start_timeout_s", "HOROVOD_SPARK_START_TIMEOUT", 30.0)
    from ..runner.rendezvous import RendezvousServer

    secret = secrets.token_bytes(32)
    driver = sc.getConf().get("spark.driver.host") or socket.gethostname()
    server = RendezvousServer(num_proc, secret, host=bind_for(driver),
                              start_timeout_s=timeout).start()
    job_id = f"ronde-spark-{secrets.token_hex(4)}"
    call = (fn, tuple(args), dict(kwargs or {}))
    extra = dict(env or {})
    rdv = (driver, server.port)

    def task(_: Any) -> Any:
        yield _run_task(call, rdv, secret, job_id, timeout, extra)

    try:
        rows = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task).collect()
    except Exception as exc:  # a task's process died, or Spark gave up
        raise RondeError(f"ronde.spark.run: the Spark stage failed: "
                         f"{str(exc).strip()[-2000:]}") from exc
    finally:
        server.close()
    rows = sorted(rows, key=lambda row: row[0])
    failed = [row for row in rows if row[1] == "error"]
    if failed:
        primary = [row for row in failed if not _secondary(row[2])] or failed
        rank, _, text = primary[0]
        raise RondeError(f"ronde.spark.run: rank {rank} failed:\n{text}")
    return [row[2] for row in rows]


def _secondary(text: str) -> bool:
    return "ShutdownError" in text or "PeerLostError" in text


def _run_task(call: tuple[Any, ...], rdv: tuple[str, int], secret: bytes, job_id: str,
              timeout: float, extra: dict[str, str]) -> tuple[int, str, Any]:
    """In a Spark task: take this rank's place, run the function, report its outcome."""
    from pyspark import BarrierTaskContext

    from ..runner.env import worker_env_vars
    from ..runner.hosts import places

    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
    where = places(hosts)[rank]
    variables = worker_env_vars(
        rank=rank, size=len(hosts), local_rank=where.local_rank, local_size=where.local_size,
        cross_rank=where.cross_rank, cross_size=where.cross_size, host=where.host,
        rendezvous=rdv, secret=secret, job_id=job_id)
    variables["RONDE_START_TIMEOUT"] = f"{timeout:g}"
    variables.update(extra)
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    fn, args, kwargs = call
    from .. import _api

    try:
        return rank, "ok", fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - reported to the driver, never retried
        return rank, "error", traceback.format_exc()
    finally:
        # a failing rank's shutdown makes the others' pending collectives fail now,
        # naming it; and Spark reuses its Python workers: leave no ronde, no variables
        try:
            _api.shutdown()
        except Exception:  # noqa: BLE001
            pass
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
