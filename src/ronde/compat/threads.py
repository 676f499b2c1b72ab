"""``horovod.runner.util.threads`` as Horovod's test helpers use it."""

from __future__ import annotations

import threading
from typing import Any, Callable


def in_thread(target: Callable[..., Any], args: tuple[Any, ...] = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` in a new (daemon) thread and return the thread.

    With ``silent=True`` an exception in ``target`` is swallowed, as in Horovod.
    """
    def run() -> None:
        try:
            target(*args)
        except BaseException:  # noqa: BLE001 - Horovod's silent mode
            if not silent:
                raise

    thread = threading.Thread(target=run if silent else target,
                              args=() if silent else args, name=name, daemon=daemon)
    thread.start()
    return thread
