"""The rendezvous service of an elastic job: slots register, the driver forms generations.

Where it sits: ``ronderun``'s elastic driver (``runner/elastic.py``) runs one
:class:`ElasticRendezvous`. A worker registers its *slot* (host, local slot) at every
``init()``; the driver says which slots form the next generation, in rank order
(:meth:`ElasticRendezvous.set_assignment`). When every slot of it has registered, each
gets its rank, the size, the generation number and the peer table; a registered slot
that is no longer in the job gets ``removed``. Workers also ask it for the latest
host-change notice (:meth:`ElasticRendezvous.answer`, see ``ronde/elastic/notify.py``).
"""

from __future__ import annotations

import socket
import time
from typing import Any, Sequence

from .rendezvous import RendezvousServer

#: a worker's place: (host, local slot)
Slot = tuple[str, int]


class ElasticRendezvous(RendezvousServer):
    """The rendezvous of an elastic job: workers register their slot, the driver says
    which slots form each generation (see the module docstring)."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", start_timeout_s: float = 30.0
                 ) -> None:
        super().__init__(0, secret, host=host, start_timeout_s=start_timeout_s)
        #: slot -> (socket, registration, when) of workers waiting for their generation
        self._held: dict[Slot, tuple[socket.socket, dict[str, Any], float]] = {}
        self._target: list[Slot] = []
        self._formed: list[Slot] = []
        self._is_formed = True
        self.generation = 0
        #: when the newest generation formed (``time.monotonic()``): the failure reports
        #: since then name its ranks
        self.formed_at = 0.0
        self._removed: set[Slot] = set()
        #: (sequence number, update bits) of the latest host notice: a counter, not a
        #: clock, so two changes within a second are two notices
        self.notice: tuple[float, int] = (0.0, 0)
        self._leaving: list[Slot] = []
        #: slot -> the error text a worker reported before it ended (Spark's tasks)
        self._errors: dict[Slot, str] = {}

    # -- the driver's side -------------------------------------------------------------
    def set_assignment(self, slots: list[Slot], removed: Sequence[Slot] = ()) -> None:
        """The next generation is ``slots`` in rank order; ``removed`` slots are out."""
        with self._lock:
            self.generation += 1
            self._target = list(slots)
            self._is_formed = False
            self._removed = (self._removed | set(removed)) - set(slots)
        self._try_form()

    def announce(self, update: int) -> None:
        """Tell the workers the hosts changed (they read it through ``answer``)."""
        with self._lock:
            self.notice = (self.notice[0] + 1, update)

    def waiting(self) -> tuple[list[Slot], float | None]:
        """Slots registered and not yet answered, and since when the oldest waits."""
        with self._lock:
            if not self._held:
                return [], None
            return list(self._held), min(when for _, _, when in self._held.values())

    def formed(self) -> list[Slot]:
        with self._lock:
            return list(self._formed)

    # -- the workers' side -------------------------------------------------------------
    def answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("what") == "failed":  # a worker's last words before it ends
            try:
                slot, text = (str(msg["host"]), int(msg["slot"])), str(msg["error"])[-20000:]
            except (KeyError, TypeError, ValueError):
                return {"kind": "error", "message": "malformed failure report"}
            with self._lock:
                self._errors[slot] = text
            return {"kind": "ok"}
        if msg.get("what") == "leave":  # a preempted worker leaves by itself
            try:
                slot = (str(msg["host"]), int(msg["slot"]))
            except (KeyError, TypeError, ValueError):
                return {"kind": "error", "message": "malformed leave request"}
            with self._lock:
                self._leaving.append(slot)
            return {"kind": "ok"}
        with self._lock:
            stamp, update = self.notice
        return {"kind": "hosts", "timestamp": stamp, "update": update}

    def reported_error(self, slot: Slot) -> str | None:
        """The error a worker of ``slot`` reported before it ended, if any."""
        with self._lock:
            return self._errors.get(slot)

    def take_leaving(self) -> list[Slot]:
        """Slots whose workers said they leave (SIGTERM), since the last call."""
        with self._lock:
            out, self._leaving = self._leaving, []
        return out

    def _register(self, conn: socket.socket, msg: dict[str, Any], peer: str = "",
                  admitted_open: bool = False) -> None:
        try:
            slot = (str(msg["host"]), int(msg["slot"]))
            if not msg.get("elastic"):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            self._reply(conn, {"kind": "error", "message":
                               "this is an elastic job: workers must be started by its "
                               "ronderun (RONDE_ELASTIC=1, RONDE_SLOT)"})
            conn.close()
            return
        with self._lock:
            old = self._held.pop(slot, None)
            self._held[slot] = (conn, msg, time.monotonic())
            if self._is_formed and slot in self._target:
                # a member of the running generation is back without the driver asking
                # (a reset the driver did not cause): re-form the same slots
                self.generation += 1
                self._is_formed = False
        if old is not None:
            old[0].close()
        self._try_form()

    def _try_form(self) -> None:
        replies: list[tuple[socket.socket, dict[str, Any]]] = []
        with self._lock:
            for slot in [s for s in self._held if s in self._removed]:
                replies.append((self._held.pop(slot)[0], {"kind": "removed"}))
            target = self._target
            if not self._is_formed and target and all(s in self._held for s in target):
                peers = [self._held[s][1] for s in target]
                for rank, slot in enumerate(target):
                    replies.append((self._held.pop(slot)[0], {
                        "kind": "table", "peers": peers, "rank": rank, "size": len(target),
                        "generation": self.generation, "notice": self.notice[0]}))
                self._is_formed = True
                self._formed = list(target)
                self.formed_at = time.monotonic()
        for conn, obj in replies:
            self._reply(conn, obj)
            conn.close()

    def _timeout_loop(self) -> None:
        return  # the driver decides what a wait means (module docstring)
