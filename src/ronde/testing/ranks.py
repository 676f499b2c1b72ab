"""Run a function in N real worker processes: the test tier "real processes".

:func:`run_ranks` starts the function through :func:`ronde.runner.launch.run`,
exactly as ``ronderun`` would start a script, so the workers get the full worker
environment and rendezvous. It is public so users can test their own ronde code::

    def check_rank():
        import ronde
        ronde.init()
        return ronde.rank()

    def test_ranks():
        assert run_ranks(3, check_rank) == [0, 1, 2]

:func:`run_ranks_many` runs several such functions in one launch, one after the other
in the same workers: starting processes that import a framework is most of what a
launch costs, so a test module's scenarios share one.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import tempfile
from typing import Any, Callable, Mapping, Sequence

from ..runner import launch


#: the function to run, as ``module:qualname`` (read by ``ronde.testing._child``)
FN_VAR = "RONDE_TESTING_FN"
#: the directory with ``call.pkl`` and the per-rank results
DIR_VAR = "RONDE_TESTING_DIR"
#: modules the workers are forked with, imported once (``runner/zygote.py``): e.g.
#: ``RONDE_TESTING_PRELOAD=torch`` saves each torch rank its import
PRELOAD_VAR = "RONDE_TESTING_PRELOAD"


class RanksFailedError(AssertionError):
    """A rank started by :func:`run_ranks` failed (or the job timed out).

    Attributes:
        result: the launcher's :class:`~ronde.runner.launch.LaunchResult`.
        rank: the rank that failed first, or None (timeout, interrupt).
        rank_traceback: that rank's traceback text, or "".
    """

    def __init__(self, message: str, result: launch.LaunchResult, rank: int | None,
                 rank_traceback: str) -> None:
        super().__init__(message)
        self.result = result
        self.rank = rank
        self.rank_traceback = rank_traceback


def _fn_spec(fn: Callable[..., Any]) -> tuple[str, str | None]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"run_ranks needs a module-level function, got {fn!r}; define it at "
                        "the top level of an importable module")
    if module == "__main__":
        raise TypeError(f"run_ranks cannot import {qualname!r} from __main__ in the workers; "
                        "move it into an importable module")
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    return f"{module}:{qualname}", os.path.dirname(os.path.abspath(path)) if path else None


def run_ranks(n: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0,
              env: Mapping[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` in ``n`` worker processes and return their results.

    Args:
        n: number of ranks.
        fn: a module-level function (the workers import it by name).
        *args: positional arguments for ``fn`` (pickled).
        timeout_s: wall-clock limit for the whole job.
        env: extra environment variables for every worker.
        **kwargs: keyword arguments for ``fn`` (pickled).

    Returns:
        The return values of ``fn`` in rank order.

    Raises:
        RanksFailedError: if any rank raised or exited non-zero, or the job timed out;
            the message holds the launcher's summary and the failing rank's traceback.
        TypeError: if ``fn`` is not importable by name.
    """
    spec, fn_dir = _fn_spec(fn)
    return _launch(n, spec, [fn_dir] if fn_dir else [], args, kwargs, timeout_s, env)


def run_ranks_many(n: int, calls: Sequence[Callable[..., Any] | tuple[Any, ...]],
                   timeout_s: float = 60.0, env: Mapping[str, str] | None = None
                   ) -> list[list[Any]]:
    """Call several functions in one launch of ``n`` workers, in order on every rank.

    Args:
        n: number of ranks.
        calls: module-level functions, or ``(function, arg, ...)`` tuples.
        timeout_s: wall-clock limit for the whole job.
        env: extra environment variables for every worker.

    Returns:
        For each call, in order, the return values in rank order (what
        :func:`run_ranks` would return for it alone).

    Raises:
        RanksFailedError: as :func:`run_ranks`; the traceback names the function that
            raised (the ones after it did not run).
        TypeError: if a function is not importable by name.
    """
    specs, dirs = [], []
    for call in calls:
        fn, *args = call if isinstance(call, tuple) else (call,)
        spec, fn_dir = _fn_spec(fn)
        specs.append((spec, tuple(args)))
        if fn_dir:
            dirs.append(fn_dir)
    per_rank = _launch(n, f"{__name__}:_call_many", dirs, (specs,), {}, timeout_s, env)
    return [[results[k] for results in per_rank] for k in range(len(specs))]


def _call_many(specs: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
    """The worker side of :func:`run_ranks_many`."""
    return [resolve(spec)(*args) for spec, args in specs]


def resolve(spec: str) -> Callable[..., Any]:
    """Import ``module:qualname`` and return the object it names."""
    module_name, _, qualname = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _launch(n: int, spec: str, fn_dirs: list[str], args: tuple[Any, ...],
            kwargs: dict[str, Any], timeout_s: float, env: Mapping[str, str] | None
            ) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="ronde-ranks-") as workdir:
        with open(os.path.join(workdir, "call.pkl"), "wb") as f:
            pickle.dump((args, kwargs), f)
        paths = fn_dirs + [p if p else os.getcwd() for p in sys.path]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        extra = {
            FN_VAR: spec,
            DIR_VAR: workdir,
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        }
        preload = [m for m in os.environ.get(PRELOAD_VAR, "").split(",") if m]
        result = launch.run([sys.executable, "-m", "ronde.testing._child"], n,
                            env=env, extra_worker_env=extra, timeout_s=timeout_s,
                            start_timeout_s=min(30.0, timeout_s), preload=preload)
        if result.returncode != 0:
            rank = result.first_failed_rank
            tb = ""
            if rank is not None:
                try:
                    with open(os.path.join(workdir, f"rank.{rank}.err"), encoding="utf-8") as f:
                        tb = f.read()
                except OSError:
                    pass
            message = f"{n} ranks running {spec}: {result.summary or result.cause}"
            if tb:
                message += f"\n\ntraceback of rank {rank}:\n{tb.rstrip()}"
            raise RanksFailedError(message, result, rank, tb)
        out = []
        for rank in range(n):
            try:
                with open(os.path.join(workdir, f"rank.{rank}.pkl"), "rb") as f:
                    out.append(pickle.load(f))
            except OSError:
                raise RanksFailedError(
                    f"rank {rank} exited with code 0 but returned no result from {spec} "
                    "(did it call os._exit or sys.exit?)", result, rank, "") from None
        return out
