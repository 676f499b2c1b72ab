"""The steady lane: a training step's gradient buckets without a negotiation round.

Why. In the steady state of a training loop every step allreduces the same gradient
buckets (``torch/_buckets.py``), and negotiation agrees on the same responses each
time (the memo, ``steady.py``, replays them). A round still costs thread hand-offs, a
frame to every peer and one back: the control thread's ~0.5 ms of CPU a step at np=2
(``scripts/thread_cpu.py``), most of what ronde spent beyond DDP. DDP's reducer runs
no round at all: it trusts every rank to bring the same buckets in the same order (and
hangs, or averages unrelated values, where they do not). The lane skips the round and
checks instead, in the data path.

How.

* **Entering, agreed.** The dispatcher shows the lane every resolved response
  (:meth:`Lane.observe`, on the thread that ran the round, in the agreed order, so
  every rank sees the same ones in the same order). A gradient bucket's allreduce (its
  name ends ``.bucket<k>.<n>``) of the global set (alone or fused with others, with
  no joined rank, not inline, not on a device, not Adasum), agreed :data:`AGREED`
  times with the same metadata, enters the table with a tag (its place in the
  table). Only agreed responses decide, so every rank's table is the same.
* **Taking it.** ``Engine.submit`` offers the lane each request while the table is not
  empty (:meth:`Lane.take`: one dict lookup for the others). A request of a name in the
  table, with the metadata agreed, gets the next meeting number (each rank counts its
  own) and goes to the lane's thread (``ronde-lane``); or the submitting thread runs it
  at once when it waits for it next (the step's last bucket: ``Engine.waited_by``) and
  the lane is idle; a caller waiting on a queued one runs it itself if the thread has
  not started it (``_Waiters.drive``).
* **Checking, in band.** Before the data moves, every member brings the tag to the
  meeting of that number on the lane's own shared-memory communicator
  (``ShmCommunicator.meet``) and reads everyone's. All equal: the collective runs, with
  the executor's own code (``Executor.run_one``) on the response agreed for that name,
  as the general path would have run it. Anything else (a rank brought another bucket,
  or its buckets in another order; one whose bucket's shape, dtype or scales changed,
  or that submitted it twice, brings :data:`NO`): every rank reads the same tags, so
  every rank *breaks* the lane at that meeting: this request and every later one go to
  the general path (``resubmit``), which fails or proceeds as it does for any request.
  A rank that joins (``hvd.join``) or shuts down brings ``NO`` to its next meeting
  without waiting, so nobody waits for it there.
* **Starting again, agreed.** Once broken, a name of the table reaches negotiation on
  every rank; the first such response agreed by all (no joined rank, no error) starts a
  new *epoch* everywhere at the same point: an empty table that fills as before (two
  more agreements). Tags and meeting numbers carry the epoch, so a rank still at an old
  meeting never takes a new one's tag for its own.
* **Apart, so nothing deadlocks.** Its own thread and communicator: a negotiated
  collective on the executor (another thread's, an asynchronous one) and a lane
  collective never wait for each other in one queue, in whatever order each rank
  reaches them.
* **Resident buckets.** torch allocates its buckets in this communicator's segment
  (:meth:`Lane.buffer`, ``ShmCommunicator.resident``); each rank brings the bucket's
  offset to the meeting, and where all agree (and it is reduced in place) the data
  moves with plain loads where it lies (``allreduce_resident``), the meeting serving as
  the op's first synchronisation. Otherwise the usual shm paths run, on every rank alike.
* **Sleeping, never polling.** The lane's communicator (``Factory.lane``) waits on
  futexes only, where the general path's waits poll while a thread waits for a result:
  a training step keeps every core busy with some rank's backward pass, so a poller
  takes CPU from a peer it waits for. Measured with ``python -m ronde.bench train``
  (transformer, np=2, this 2-core machine): the paired extra CPU a step 1.55 ms polling,
  1.23 without, samples/s the same (2,223 and 2,237).

Not covered (they keep the general path): other process sets; transports other than
``shm`` (multi-host jobs, MPI, Gloo); ``RONDE_STEADY_LANE=0``. The stall inspector does
not see lane collectives: a meeting that waits ``RONDE_STALL_CHECK_TIME`` logs a
warning naming the rank waited for, and one that waits
``RONDE_STALL_SHUTDOWN_TIME`` fails as a lost peer. In the timeline a lane collective's
NEGOTIATE phase is its meeting (args ``steady_lane``).
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from .._errors import ShutdownError, fresh_copy
from ..collectives.ops import ReduceOp
from .executor import Executor
from .requests import Handle, Kind, Request
from .responses import Response
from .timeline import now_us

if TYPE_CHECKING:
    import numpy as np

    from ..transport.base import Communicator
    from ..transport.ready import Doorbell
    from .timeline import Timeline

log = logging.getLogger(__name__)

#: agreed responses of a bucket before it takes the lane
AGREED = 2
#: the tag of a rank that leaves the lane (a changed bucket, a join, a shutdown)
NO = 0
_BUCKET = re.compile(r"\.bucket\d+\.\d+$")
#: a tag is (epoch, place in the table); an epoch's meetings are numbered from epoch << 40
_TAG_BITS, _MEETING_BITS = 20, 40


class _Entry(NamedTuple):
    """A name in the lane's table: what was agreed for it."""

    tag: int
    raw: list[Any]  #: this rank's request metadata (``Request.meta()``) as agreed
    metas: list[Any]  #: the response's metas (every member's)
    nbytes: int
    fuse_key: Any
    members: list[int]


