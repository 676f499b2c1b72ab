"""The executor: runs agreed responses, in order, on this rank's communicators.

Where it sits in the engine cycle: the thread that ran a negotiation round hands its
responses out (``dispatch.py``), each resolved there with what running it takes (its
requests, the process set's members, this rank's communicator); the executor thread
takes them one by one, in the same order on every rank, and moves the data (fusion,
the collective, unpacking) from what the response carries alone. Running data on its
own thread means negotiation of the next tensors overlaps the transfer of the current
ones, and a slow collective in one process set never blocks negotiation.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .._errors import (DeadlockError, DuplicateNameError, JoinedError, PeerLostError, RondeError,
                       ShutdownError, StallError, TensorMismatchError, fresh_copy)
from ..collectives.ops import ReduceOp, as_sum
from ..collectives import adasum, fusion
from ..collectives.allreduce import even_counts
from ..transport.strategies import AllreducePlan, run_allreduce
from . import planner
from .negotiation import Response, any_meta
from .requests import Kind, Meta, Request, fail_all, resolve_dtype
from .timeline import now_us

if TYPE_CHECKING:
    from ..transport.base import Communicator
    from ..transport.ready import Doorbell
    from .timeline import Timeline

log = logging.getLogger(__name__)

_ERRORS: dict[str, type[RondeError]] = {
    "mismatch": TensorMismatchError,
    "duplicate": DuplicateNameError,
    "shutdown": ShutdownError,
    "joined": JoinedError,
    "stall": StallError,
    "deadlock": DeadlockError,
}

_STOP = object()


def _numel(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


class Executor:
    """Consumes :class:`Response` objects on a dedicated thread.

    Each response carries what running it takes (``dispatch.py`` resolved it), so the
    executor looks nothing up and never calls back into the engine but to raise the
    abort: it is given this rank, ``failed()`` (the engine's failure, or None: the
    abort it checks), ``fail(exc)`` (raise it: a lost peer or a shutdown seen in a
    collective) and the control thread's doorbell, which it rings as it runs out of
    work where the control thread asked for that (``Doorbell.wanted``: a round waits
    for it); the engine sets :attr:`timeline` with its own."""

    def __init__(self, rank: int, failed: Callable[[], BaseException | None],
                 fail: Callable[[BaseException], None], bell: "Doorbell") -> None:
        self.rank = rank
        self.failed = failed  #: the engine's failure, or None
        self._fail = fail
        self._bell = bell
        self.timeline: "Timeline | None" = None  #: the engine's (``Engine.set_timeline``)
        self.queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        #: a response is running (on this thread, or on a caller that claimed it)
        self.busy = False
        #: responses queued and not finished yet (changed under ``_count_lock``)
        self._outstanding = 0
        self._count_lock = threading.Lock()
        self._wake_loop = threading.Event()
        self._fusion = fusion.FusionBuffer()
        self._thread = threading.Thread(target=self._loop, name="ronde-executor", daemon=True)
        self._marks: list[tuple[str, float]] | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float, error: BaseException) -> None:
        """Stop the thread (what is queued before runs first, up to ``timeout_s``); the
        requests of anything still queued then fail with ``error``."""
        self.queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                fail_all(item.reqs, fresh_copy(error), item.kind.name.lower())

    def idle(self) -> bool:
        return not self.busy and self._outstanding == 0

    def drain(self, timeout_s: float, healthy: Callable[[], bool]) -> None:
        """Let what was agreed finish (before leaving at shutdown), while ``healthy()``."""
        deadline = time.monotonic() + timeout_s
        while not self.idle() and time.monotonic() < deadline and healthy():
            time.sleep(0.001)

    def enqueue(self, resp: Response) -> None:
        """Queue a response for this thread (the agreed order is the queue order)."""
        with self._count_lock:
            self._outstanding += 1
        self.queue.put(resp)

    def claim(self) -> bool:
        """Let the calling thread (a waiter driving a round) run responses itself.

        Only when nothing is queued or running: every response agreed before has
        finished, so running these now keeps the agreed order; responses queued after
        this claim wait in the queue until :meth:`run_claimed` is done (``busy``).
        Call with the engine's drive lock held (the only place responses are queued).
        """
        if self.busy or self._outstanding:
            return False
        self.busy = True
        return True

    def run_claimed(self, responses: list[Response]) -> None:
        """Run responses claimed with :meth:`claim` on this thread, then release."""
        try:
            for resp in responses:
                self.run_one(resp)
        finally:
            self.busy = False
            if self._outstanding:
                self._wake_loop.set()
            else:
                self._bell.ring_if_wanted()

    def run_one(self, item: Response) -> None:
        """Run ``item`` (with its followers) here; a failure fails its requests, and a
        lost peer or a shutdown stops the engine (the steady lane runs its collectives
        with this too)."""
        for part in self._parts(item) if item.followers else (item,):
            try:
                self.execute(part)
            except BaseException as exc:  # noqa: BLE001 - fail the requests, keep serving
                self._failed_running(exc, part)

    def _failed_running(self, exc: BaseException, resp: Response) -> None:
        """A response failed here (its requests failed already): a lost peer or a
        shutdown stops the engine; anything else is logged, the engine goes on."""
        if isinstance(exc, PeerLostError) and self.failed() is None:
            # the control thread may be about to learn the real cause (a peer's notice
            # that another rank was lost first): give it a moment
            deadline = time.monotonic() + 0.3
            while self.failed() is None and time.monotonic() < deadline:
                time.sleep(0.005)
        if isinstance(exc, (PeerLostError, ShutdownError)) or self.failed() is not None:
            self._fail(self.failed() or exc)
        else:
            log.error("collective %r failed on rank %d: %r", resp, self.rank, exc)

    def _parts(self, item: Response) -> list[Response]:
        """What to run for ``item`` (``planner.parts``): with its followers as one
        operation where this rank's communicator takes them so."""
        return planner.parts(item, item.comm.reads_peers)  # type: ignore[union-attr]

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            # a caller may be running claimed responses, agreed before this one
            while self.busy:
                self._wake_loop.wait(0.001)
                self._wake_loop.clear()
            self.busy = True
            try:
                self.run_one(item)
            finally:
                self.busy = False
                with self._count_lock:
                    self._outstanding -= 1
            if self._outstanding == 0:
                self._bell.ring_if_wanted()

    # -- running one response -----------------------------------------------------------
    def execute(self, resp: Response) -> None:
        """Run one response from what it carries (``dispatch.py``)."""
        reqs = resp.reqs
        if resp.error is not None:
            cls = _ERRORS.get(resp.error_type, RondeError)
            for req in reqs:
                if req is not None:
                    exc = cls(resp.error)
                    if cls is ShutdownError:
                        exc.rank = resp.value  # type: ignore[attr-defined]
                    req.fail(exc)
            return
        failed = self.failed()
        if failed is not None:  # its requests left the outbox: they fail here
            fail_all(reqs, fresh_copy(failed), resp.kind.name.lower())
            return
        if resp.kind == Kind.JOIN:
            if reqs[0] is not None:
                reqs[0].complete(resp.value)
            return
        comm, members = resp.comm, resp.members
        self._marks = marks = [] if self.timeline is not None else None
        try:
            handler = _HANDLERS[resp.kind]
            if marks is not None:
                marks.append(("start", now_us()))
            handler(self, resp, reqs, comm, members)
            if marks is not None:
                self._record(resp)
        except BaseException as exc:
            fail_all(reqs, exc, resp.kind.name.lower())
            raise

    def _mark(self, phase: str) -> None:
        if self._marks is not None:
            self._marks.append((phase, now_us()))

    def _record(self, resp: Response) -> None:
        """Turn the marks of this response into timeline phases for each tensor."""
        tl, marks = self.timeline, self._marks
        if tl is None or not marks:
            return
        marks.append(("end", now_us()))
        args = {"fused": len(resp.names)} if len(resp.names) > 1 else None
        for (phase, start), (_, end) in zip(marks[1:-1], marks[2:]):
            for name in resp.names:
                tl.phase(name, phase, start, end, args)
        for name in resp.names:
            tl.phase(name, resp.kind.name, marks[0][1], marks[-1][1], args)

    # -- per kind ------------------------------------------------------------------------
    def _allreduce(self, resp: Response, reqs: list[Request | None], comm: Communicator,
                   members: list[int]) -> None:
        meta0 = any_meta(resp.metas[0])
        dtype = resolve_dtype(meta0.dtype)
        op, post = as_sum(ReduceOp(meta0.op), meta0.postscale, len(members))
        if op == ReduceOp.ADASUM:
            self._adasum(resp, reqs, comm, members, dtype, meta0.prescale, post)
            return
        if meta0.device:
            shapes = [any_meta(m).shape for m in resp.metas]
            self._mark("TRANSFER")
            outs_dev = _device_backend(resp).allreduce(
                resp.ps_id, members, [None if r is None else r.device for r in reqs], shapes,
                meta0.dtype, op, meta0.prescale, post,
                [None if r is None else r.out for r in reqs])
            for req, out in zip(reqs, outs_dev):
                if req is not None:
                    req.complete(out)
            return
        # one loop, no helper calls: this runs for every allreduce (a training step's
        # buckets), and each Python call counts (issue #34)
        shapes, sizes, inputs, outputs = [], [], [], []
        missing = False
        for m, r in zip(resp.metas, reqs):
            shape = m[min(m)].shape  # any rank's (``any_meta``)
            shapes.append(shape)
            sizes.append(int(math.prod(shape)))
            if r is None:
                missing = True
                inputs.append(None)
                outputs.append(None)
            else:
                inputs.append(r.array)
                outputs.append(r.out)
        plan = AllreducePlan(
            comm, inputs, outputs, sizes, dtype, op, meta0.prescale, post,
            sum(sizes) * dtype.itemsize, bool(resp.joined) or missing,
            lambda i: None if reqs[i] is None else reqs[i].allocate(shapes[i], dtype),
            self._fusion.get, self._mark if self._marks is not None else None, resp.resident)
        outs = run_allreduce(plan)
        for req, out in zip(reqs, outs):
            if req is not None:
                req.complete(out)

    def _adasum(self, resp: Response, reqs: list[Request | None], comm: Communicator,
                members: list[int], dtype: np.dtype, pre: float, post: float) -> None:
        """Adasum (``collectives/adasum.py``): allgather the fused contributions, then
        every rank combines the same rows, tensor by tensor, into the same result."""
        shapes = [any_meta(m).shape for m in resp.metas]
        sizes = [_numel(s) for s in shapes]
        bounds = np.cumsum([0, *sizes])
        segments = [(int(bounds[i]), int(bounds[i + 1])) for i in range(len(sizes))]
        total, n = int(bounds[-1]), len(members)
        self._mark("MEMCPY_IN_FUSION_BUFFER")
        mine = np.zeros(total, dtype)  # a joined rank contributes zeros: it changes nothing
        for (lo, hi), req in zip(segments, reqs):
            if req is not None and req.array is not None:
                mine[lo:hi] = req.array.reshape(-1)
        if pre != 1.0:
            mine *= dtype.type(pre)
        rows = np.empty((n, total), dtype)
        self._mark("TRANSFER")
        comm.allgatherv(mine, rows.reshape(-1), [total] * n)
        self._mark("ADASUM")
        result = np.empty(total, dtype)
        adasum.combine(rows, segments, result)
        if post != 1.0:
            result *= dtype.type(post)
        for (lo, hi), req, shape in zip(segments, reqs, shapes):
            if req is not None:
                out = req.out if req.out is not None else req.allocate(shape, dtype)
                out.reshape(-1)[:] = result[lo:hi]
                req.complete(out)

    def _allgather(self, resp: Response, reqs: list[Request | None], comm: Communicator,
                   members: list[int]) -> None:
        metas, req = resp.metas[0], reqs[0]
        meta = metas[self.rank]
        dtype = resolve_dtype(meta.dtype)
        row = _numel(meta.shape[1:])
        firsts = [metas[r].shape[0] if metas[r].shape else 1 for r in members]
        out_shape = (sum(firsts),) + meta.shape[1:] if meta.shape else (sum(firsts),)
        out = req.allocate(out_shape, dtype)  # type: ignore[union-attr]
        comm.allgatherv(req.array.reshape(-1), out.reshape(-1),  # type: ignore[union-attr]
                        [f * row for f in firsts])
        req.complete(out)  # type: ignore[union-attr]

    def _broadcast(self, resp: Response, reqs: list[Request | None], comm: Communicator,
                   members: list[int]) -> None:
        req = reqs[0]
        meta = resp.metas[0][self.rank]
        root = members.index(meta.root)
        if meta.device:
            assert req is not None
            self._mark("TRANSFER")
            req.complete(_device_backend(resp).broadcast(resp.ps_id, members, req.device,
                                                         meta.root, req.out))
            return
        assert req is not None and req.array is not None
        out = req.out if req.out is not None else req.allocate(meta.shape,
                                                               resolve_dtype(meta.dtype))
        if comm.rank == root and out is not req.array:
            np.copyto(out, req.array)
        comm.broadcast(out.reshape(-1), root)
        req.complete(out)  # type: ignore[union-attr]

    def _alltoall(self, resp: Response, reqs: list[Request | None], comm: Communicator,
                  members: list[int]) -> None:
        req, metas = reqs[0], resp.metas[0]
        me = self.rank
        meta = metas[me]
        dtype = resolve_dtype(meta.dtype)
        row = _numel(meta.shape[1:])
        n = len(members)

        def splits_of(m: Meta) -> list[int]:
            if m.splits is not None:
                return list(m.splits)
            return [m.shape[0] // n] * n

        matrix = [splits_of(metas[r]) for r in members]
        idx = members.index(me)
        send_rows = matrix[idx]
        recv_rows = [matrix[j][idx] for j in range(n)]
        out = req.allocate((sum(recv_rows),) + meta.shape[1:], dtype)  # type: ignore[union-attr]
        max_count = max((max(s) for s in matrix), default=0) * row
        kwargs = {"max_count": max_count} if comm.alltoall_takes_max_count else {}
        comm.alltoallv(req.array.reshape(-1), [s * row for s in send_rows],  # type: ignore[union-attr]
                       out.reshape(-1), [s * row for s in recv_rows], **kwargs)
        req.complete((out, np.asarray(recv_rows, dtype=np.int32)))  # type: ignore[union-attr]

    def _reducescatter(self, resp: Response, reqs: list[Request | None], comm: Communicator,
                       members: list[int]) -> None:
        req = reqs[0]
        meta = resp.metas[0][self.rank]
        dtype = resolve_dtype(meta.dtype)
        n = len(members)
        first = meta.shape[0] if meta.shape else 1
        row = _numel(meta.shape[1:])
        rows = even_counts(first, n)
        op, post = as_sum(ReduceOp(meta.op), meta.postscale, n)
        src = req.array.reshape(-1)  # type: ignore[union-attr]
        if meta.prescale != 1.0:
            scaled = np.empty_like(src)
            fusion.scaled_copy(scaled, src, meta.prescale)
            src = scaled
        elif not comm.reducescatter_keeps_input:
            src = src.copy()  # p2p reducescatter works in place
        out = req.allocate((rows[comm.rank],) + meta.shape[1:], dtype)  # type: ignore[union-attr]
        flat = out.reshape(-1)
        block = comm.reducescatter(src, [r * row for r in rows], op, out=flat)
        if block is flat:  # the transport reduced straight into the output
            fusion.scale_inplace(flat, post)
        else:
            fusion.scaled_copy(flat, block, post)
        req.complete(out)  # type: ignore[union-attr]

    def _barrier(self, resp: Response, reqs: list[Request | None], comm: Communicator,
                 members: list[int]) -> None:
        comm.barrier()
        for req in reqs:
            if req is not None:
                req.complete(None)


def _device_backend(resp: Response) -> Any:
    from . import device

    found = device.backend()
    if found is None:
        raise RondeError(f"{resp.kind.name.lower()} {resp.names[0]!r} holds accelerator "
                         "tensors, but no device backend is registered in this process "
                         "(import the framework binding, e.g. ronde.torch, on every rank)")
    return found


_HANDLERS: dict[Kind, Callable[..., None]] = {
    Kind.ALLREDUCE: Executor._allreduce,
    Kind.ALLGATHER: Executor._allgather,
    Kind.BROADCAST: Executor._broadcast,
    Kind.ALLTOALL: Executor._alltoall,
    Kind.REDUCESCATTER: Executor._reducescatter,
    Kind.BARRIER: Executor._barrier,
}
