"""Handing a round's agreed responses out: every path decided here, once.

Where it sits in the engine cycle: the thread that ran a negotiation round (the control
thread, or a caller driving the engine) calls :meth:`Dispatcher.dispatch` with the
round's responses, in the agreed order. For each it resolves, on that thread and in
that order, what the response needs to run: its requests (taken out of the outbox),
the process set's members and this rank's communicator for it. The executor thread
then runs a response from what it carries alone (``executor.py``): it never looks up
a table an agreed change could be altering.

What does not reach the executor: a response of a set this rank is not in (nothing
to do); an inline allreduce (reduced here from the bytes that came with the round,
``inline.py``); a process-set change. A change waits until every response agreed
before it has run (the executor idle), then creates or drops the set's communicator
here: every rank changes its table at the same point of the collective sequence, no
collective of this rank runs while a communicator is being built (an MPI or Gloo
group is itself a collective), and the responses after it find the new set.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from .._errors import RondeError, fresh_copy
from . import inline, planner
from .requests import Kind

if TYPE_CHECKING:
    from .._config import Config
    from .communicators import Communicators
    from .executor import Executor
    from .lane import Lane
    from .outbox import Outbox
    from .requests import Request
    from .responses import Response
    from .timeline import Timeline


class Dispatcher:
    """Resolves and hands out agreed responses (see the module docstring).

    Made with the communicators and the pending requests (objects the engine shares
    with it) and the executor it feeds; :attr:`timeline` is the engine's."""

    def __init__(self, rank: int, cfg: "Config", sets: "Communicators", out: "Outbox",
                 executor: "Executor", lane: "Lane | None" = None) -> None:
        self.rank, self.cfg, self.sets, self.out = rank, cfg, sets, out
        self.executor = executor
        #: shown every resolved allreduce: steady buckets enter it (``lane.py``); None
        #: where it is off (no call per response then)
        self.lane = lane if lane is not None and lane.enabled else None
        self.timeline: "Timeline | None" = None  #: the engine's (``Engine.set_timeline``)

    def dispatch(self, responses: list["Response"], direct: list["Response"] | None) -> None:
        """Hand out one round's responses, in order: inline ones run here and now (a
        run of them together), the rest go to the executor's queue, or into ``direct``
        when the driving caller may run them itself (``Executor.claim``). A fused
        allreduce that can run with the one before it (same process set, dtype, op and
        scales, with only inline ones between) rides along as that one's follower
        (``planner.chain``); followers are attached before anything is handed out."""
        # 0: no fusion at all
        plan = planner.chain(responses, self.cfg.fusion_threshold_bytes > 0)
        ex, take, rank, lane = self.executor, self.out.take_many, self.rank, self.lane
        batch: list[Response] = []
        for resp in plan:
            if resp.inline is not None:
                batch.append(resp)
                continue
            if batch:
                self._inline(batch)
                batch = []
            if resp.value is not None and resp.kind == Kind.BARRIER and resp.ps_id == 0 \
                    and resp.names[0].startswith("process_set."):
                self._change_sets(resp, direct)
                continue
            if not self._resolve(resp, take, rank):
                continue  # nothing for this rank
            if lane is not None and resp.kind == Kind.ALLREDUCE:
                lane.observe(resp)
            for f in resp.followers or ():
                self._resolve(f, take, rank)
            if direct is not None and (direct or ex.claim()):
                direct.append(resp)
            else:
                ex.enqueue(resp)
        if batch:
            self._inline(batch)

    def _inline(self, batch: list["Response"]) -> None:
        """Reduce a run of inline allreduces here, their requests taken at once (one
        name each)."""
        for resp, req in zip(batch, self.out.take_many([r.names[0] for r in batch])):
            resp.reqs = [req]
        inline.run_batch(batch, self.timeline)

    def _resolve(self, resp: "Response",
                 take: Callable[[list[str]], list["Request | None"]], rank: int) -> bool:
        """Give ``resp`` its requests, members and communicator; False: nothing here
        (a set this rank is not in, or an error or join of no request of this rank)."""
        if resp.error is not None or resp.kind == Kind.JOIN:
            resp.reqs = reqs = take(resp.names if resp.error is not None else resp.names[:1])
            return any(r is not None for r in reqs)
        members = self.sets.members(resp.ps_id)
        if rank not in members:
            return False
        resp.members, resp.comm = members, self.sets.get(resp.ps_id)
        resp.reqs = take(resp.names)
        return True

    def _change_sets(self, resp: "Response", direct: list["Response"] | None) -> None:
        """A process set added or removed (agreed): after everything agreed before it
        has run, build or drop its communicator here (see the module docstring)."""
        ex = self.executor
        if direct:  # claimed by this caller, agreed before the change: run them first
            ex.run_claimed(direct)
            direct.clear()
        while not ex.idle():
            failed = ex.failed()
            if failed is not None:
                raise fresh_copy(failed)
            time.sleep(0.0005)
        req, = self.out.take_many(resp.names[:1])
        try:
            self.sets.apply(resp.value)
        except BaseException as exc:  # the caller gets it; the engine fails (round driver)
            if req is not None:
                req.fail(exc if isinstance(exc, RondeError) else RondeError(
                    f"process set {resp.value[1]}: {resp.value[0]} failed: {exc!r}"))
            raise
        if req is not None:
            req.complete(resp.value[1])
