"""Threads as ranks: ``run_threads(n, fn, *args)`` runs ``fn`` on ``n`` ranks that are
threads of this process, each with a runtime of its own.

For tests of the framework bindings that need no real sockets or processes: a thread's
``ronde`` calls (``init()``, ``rank()``, the collectives, the optimizers) see its own
:class:`~ronde._runtime.Runtime` (:func:`ronde._state.set_thread_runtime`), whose engine
is a real one, negotiating with the other threads' engines over socket pairs and moving
data with the TCP algorithms over more socket pairs (the engine tests' set-up). No
process starts and no framework is imported twice, so a scenario costs what its
computation costs. What it does not cover, by design: the transports (shared memory,
TCP between processes, Gloo, MPI), the launcher and rendezvous, anything that must
differ per process (signals, exit codes, ``os.environ``), and process sets other than
the global one. Tests of those start real processes (:func:`ronde.testing.run_ranks`).

Inside ``fn``, ``init()`` and ``shutdown()`` leave the thread's runtime alone (the
harness made it and stops it), so a worker written for :func:`run_ranks` runs unchanged.
A caller waiting on a handle drives its own rank's engine, as in a real job (each
handle is given its engine's waiters).
"""

from __future__ import annotations

import socket
import threading
import traceback
from typing import Any, Callable

from .. import _config, _state
from .._errors import RondeError
from ..process_sets import global_process_set

__all__ = ["run_threads", "socket_mesh"]


class _Env:
    """What a runtime reads of its worker environment (no launcher here)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.elastic = False
        self.source = "threads"


def socket_mesh(n: int) -> list[dict[int, socket.socket]]:
    """A socket pair between every two of ``n`` thread ranks: ``mesh[i][j]`` is rank
    ``i``'s end of its link to rank ``j``."""
    mesh: list[dict[int, socket.socket]] = [{} for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            mesh[i][j], mesh[j][i] = socket.socketpair()
    return mesh


def _runtimes(n: int, **overrides: Any) -> list[Any]:
    from .._runtime import Runtime, Topology
    from ..core.engine import Engine
    from ..transport.base import Communicator, P2PCommunicator
    from ..transport.tcp import SocketP2P

    cfg = _config.load(**overrides)
    ctl, data = socket_mesh(n), socket_mesh(n)
    hosts = ["localhost"] * n
    out = []
    for r in range(n):
        box: list[Engine] = []

        def make(ps_id: int, members: list[int], r: int = r, box: list[Engine] = box
                 ) -> Communicator | None:
            if r not in members:
                return None
            p2p = SocketP2P(r, members, data[r], str, lambda: box[0].failed)
            return P2PCommunicator(p2p, cfg.small_allreduce_bytes)

        engine = Engine(r, n, cfg, ctl[r], {0: make(0, list(range(n)))}, {0: list(range(n))},
                        make, lambda q: f"{q} (thread)")
        box.append(engine)
        out.append(Runtime(cfg, Topology.build(r, hosts), engine, _Env(r, n), None, 1,
                           "tcp"))
    for rt in out:
        rt.engine.start()
    return out


def run_threads(n: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0,
                **config: Any) -> list[Any]:
    """``fn(*args)`` on ``n`` thread ranks; their results in rank order.

    Args:
        n: ranks.
        fn: the function each rank runs (``ronde``'s API sees the thread's rank).
        args: its arguments.
        timeout_s: how long the ranks may take together.
        config: ``Config`` fields to override (``cycle_time_ms=...``).

    Raises:
        RondeError: a rank raised (its traceback in the message) or the ranks did not
            finish in ``timeout_s`` (a hang is a failure).
    """
    if _state.current() is not None:
        raise RondeError("run_threads needs a process where ronde is not initialised")
    runtimes = _runtimes(n, **config)
    results: list[Any] = [None] * n
    errors: list[str | None] = [None] * n

    def rank_main(r: int) -> None:
        _state.set_thread_runtime(runtimes[r])
        try:
            results[r] = fn(*args)
        except BaseException:  # noqa: BLE001 - reported below, with the rank
            errors[r] = traceback.format_exc()
            runtimes[r].engine.fail(RondeError(f"thread rank {r} raised"))
        finally:
            _state.set_thread_runtime(None)

    global_process_set._bind(0, list(range(n)), -1)  # the rank comes from each thread
    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}", daemon=True)
               for r in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            for rt in runtimes:
                rt.engine.fail(RondeError("run_threads: the ranks did not finish in time"))
            raise RondeError(f"run_threads: rank(s) {hung} did not finish within {timeout_s} s")
    finally:
        stoppers = [threading.Thread(target=rt.engine.shutdown) for rt in runtimes]
        for s in stoppers:
            s.start()
        for s in stoppers:
            s.join(20)
        global_process_set._unbind()
        global_process_set.ranks = None
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise RondeError("run_threads: " + "\n".join(f"rank {r} raised:\n{e}"
                                                      for r, e in failed))
    return results
