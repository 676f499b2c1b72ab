"""What this rank says in its next negotiation round, and what it has in flight.

Where it sits in the engine cycle: ``Engine.submit`` (any thread) files a request here;
the thread that runs the next round (``Engine._round``) takes everything at once
(:meth:`Outbox.take`) and builds its frame from it; completions and failures take the
requests back out of :attr:`Outbox.pending`. Besides announcements a round may carry
joins, process-set requests and control messages (a stall abort, stacks asked for and
sent, "only waiting", the shutdown): these are never held back (``holding.py``).

One lock (:attr:`Outbox.lock`) guards this state together with the engine's own (its
failure, its sleep flags), so that a failure and a submission never cross: the engine
uses this lock as its ``_lock``. Methods named ``..._locked`` expect it held.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .._errors import DuplicateNameError
from . import protocol
from .requests import Kind, Request
from .rounds import main_thread_stack


class Outbox:
    """This rank's side of the next round (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        #: every collective submitted and not completed yet, by name
        self.pending: dict[str, Request] = {}
        self.reqs: list[Request] = []  #: to announce
        self.staged: list[Request] = []  #: submitted inside ``batch()``, not announced yet
        self.batching = 0
        self.joins: list[int] = []
        self.ps_requests: list[protocol.ProcessSetRequest] = []
        self.abort: protocol.Abort | None = None  #: rank 0: stalled collectives to fail
        self.ask_stacks: list[int] = []  #: rank 0: ranks asked for their stacks
        self.send_stack = False  #: asked by rank 0 for my main thread's stack
        self.waiting: int | None = None  #: "only waiting", at this progress count
        self.shutdown_requested = False
        self.shutdown_announced = False
        self.shutdown_at = 0.0
        #: submissions so far, and their count when a round was last held (one arriving
        #: while a round is held is looked at at once: ``Engine._sleep``)
        self.submitted = self.held_submitted = 0

    def add_locked(self, req: Request) -> None:
        """File a submitted request (a join, or an announcement: staged inside a batch)."""
        if req.name in self.pending:
            raise DuplicateNameError(
                f"a collective named {req.name!r} is already in flight on rank "
                f"{self.rank}; wait for it first or give this one another name")
        self.pending[req.name] = req
        if req.kind == Kind.JOIN:
            self.joins.append(req.ps_id)
        else:
            (self.staged if self.batching else self.reqs).append(req)
        self.submitted += 1

    def add_process_set_locked(self, action: str, arg: Any, req: Request) -> None:
        if req.name in self.pending:
            raise DuplicateNameError(f"{req.name!r} is already pending")
        self.pending[req.name] = req
        self.ps_requests.append(protocol.ProcessSetRequest(
            action, tuple(sorted(arg)) if action == "add" else (arg,)))

    def post(self, **control: Any) -> None:
        """Control messages for the next round (``ask_stacks``, ``abort``, ``waiting``,
        ``send_stack``), set under the lock; a None leaves its field as it is."""
        with self.lock:
            for field, value in control.items():
                if value is not None:
                    setattr(self, field, value)

    def end_batch_locked(self) -> bool:
        """Leave a ``batch()``; True when the outermost one released submissions."""
        self.batching -= 1
        if self.batching or not self.staged:
            return False
        self.reqs.extend(self.staged)
        self.submitted += len(self.staged)
        self.staged = []
        return True

    def control_locked(self) -> bool:
        """Whether the next round carries anything but announcements."""
        return bool(self.joins or self.ps_requests or self.abort or self.ask_stacks
                    or self.send_stack or self.waiting is not None
                    or (self.shutdown_requested and not self.shutdown_announced))

    def take_many(self, names: list[str]) -> list[Request | None]:
        with self.lock:
            pop = self.pending.pop
            return [pop(name, None) for name in names]

    def drain(self) -> list[Request]:
        """Every request in flight, taken out (they are about to fail)."""
        with self.lock:
            reqs = list(self.pending.values())
            self.pending.clear()
            self.reqs.clear()
            self.staged.clear()
        return reqs

    def take(self) -> tuple[list[Request], protocol.RoundMessage]:
        """Everything for the next round: the requests to announce, and a message with
        the rest (its announcements are the caller's to fill in)."""
        with self.lock:
            reqs, self.reqs = self.reqs, []
            joins, self.joins = self.joins, []
            ps_reqs, self.ps_requests = self.ps_requests, []
            abort, self.abort = self.abort, None
            ask, self.ask_stacks = self.ask_stacks, []
            send_stack, self.send_stack = self.send_stack, False
            waiting, self.waiting = self.waiting, None
            shut = self.shutdown_requested and not self.shutdown_announced
            if shut:
                self.shutdown_announced = True
                self.shutdown_at = time.monotonic()
        return reqs, protocol.RoundMessage(
            (), tuple(joins), tuple(ps_reqs), abort, tuple(ask),
            main_thread_stack() if send_stack else None, shut, waiting)
