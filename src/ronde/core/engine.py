"""The engine: one per process, a control thread and an executor thread.

The cycle, end to end:

1. ``submit()`` (any thread) records a :class:`Request` as pending, wakes the control.
2. The control thread runs a *round* when it has something to announce (at once
   if the executor is idle, else after at most ``RONDE_CYCLE_TIME`` ms, which lets
   gradients that arrive while data is moving batch into one fused op), or as soon
   as a peer starts one. In a round every rank sends one frame to every peer (its
   new announcements: names with metadata, or response-cache ids) and reads one
   frame from each.
3. Every rank feeds the same frames to its :class:`Negotiator`: the same ordered, fused
   responses everywhere, resolved and handed out (``dispatch.py``), most to the executor.
4. The executor runs them in order (see ``executor.py``) and completes handles.

Nobody polls while idle: with nothing to announce there are no rounds. A peer that dies
closes its sockets, which every rank sees at once as ``PeerLostError``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Callable, Iterator

from .._config import Config
from .._errors import PeerLostError, RondeError, ShutdownError, fresh_copy
from ..transport import mailbox, ready
from ..transport.base import Communicator
from .communicators import Communicators
from .exchange import Exchange, Links
from .dispatch import Dispatcher
from .executor import Executor
from .holding import RoundHold
from .lane import Lane
from .negotiation import Negotiator, Response
from .outbox import Outbox
from . import autotune, crossed, protocol, rounds
from .requests import Handle, Request, Waiters
from .stall import StallInspector
from .timeline import Timeline, now_us

#: the control thread's sleep with nothing to do (the checks' period; what comes wakes
#: it), ``_QUIET_S`` with nothing pending and the lane carrying the steps
_IDLE_S, _QUIET_S = 0.25, 2.0

class Engine:
    """Background negotiation and execution of collectives for one process."""

    def __init__(self, rank: int, size: int, cfg: Config, ctl_socks: dict[int, socket.socket],
                 comms: dict[int, Communicator], process_sets: dict[int, list[int]],
                 make_communicator: Callable[[int, list[int]], Communicator | None],
                 describe_rank: Callable[[int], str],
                 mailboxes: "mailbox.Mailboxes | None" = None,
                 links: Links | None = None,
                 make_lane: Callable[[], Communicator] | None = None) -> None:
        self.rank, self.size, self.cfg = rank, size, cfg
        self.cycle_s = cfg.cycle_time_ms / 1000.0  #: set anew by autotune (autotune.py)
        self.describe_rank = describe_rank
        #: what the next round says, and the collectives in flight (outbox.py); its lock
        #: guards the engine's state too
        self.out = Outbox(rank)
        self._lock = self.out.lock
        self._error: BaseException | None = None
        self._failing: BaseException | None = None  #: the first failure, being told
        self._told = threading.Event()  #: set once the first failure is told and shown
        self.aborted = threading.Event()  #: set with the first failure (see ``failed``)
        self.on_failure: Callable[[BaseException], None] | None = None  # first one only
        self.sets = Communicators(rank, comms, process_sets, make_communicator)
        self.negotiator = Negotiator(size, {k: list(v) for k, v in process_sets.items()},
                                     cfg.fusion_threshold_bytes, cfg.cache_capacity)
        self.exchange = Exchange(rank, size, ctl_socks, mailboxes, cfg, describe_rank, links)
        self.announcer = rounds.Announcer(self.negotiator.cache, rank, cfg.inline_bytes)
        self._bell = ready.Doorbell()  #: rung to wake the control thread
        self._rounds = 0  #: negotiation rounds completed (the same count on every rank)
        self._last_round = 0.0
        self._drive = threading.Lock()  #: held by the thread that runs a round
        self.spinners = 0  #: threads driving it in a wait now (``Waiters.drive``)
        self._waited_by = 0  #: the thread that drives its next submission at once
        self._last_activity = 0.0
        #: quiet: in its ``_QUIET_S`` sleep, which every submission interrupts
        self._ctl_deep_sleep, self._ctl_quiet = True, False
        self._hold_until = 0.0  #: a local round waits for this (a burst after a long sleep)
        self._held_round = 0  #: the round held through the mailboxes (``_maybe_round``)
        self.round_hold = RoundHold(  # whether to hold the next round back (holding.py)
            cfg.round_hold_ms / 1000.0, self.negotiator, self.exchange, rank, size)
        self.executor = Executor(rank, lambda: self._error, self.fail, self._bell)
        self.lane = Lane(rank, make_lane, lambda: self._error, self.fail, self._bell, self._add)
        self.dispatcher = Dispatcher(rank, cfg, self.sets, self.out, self.executor, self.lane)
        self.stall = StallInspector(cfg, describe_rank)
        self.waiters = Waiters()  #: callers waiting on its handles drive it (requests.py)
        self._waiting = crossed.WaitWatch(cfg.deadlock_time_s, self.waiters)  # crossed.py
        self._thread = threading.Thread(target=self._control_main, name="ronde-control",
                                        daemon=True)
        self._stopped = threading.Event()
        self.timeline: Timeline | None = None  #: the Chrome-trace recorder (timeline.py)
        self.autotune = autotune.AutoTune(None)  #: rank 0 gets a Tuner with RONDE_AUTOTUNE

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.executor.start()
        self._thread.start()
        if self.cfg.spin_time_us > 0:
            self.waiters.attach(self)

    def shutdown(self) -> None:
        """Announce shutdown, let pending work finish (bounded), then stop the threads."""
        self.lane.leave(connect=False)  # peers in a lane meeting stop waiting for this rank
        with self._lock:
            self.out.shutdown_requested = True
        self.waiters.detach(self)
        self.wake(force=True)
        self._thread.join(self.cfg.shutdown_timeout_s + 5.0)
        gone = ShutdownError("ronde was shut down while this collective was pending")
        self.executor.stop(5.0, gone)
        self.lane.close(5.0)
        self._fail_all(gone)
        self.autotune.close()
        timeline = self.set_timeline(None)
        if timeline is not None:
            timeline.close()
        self.sets.close()
        self.exchange.close()
        self._bell.close()

    def wake(self, force: bool = False) -> None:
        """Make the control thread look at the outbox (and the peers) again."""
        # one byte in the pipe is enough until the control thread has drained it, and a
        # caller spinning in wait() drives the engine itself: skip the system call (and
        # the thread switch) then
        if force or not (self._bell.pending or self.spinners):
            self._bell.ring()

    # -- API used by the facade ------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        if self.lane.table and self.lane.take(req, self._waited_by == threading.get_ident()):
            self._waited_by = 0  # a steady gradient bucket skips the round (lane.py)
            return req
        req.handle = Handle(req.name, self.waiters)  # (its waiter drives this engine)
        self._add(req)
        return req

    def _add(self, req: Request) -> None:
        """The general path of ``submit`` (and of the lane's fall-backs: handle kept)."""
        with self._lock:
            if self._error is not None:
                raise fresh_copy(self._error)
            if self.out.shutdown_requested:
                raise ShutdownError(f"cannot submit {req.name!r}: ronde is shutting down")
            self.out.add_locked(req)
            if self.timeline is not None:
                req.t_submit = now_us()
            self._last_activity = now = time.monotonic()
            deep = self._ctl_deep_sleep and not self.out.batching
            quiet = deep and not self._ctl_quiet and self.waiters.engine \
                and self._waited_by == threading.get_ident()
            self._waited_by = 0  # the next submission only (``waited_by``)
            if deep and not quiet and self.waiters.engine:  # a burst joins this round
                self._hold_until = now + self.cycle_s / 4
        if quiet and self._drive.acquire(False):  # no wake-up (``waited_by``); the round
            try:  # number holds still under the drive lock (else: wake, as for any)
                self.round_hold.want(self._rounds + 1)
            finally:
                self._drive.release()
        elif deep:  # a control thread in a short sleep looks at the outbox after it
            self.wake()

    def waited_by(self, ident: int) -> None:
        """Thread ``ident`` (0: none) drives the next submission, if it makes it (a step's
        last bucket): no wake-up; the next round is *wanted* (``RoundHold.want``)."""
        self._waited_by = ident

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Submissions inside reach the outbox together at the end, so one round takes
        them all: a grouped collective is negotiated (and fused) as one, as in Horovod."""
        with self._lock:
            self.out.batching += 1
        try:
            yield
        finally:
            with self._lock:
                deep = self.out.end_batch_locked() and self._ctl_deep_sleep
            if deep:
                self.wake()

    def request_process_set(self, action: str, arg: Any, req: Request) -> Request:
        req.handle = Handle(req.name, self.waiters)
        with self._lock:
            if self._error is not None:
                raise fresh_copy(self._error)
            self.out.add_process_set_locked(action, arg, req)
        self.wake()
        return req

    @property
    def failed(self) -> BaseException | None:
        """The failure that stopped this engine, or None."""
        return self._error

    # -- failure -------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Stop the engine with ``exc``: the first failure wins. A lost peer is told to
        the others (``Exchange.tell_peers``) before the failure shows anywhere (else a
        user thread that catches it and exits, or an executor that sees the abort, could
        close the sockets first, and the peers would blame this rank)."""
        with self._lock:
            first = self._failing is None
            if first:
                self._failing = exc
        if first:
            if isinstance(exc, PeerLostError):
                self.exchange.tell_peers(exc)
            with self._lock:
                self._error = exc
                self.aborted.set()
            self._told.set()
        else:
            self._told.wait(5.0)  # tell_peers: at most 0.5 s per peer that does not read
        self._fail_all(self._error or exc)
        if first and self.on_failure is not None:
            self.on_failure(exc)
        self.wake(force=True)

    def set_timeline(self, timeline: Timeline | None) -> Timeline | None:
        """Record into ``timeline`` from now on (None: stop); returns the one before."""
        old, self.timeline = self.timeline, timeline
        self.executor.timeline = self.dispatcher.timeline = timeline
        self.lane.set_timeline(timeline)
        return old

    def _fail_all(self, exc: BaseException) -> None:
        for req in self.out.drain():
            req.fail(fresh_copy(exc))

    # -- the control thread ----------------------------------------------------------------
    def _control_main(self) -> None:
        try:
            self._control_loop()
        except BaseException as exc:  # noqa: BLE001 - every failure ends in fail()
            self._driver_failed(exc)
        finally:
            self.exchange.close_sockets()
            self._stopped.set()

    def _driver_failed(self, exc: BaseException) -> None:
        self.fail(exc if isinstance(exc, RondeError) else
                  RondeError(f"rank {self.rank}: engine control thread failed: {exc!r}"))

    def _has_local(self) -> bool:
        with self._lock:
            return bool(self.out.reqs) or self._other_local()

    def _other_local(self) -> bool:
        """Something other than announcements for the next round (hold ``_lock``)."""
        return self.out.control_locked() or bool(self.autotune.outgoing)

    def _hold(self, now: float, started: bool) -> bool:
        """Whether to keep this rank out of the next round for now (``holding.py``)."""
        hold, want = self.round_hold, self._rounds + 1
        if not hold.may_hold(want, started, now):
            return False
        with self._lock:
            if self._other_local():
                return False
            # held through the mailboxes already, nothing new since: a caller's poll
            known = hold.settled(want) and self.out.submitted == self.out.held_submitted
            reqs = [] if known else list(self.out.reqs)
            self.out.held_submitted = self.out.submitted
        if not known and not hold.decide(reqs, want):
            return False
        self._held_round = want if hold.settled(want) else 0
        if not known and self.timeline is not None:
            self.timeline.queued(reqs)  # waiting for the peers from now on: NEGOTIATE
        return True

    def _maybe_round(self, now: float, direct: list[Response] | None) -> tuple[bool, bool]:
        """Run a round if one is due (hold ``_drive``); returns (ran, have_local).

        Due: a peer started one, or this rank has something to announce and the
        executor is idle (or ``RONDE_CYCLE_TIME`` passed since the last round, so that
        tensors arriving while data moves batch into one fused op). The control thread
        (``direct`` None) woken from a long sleep by a submission waits a quarter cycle
        first, for the rest of the burst, before it starts a round or joins a peer's
        (which would take the burst's first tensors alone), unless a caller waits and
        drives.
        """
        if self._held_round == self._rounds + 1 and now < self.round_hold.until \
                and self.out.submitted == self.out.held_submitted \
                and not self._other_local() and not self.exchange.peer_started(self._rounds):
            return False, True  # held, nothing new: ``_hold``'s answer, cheaper (a writer wakes us)
        have_local = self._has_local()
        if direct is None and now < self._hold_until:
            return False, have_local
        start_local = have_local and (self.executor.idle()
                                      or now - self._last_round >= self.cycle_s)
        started = self.exchange.peer_started(self._rounds)
        if not (start_local or started) or self._hold(now, started):
            return False, have_local
        self._round(direct)
        self._last_round = time.monotonic()
        return True, have_local

    def _control_loop(self) -> None:
        ex = self.exchange
        last_stall_check = last_wait_check = time.monotonic()
        while True:
            if self._error is not None:
                return
            now = time.monotonic()
            if self.spinners:
                # a waiting caller drives (and runs collectives without a hand-off): stay
                # out of its way, but keep reading the sockets (EOF, remote frames)
                readable, _ = ready.wait([self._bell] + ex.sockets(), [], self.cycle_s)
                self._read_ready(readable)
            else:
                with self._drive:
                    ran, have_local = self._maybe_round(now, None)
                if not ran:
                    self._sleep(now, have_local)
            now = time.monotonic()
            if self.out.shutdown_announced:
                everyone = len(self.negotiator.shutdown) == self.size
                if everyone or now - self.out.shutdown_at > self.cfg.shutdown_timeout_s:
                    self.executor.drain(self.cfg.shutdown_timeout_s, lambda: self._error is None)
                    return
            if now - last_wait_check > 0.25:
                last_wait_check = now
                self._check_waiting(now)
            if now - last_stall_check > 1.0:
                last_stall_check = now
                self._check_stalls()
            if self.timeline is not None:
                self.timeline.tick()

    def _sleep(self, now: float, have_local: bool) -> None:
        """The control thread waits for something to do.

        With something to announce, until the cycle (``RONDE_CYCLE_TIME``) since the
        last round is over, so that submissions arriving meanwhile share a round;
        otherwise until a submission (through the pipe), a peer's frame (a socket, or a
        same-host peer's doorbell) or ``_IDLE_S`` (``_QUIET_S``): no polling."""
        ex = self.exchange
        holding = self.round_hold.holding(self._rounds + 1, now)
        if holding:  # until a peer starts it, a submission arrives, or the hold ends
            timeout = self.round_hold.until - now
        elif have_local:
            due = self._hold_until
            if not self.executor.idle():
                # rung as the executor runs out of work (a round is due then), unless it
                # did so between the two looks
                self._bell.wanted = True
                if not self.executor.idle():
                    due = max(due, self._last_round + self.cycle_s)
            timeout = max(0.0, due - now)
        else:
            timeout = 0.1 if self.timeline is not None else _IDLE_S if self.out.pending \
                or self.negotiator.entries or self.out.shutdown_requested \
                or not self.lane.table else _QUIET_S
        if now < self._hold_until:  # then a peer's round is joined too (_maybe_round)
            timeout = min(timeout, self._hold_until - now)
        deep = timeout > self.cycle_s
        with self._lock:
            self._ctl_deep_sleep, self._ctl_quiet = deep, timeout == _QUIET_S
            # something to do that arrived before the flag was up (submit() did not wake
            # this thread): holding, only a new submission counts
            new = (self.out.submitted != self.out.held_submitted if holding
                   else bool(self.out.reqs) or self._other_local())
        ahead = ex.before_block(self._rounds, idle=True)
        if (ahead and now >= self._hold_until) or (deep and new):
            timeout = 0.0
        try:
            readable, _ = ready.wait([self._bell] + ex.sockets(), [], timeout)
        finally:
            self._ctl_deep_sleep = self._ctl_quiet = False
            self._bell.wanted = False
            ex.after_block(idle=True)
        self._read_ready(readable)

    def _read_ready(self, readable: list[Any]) -> None:
        if not readable:
            return
        with self._drive:
            for obj in readable:
                if obj is self._bell:
                    self._bell.drain()
                else:
                    self.exchange.fill(obj)

    # -- callers that wait drive the engine themselves ---------------------------------------
    def progress(self) -> bool:
        """Called by a thread waiting on a handle: run a round if one is due and execute
        its responses right here when the executor has nothing queued, instead of
        waking two other threads and being woken back. True if anything ran."""
        if self._error is not None or not self._drive.acquire(False):
            return False
        direct: list[Response] = []
        try:
            ran, _ = self._maybe_round(time.monotonic(), direct)
        except BaseException as exc:  # noqa: BLE001 - the waiting handle gets it
            self._driver_failed(exc)
            ran = True
        finally:
            self._drive.release()
        if direct:
            self.executor.run_claimed(direct)
        return ran

    def spinner_enter(self) -> None:
        # the waiter covers the control thread's idle sleep (``Exchange.cover``)
        with self._lock:
            self.spinners += 1
            first = self.spinners == 1
        if first:
            self.exchange.cover(True)

    def spinner_leave(self) -> None:
        """A waiter stops polling and blocks: what it would have picked up is handed on."""
        with self._lock:
            self.spinners -= 1
            if self.spinners:
                return
        ex = self.exchange
        ex.cover(False)  # the flag back up, a fence: then look
        if (ex.mailboxes is not None and ex.mailboxes.ahead(self._rounds, ex.channels.gone)) \
                or self._has_local():
            if not self.progress():
                self.wake(force=True)

    def _build_message(self) -> tuple[protocol.RoundMessage, bytes]:
        reqs, msg = self.out.take()
        if self.timeline is not None:
            self.timeline.queued(reqs)
        blob = b""
        if reqs:
            msg.announced, msg.wire_announced, blob = self.announcer(reqs)
        if self.autotune.outgoing is not None:
            msg.tune = self.autotune.take()
        return msg, blob

    def _round(self, direct: list[Response] | None) -> None:
        """One negotiation round (hold ``_drive``). Responses whose data moves go to the
        executor, or into ``direct`` when the caller may run them itself (see
        :meth:`Executor.claim`)."""
        msg, blob = self._build_message()
        messages = [protocol.SILENT] * self.size
        blobs: list[bytes] = [b""] * self.size
        messages[self.rank], blobs[self.rank] = msg, blob
        if self.size > 1:  # (the exchange raises a copy of this engine's failure, if any)
            self.exchange.run(self._rounds + 1, protocol.pack_round(msg, blob), messages, blobs,
                              lambda: self._error and fresh_copy(self._error),
                              self.negotiator.shutdown)
        self._rounds += 1
        responses = self.negotiator.apply_round(messages, blobs)
        if self.autotune.after_round(self.negotiator.round, messages[0].tune, responses,
                                     self._tuned):
            self.wake(force=True)
        if self.timeline is not None:
            with self._lock:
                self.timeline.negotiated(self.negotiator.round, responses, self.out.pending)
        if self.rank in messages[0].ask_stacks:
            self.out.post(send_stack=True)
            self.wake()
        for r, m in enumerate(messages):
            if m.stack and self.rank == 0:
                self.stall.record_stack(r, m.stack)
            if m.abort:
                responses = self.negotiator.abort(m.abort.names, m.abort.message,
                                                  "stall") + responses
        self.dispatcher.dispatch(responses, direct)

    def _tuned(self, t: protocol.Tuning) -> None:
        """Apply the autotuner's agreed values (after the round that carried them)."""
        self.negotiator.set_fusion_threshold(t.fusion_threshold_bytes)
        self.cycle_s = t.cycle_time_ms / 1000.0
        self.announcer.set_inline_bytes(t.inline_bytes)
        self.exchange.set_spin(t.spin_time_us / 1e6)

    def _check_waiting(self, now: float) -> None:
        """Tell the peers when this rank is only waiting (see :mod:`.crossed`)."""
        with self._lock:
            pending = bool(self.out.pending)
            quiet_since = self._last_activity
        # agreed data still moving (a slow link) is not waiting either
        busy = not self.executor.idle()
        seen = self._waiting.check(now, pending and self._error is None and not busy,
                                   quiet_since, self.negotiator.progress)
        if seen is not None:
            self.out.post(waiting=seen)
            self.wake(force=True)

    def _check_stalls(self) -> None:
        if self.cfg.stall_check_enabled and self.rank == 0:
            ask, abort = self.stall.check(self.negotiator)
            if ask or abort:
                self.out.post(ask_stacks=ask or None, abort=abort)
                self.wake()

