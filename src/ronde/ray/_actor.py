"""The Ray actor behind each ronde worker of a :class:`~ronde.ray.RayExecutor`.

One actor per rank, placed by the executor's placement group. The executor gives it
its place in the job (the ``RONDE_*`` variables of the worker contract, the job secret
among them: passed as an actor method argument, never logged) and then runs functions
in it. A function that raises shuts ronde down in that process first, so that the
other ranks' pending collectives fail at once (naming this rank) instead of waiting.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable


class RondeWorker:
    """State of one worker process (decorated with ``ray.remote`` by the executor)."""

    def __init__(self) -> None:
        self.executable: Any = None

    def node(self) -> tuple[str, str]:
        """(Ray node id, host name) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), socket.gethostname()

    def set_env(self, variables: dict[str, str]) -> None:
        os.environ.update(variables)

    def start_executable(self, cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.executable = cls(*args, **kwargs) if cls is not None else None

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        return _guarded(fn, self.executable)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _guarded(fn, *args, **kwargs)

    def run_elastic(self, call: Callable[[], Any]) -> Any:
        """One worker of an elastic job: ``call()`` (an ``@elastic.run`` function resets
        inside). A raise is left to the driver, which kills this actor so the peers see
        a lost peer and re-form (a shutdown here would end their job instead); a worker
        the re-formed job no longer needs returns None."""
        from .. import _api

        try:
            result = call()
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
            result = None  # removed from the job (WorkerRemovedError): not a failure
        _api.shutdown()
        return result

    def shutdown_ronde(self) -> None:
        from .. import _api

        _api.shutdown()


def _guarded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except BaseException:
        from .. import _api

        try:
            _api.shutdown()  # the others' pending collectives fail now, naming this rank
        except Exception:  # noqa: BLE001 - the original error is what matters
            pass
        raise