#: a queued item: (request or None for NO, its entry, meeting number, connect for NO,
#: the lane's epoch when it was queued)
_Item = tuple["Request | None", "_Entry | None", int, bool, int]


class _Waiters:
    """What a lane handle's wait drives: a caller runs a queued lane collective itself
    when the lane's thread has not started it; ``sleeping`` counts the callers asleep on
    one (``Handle`` keeps it; the lane's waits never poll, so nothing reads it)."""

    def __init__(self, lane: "Lane") -> None:
        self.lane = lane
        self.sleeping = 0

    def drive(self, handle: Handle) -> bool:
        self.lane.run_here()
        return handle.poll()


class Lane:
    """The steady lane of one engine (module docstring).

    Args:
        rank: this rank.
        make: builds the lane's communicator of the global set (a second ``shm`` one,
            ``Factory.lane``), or None: no lane (every request goes the general way).
        failed, fail, bell: the engine's failure, its ``fail`` and its control thread's
            doorbell, for the executor code the lane runs collectives with.
        resubmit: hands a request to the general path, its handle kept.
    """

    def __init__(self, rank: int, make: "Callable[[], Communicator] | None",
                 failed: Callable[[], BaseException | None],
                 fail: Callable[[BaseException], None], bell: "Doorbell",
                 resubmit: Callable[[Request], None]) -> None:
        self.rank = rank
        self.enabled = make is not None
        #: name -> what was agreed for it (read without the lock; a new epoch replaces it)
        self.table: dict[str, _Entry] = {}
        self._seen: dict[str, tuple[list[Any], int]] = {}
        self._make = make
        self._comm: "Communicator | None" = None
        self._connecting = threading.Lock()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queue: collections.deque[_Item] = collections.deque()
        self._running = False  #: a lane collective runs (on its thread or a caller's)
        self._meeting = 0  #: the last meeting number given out
        self._leaving = False  #: a NO is queued: later requests go the general way
        self._stopping = False
        self.broken = False
        self.epoch = 0  #: bumped at each agreed restart after a break (``_reset``)
        self._inflight: set[str] = set()
        #: runs the collectives (``Executor.run_one``); its own thread is never started
        self.runner = Executor(rank, failed, fail, bell)
        self._failed, self._fail = failed, fail
        self._resubmit = resubmit
        self.waiters = _Waiters(self)
        self._thread: threading.Thread | None = None
        #: collectives run through the lane, those of them agreed resident (every
        #: member's bucket at one place of its segment: ``buffer``), and breaks (tests
        #: and benchmarks read them)
        self.laned = 0
        self.resident = 0
        self.breaks = 0

    # -- entering (agreed) -----------------------------------------------------------------
    def observe(self, resp: Response) -> None:
        """An agreed response, resolved for this rank: count a bucket's agreements and
        enter it at the :data:`AGREED`-th (module docstring)."""
        if not self.enabled or resp.kind != Kind.ALLREDUCE or resp.ps_id != 0 \
                or resp.joined or resp.inline is not None or resp.error is not None \
                or len(resp.members) < 2:
            return
        for name, req, metas in zip(resp.names, resp.reqs, resp.metas):
            # a fused one counts too: the lane runs it alone, to the same values (every
            # data path reduces element by element in rank order, however tensors fuse)
            if req is None or req.array is None or req.op == ReduceOp.ADASUM \
                    or not _BUCKET.search(name):
                continue
            if name in self.table:  # every rank broke or leaves: the next epoch starts
                self._reset()
            raw = req.meta()
            seen = self._seen.get(name)
            count = seen[1] + 1 if seen is not None and seen[0] == raw else 1
            if count < AGREED:
                self._seen[name] = (raw, count)
                continue
            self._seen.pop(name, None)
            self._enter(name, raw, metas, req.array.nbytes, resp)

    def _enter(self, name: str, raw: list[Any], metas: Any, nbytes: int,
               resp: Response) -> None:
        with self._lock:
            tag = (self.epoch << _TAG_BITS) | (len(self.table) + 1)
            self.table[name] = _Entry(tag, raw, [metas], nbytes, resp.fuse_key,
                                      list(resp.members))
            if self._thread is None:  # it builds the communicator first, off the step
                self._thread = threading.Thread(target=self._loop, name="ronde-lane",
                                                daemon=True)
                self._thread.start()

    # -- taking requests -------------------------------------------------------------------
    def take(self, req: Request, waited: bool) -> bool:
        """Take ``req`` into the lane (True: its handle is set) or leave it to the general
        path (False). ``waited``: the submitting thread waits for it next."""
        entry = self.table.get(req.name)
        if entry is None:
            if req.kind == Kind.JOIN:
                self.leave(True)  # the others stop waiting for this rank at a meeting
            return False
        if self._failed() is not None:
            return False
        with self._lock:
            if self.broken or self._leaving or self._stopping:
                return False
            if req.name in self._inflight or req.meta() != entry.raw:
                self._leave_locked(True)  # every rank breaks at that meeting
                return False
            self._meeting += 1
            item = (req, entry, self._meeting, True, self.epoch)
            req.handle = Handle(req.name, self.waiters)  # type: ignore[arg-type]
            if self.runner.timeline is not None:
                req.t_submit = now_us()
            self._inflight.add(req.name)
            if not (waited and not self._running and not self._queue):
                self._queue.append(item)
                self._ready.notify()
                return True
            self._running = True
        self._run_claimed(item)
        return True

    def leave(self, connect: bool) -> None:
        """This rank stops using the lane (a join, a shutdown): it brings NO to its next
        meeting, without waiting. ``connect``: build the lane's communicator for that
        if it was never built (peers may be waiting for it to attach)."""
        with self._lock:
            if self.table and not (self.broken or self._leaving or self._stopping):
                self._leave_locked(connect)

    def _leave_locked(self, connect: bool) -> None:
        self._leaving = True
        self._meeting += 1
        self._queue.append((None, None, self._meeting, connect, self.epoch))
        self._ready.notify()

    def _reset(self) -> None:
        """A new epoch, at an agreed response (every rank decided to break): an empty
        table that fills again as before. Items of the old epoch still queued fall back
        (a NO is still brought: a peer may wait for it); tags and meeting numbers carry
        the epoch, so no rank mistakes an old epoch's meeting for a new one's."""
        with self._lock:
            self.epoch += 1
            self.table = {}
            self._seen.clear()
            self.broken = self._leaving = False
            self._meeting = self.epoch << _MEETING_BITS

    def buffer(self, nbytes: int) -> "np.ndarray | None":
        """``nbytes`` of this rank's memory for a gradient bucket of the global set that
        the lane then reduces where it lies, in its communicator's segment
        (``ShmCommunicator.resident``), or None: no lane, no room, or its communicator
        could not be built (the lane's thread then fails the engine with that, as
        before). Every member asks at the same agreed step (the bucket layout), so
        building the communicator here, on the caller's thread, meets the others."""
        if not self.enabled or self._failed() is not None:
            return None
        try:
            return self._connect().resident(nbytes)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - a plain buffer serves as well
            log.warning("rank %d: no shared-memory gradient bucket (%r)", self.rank, exc)
            return None

    # -- running ---------------------------------------------------------------------------
    def run_here(self) -> None:
        """A caller waiting on a lane handle runs the next queued collective itself if
        nothing of the lane is running (its wait: ``_Waiters.drive``)."""
        with self._lock:
            if self._running or not self._queue:
                return
            item = self._queue.popleft()
            self._running = True
        self._run_claimed(item)

    def _run_claimed(self, item: _Item) -> None:
        try:
            self._run(item)
        finally:
            with self._lock:
                self._running = False
                if self._queue:
                    self._ready.notify()

    def _connect(self) -> "Communicator":
        """The lane's communicator, built by the first caller (every member builds its
        own at the same agreed point: the lane's thread starts at the first entry)."""
        with self._connecting:
            if self._comm is None:
                assert self._make is not None
                self._comm = self._make()
            return self._comm

    def _loop(self) -> None:
        try:
            self._connect()
        except BaseException as exc:  # noqa: BLE001 - the engine fails with it
            if self._failed() is None:
                self._fail(exc)
            return
        while True:
            with self._lock:
                while (self._running or not self._queue) and not self._stopping:
                    self._ready.wait()
                if self._stopping:
                    return
                item = self._queue.popleft()
                self._running = True
            try:
                self._run(item)
            finally:
                with self._lock:
                    self._running = False

    def _run(self, item: _Item) -> None:
        """One queued item: meet, then run the collective, or break and fall back."""
        req, entry, t, connect, epoch = item
        try:
            if req is not None and (self.broken or epoch != self.epoch):
                self._fall_back(req)
                return
            comm = self._comm
            if comm is None:
                if req is None and not connect:
                    self._break(epoch, "this rank left it")
                    return
                comm = self._connect()
            if req is None or entry is None:  # brought even when broken: harmless then
                comm.meet(t, NO, wait=False)  # type: ignore[attr-defined]
                self._break(epoch, "this rank left it, or changed a bucket")
                return
            timeline = self.runner.timeline
            if timeline is not None:  # QUEUE until now; the meeting is its NEGOTIATE
                timeline.queued([req])
            # where its values lie in the segment, if reduced in place there (the
            # meeting then agrees on the place too: ``Resident``)
            at = -1 if req.out is not req.array \
                else comm.offset_of(req.array)  # type: ignore[attr-defined]
            tags, ats = comm.meet(t, entry.tag, at=at)  # type: ignore[attr-defined]
            if timeline is not None:
                timeline.phase(req.name, "NEGOTIATE", req.t_announce, now_us(),
                               {"steady_lane": 1})
        except BaseException as exc:  # noqa: BLE001 - the request gets it; the engine fails
            if req is not None:
                self._inflight.discard(req.name)
                req.fail(exc)
            if self._failed() is None:
                self._fail(exc)
            return
        if any(tag != entry.tag for tag in tags):
            self._break(epoch, f"at {req.name!r} rank(s) "
                        f"{[m for m, tag in zip(entry.members, tags) if tag != entry.tag]} "
                        "brought another bucket, or none")
            self._fall_back(req)
            return
        resp = Response(Kind.ALLREDUCE, 0, [req.name], entry.metas)
        resp.nbytes, resp.fuse_key = entry.nbytes, entry.fuse_key
        if at >= 0 and all(a == at for a in ats):  # every member's lies at ``at``
            resp.resident = at
            self.resident += 1
        resp.reqs, resp.members, resp.comm = [req], entry.members, comm
        self._inflight.discard(req.name)
        self.runner.run_one(resp)
        self.laned += 1

    def _fall_back(self, req: Request) -> None:
        self._inflight.discard(req.name)
        try:
            self._resubmit(req)
        except BaseException as exc:  # noqa: BLE001 - the engine failed or shuts down
            req.fail(exc)

    def _break(self, epoch: int, why: str) -> None:
        with self._lock:
            if epoch != self.epoch or self.broken:
                return
            self.broken = True
            self.breaks += 1
        log.info("rank %d: the steady lane closed (%s); gradient buckets are negotiated "
                 "until negotiation agrees them again", self.rank, why)

    # -- the end ---------------------------------------------------------------------------
    def set_timeline(self, timeline: "Timeline | None") -> None:
        self.runner.timeline = timeline

    def close(self, timeout_s: float) -> None:
        """Stop the lane's thread (after what is queued, up to ``timeout_s``); anything
        still queued fails with a shutdown error; close the communicator."""
        thread = self._thread
        deadline = time.monotonic() + timeout_s
        while thread is not None and (self._queue or self._running) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            self._stopping = True
            self._ready.notify_all()
            left = list(self._queue)
            self._queue.clear()
        if thread is not None:
            thread.join(timeout_s)
        for req, *_ in left:
            if req is not None:
                req.fail(fresh_copy(self._failed() or ShutdownError(
                    "ronde was shut down while this collective was pending")))
        if self._comm is not None:
            self._comm.close()
            self._comm = None
