"""Threads as ranks: n real engines in one process, joined by socket pairs.

This is the fast tier of engine tests (negotiation, fusion, validation, cache)
without process start-up; the real-process tier lives in tests/integration.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from ronde import _config
from ronde.core.engine import Engine
from ronde.transport.base import Communicator, P2PCommunicator
from ronde.testing.threads import socket_mesh
from ronde.transport.tcp import SocketP2P


class EngineGroup:
    def __init__(self, n: int, **cfg: Any) -> None:
        self.n = n
        self.cfg = _config.load({}, **cfg)
        ctl, data = socket_mesh(n), socket_mesh(n)
        self.engines: list[Engine] = []
        for r in range(n):
            holder: dict[str, Engine] = {}

            def make(ps_id: int, members: list[int], r: int = r, holder: dict = holder
                     ) -> Communicator | None:
                if r not in members:
                    return None
                p2p = SocketP2P(r, members, data[r], str, lambda: holder["e"].failed)
                return P2PCommunicator(p2p, self.cfg.small_allreduce_bytes)

            eng = Engine(r, n, self.cfg, ctl[r], {0: make(0, list(range(n)))},
                         {0: list(range(n))}, make, str)
            holder["e"] = eng
            self.engines.append(eng)
        for e in self.engines:
            e.start()

    def close(self) -> None:
        import threading

        threads = [threading.Thread(target=e.shutdown) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)


@pytest.fixture
def engines() -> Callable[..., EngineGroup]:
    groups: list[EngineGroup] = []

    def make(n: int, **cfg: Any) -> EngineGroup:
        g = EngineGroup(n, **cfg)
        groups.append(g)
        return g

    yield make
    for g in groups:
        g.close()
