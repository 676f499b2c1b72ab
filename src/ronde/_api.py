"""The numpy-facing API: lifecycle, topology, and every collective, blocking and async.

Signatures follow Horovod's so a Horovod user's calls work unchanged. Every
collective builds one :class:`~ronde.core.requests.Request` and hands it to the
engine; the ``*_async`` forms return the :class:`~ronde.core.requests.Handle`, the
blocking forms wait on it. Framework bindings reuse these functions through
:func:`submit` with their own allocators (see docs/api.md).
"""

from __future__ import annotations

import atexit
import functools
import threading
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import numpy as np

from . import _state
from ._errors import ArgumentError, ProcessSetError, RondeError, UnsupportedError
from .collectives.ops import Average, ReduceOp, Sum
from .core.requests import (WIRE_DTYPES, Allocator, GroupOfHandles, Handle, Kind, Request,
                            dtype_name)
from .process_sets import ProcessSet, global_process_set

if TYPE_CHECKING:
    from . import _runtime

#: the ops reducescatter supports
REDUCESCATTER_OPS = (ReduceOp.SUM, ReduceOp.AVERAGE)
#: the ops allreduce supports
ALLREDUCE_OPS = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT,
                 ReduceOp.ADASUM)

_lock = threading.RLock()


# -- lifecycle -----------------------------------------------------------------------------
def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Start ronde in this process: find the other ranks, connect, start the engine.

    Args:
        comm: as in Horovod: ``None`` (all ranks), a list of every rank, or an mpi4py
            communicator spanning every process of the job (e.g. ``MPI.COMM_WORLD``
            when mpi4py is already initialised: ronde then shares that MPI). A
            communicator or list covering only some ranks is refused; use a
            :class:`ProcessSet` after ``init()`` instead.
        process_sets: :class:`ProcessSet` objects to register now (every rank must
            pass the same list, in the same order).
    """
    with _lock:
        if _state.current() is not None:
            return
        mpi_comm = comm if comm is not None and hasattr(comm, "Get_size") else None
        if comm is not None and mpi_comm is None and not isinstance(comm, (list, tuple)):
            raise RondeError(f"init(comm={comm!r}): pass None, a list of ranks or an mpi4py "
                             "communicator")
        from . import _runtime

        rt = _runtime.init()
        _state.set_current(rt)
        _at_exit()
        size, me = rt.topo.size, rt.topo.rank
        if mpi_comm is not None:
            ok = mpi_comm.Get_size() == size and mpi_comm.Get_rank() == me
            shown = f"an MPI communicator of {mpi_comm.Get_size()} processes (rank " \
                    f"{mpi_comm.Get_rank()})"
        elif comm is not None:
            ok = sorted(int(r) for r in comm) == list(range(size))
            shown = str(list(comm))
        else:
            ok, shown = True, ""
        if not ok:
            _state.set_current(None)
            _runtime.shutdown(rt)
            raise RondeError(f"init(comm={shown}): ronde's world is every one of the {size} "
                             f"ranks (this is rank {me}); a subset is not supported: init() "
                             "with all ranks, then use a ProcessSet")
        global_process_set._bind(0, list(range(size)), me)
    for ps in process_sets or ():
        add_process_set(ps)


@functools.cache
def _at_exit() -> None:
    """Shut down at the interpreter's exit (registered once, after the runtime's own
    clean-up, so it runs first)."""
    def quietly() -> None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - never fail the interpreter's exit
            pass

    atexit.register(quietly)


def shutdown() -> None:
    """Stop the engine and close every connection; ``init()`` may be called again."""
    if _state.thread_runtime() is not None:
        return  # threads as ranks: the harness stops the thread's runtime
    with _lock:
        rt = _state.set_current(None)
        if rt is None:
            return
        from .process_sets import _registered

        for ps in list(_registered.values()):
            if ps is not global_process_set:
                ps._unbind()
        _registered.clear()
        from . import _runtime

        _runtime.shutdown(rt)


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _state.current() is not None


#: the running job's runtime (raises NotInitializedError before init)
runtime = _state.require


def rank() -> int:
    """This process's rank, 0..size()-1."""
    return runtime().topo.rank


def size() -> int:
    """Number of processes in the job."""
    return runtime().topo.size


def local_rank() -> int:
    """Rank among the processes on this host (use it to pin a device)."""
    return runtime().topo.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return runtime().topo.local_size


def cross_rank() -> int:
    """Index of this host among the hosts that run a process with this local rank."""
    return runtime().topo.cross_rank


def cross_size() -> int:
    """Number of hosts that run a process with this local rank."""
    return runtime().topo.cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    return runtime().topo.homogeneous


def active_transport() -> str:
    """The transport of the global process set: ``shm``, ``tcp`` or ``self``."""
    return runtime().transport


# -- plumbing shared with the framework bindings -----------------------------------------
def _auto_name(kind: str, ps_id: int) -> str:
    key = (kind, ps_id)
    counters = _state.require().counters
    with _lock:
        n = counters.get(key, 0)
        counters[key] = n + 1
    return f"{kind}.noname.{n}"  # submit() scopes it by process set


def auto_name(kind: str, name: str | None = None,
              process_set: ProcessSet | None = None) -> str:
    """``name``, or the next automatic name of ``kind`` on the process set (counted per
    kind and set, so a set's members stay in step; :func:`submit` scopes it by set)."""
    return name if name is not None else _auto_name(kind, _ps_id(process_set))


def group_names(kind: str, name: str | None, n: int,
                process_set: ProcessSet | None = None) -> list[str]:
    """The member names of a grouped collective: ``<name>.<i>`` (automatic base if None)."""
    base = auto_name(kind, name, process_set)
    return [f"{base}.{i}" for i in range(n)]


def set_size(process_set: ProcessSet | None = None) -> int:
    """Number of ranks in a process set (the job's size for the global set)."""
    ps = process_set if process_set is not None else global_process_set
    return len(ps.ranks) if ps.ranks is not None else size()


def set_rank(process_set: ProcessSet | None = None) -> int:
    """This process's index within a process set (its rank for the global set)."""
    ps = process_set if process_set is not None else global_process_set
    return ps.rank() if ps.ranks is not None else rank()


def _ps_id(process_set: ProcessSet | None) -> int:
    ps = process_set if process_set is not None else global_process_set
    if ps.process_set_id is None:
        raise ProcessSetError(f"{ps!r} is not registered; call ronde.add_process_set() on every rank "
                         "first (or pass it to init())")
    return ps.process_set_id


def as_array(tensor: Any, what: str) -> np.ndarray:
    """A C-contiguous numpy view of ``tensor`` (a copy only if it was not contiguous)."""
    arr = np.asarray(tensor)
    if arr.dtype == object:
        raise TypeError(f"{what}: cannot send an object array; use broadcast_object/"
                        "allgather_object for Python objects")
    if dtype_name(arr.dtype) not in WIRE_DTYPES:
        raise TypeError(f"{what}: dtype {arr.dtype} is not supported; use a numeric dtype "
                        f"({', '.join(sorted(WIRE_DTYPES))})")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def waited_by() -> Callable[[int], None]:
    """The engine's ``waited_by`` (a binding keeps it for its job generation)."""
    return runtime().engine.waited_by


def bucket_memory(nbytes: int) -> np.ndarray | None:
    """Memory for a gradient bucket that the steady lane reduces where it lies (or None)."""
    return runtime().engine.lane.buffer(nbytes)


def together() -> ContextManager[None]:
    """Collectives started inside are announced together (one negotiation round): what
    grouped collectives use, so a group is negotiated and fused as one."""
    return runtime().engine.batch()


def submit(kind: Kind, array: np.ndarray | None, name: str | None, process_set: ProcessSet | None,
           **kwargs: Any) -> Handle:
    """Hand one request to the engine and return its handle (bindings use this)."""
    rt = runtime()
    ps_id, name = _scoped(rt, kind, name, process_set)
    req = Request(kind, name, array, ps_id=ps_id, **kwargs)
    return rt.engine.submit(req).handle


def _scoped(rt: "_runtime.Runtime", kind: Kind, name: str | None,
            process_set: ProcessSet | None) -> tuple[int, str]:
    """The process set id of a call and its name, scoped by the process set (checked:
    only members may call collectives on a process set)."""
    if process_set is None or process_set.process_set_id == 0:  # the global set
        return 0, name if name is not None else _auto_name(kind.name.lower(), 0)
    ps_id = _ps_id(process_set)  # raises for a set not registered
    ps = process_set
    assert ps is not None and ps.ranks is not None
    if rt.topo.rank not in ps.ranks:
        raise ProcessSetError(f"rank {rt.topo.rank} called {kind.name.lower()} on process set "
                         f"{ps.ranks}, which it is not a member of; only members may call "
                         "collectives on a process set")
    if name is None:
        name = _auto_name(kind.name.lower(), ps_id)
    return ps_id, f"ps{ps_id}/{name}"  # names are scoped by process set, as in Horovod


def resolve_op(op: Any, average: bool | None = None, *, what: str = "",
               allowed: Sequence[ReduceOp] | None = None) -> ReduceOp:
    """Horovod's ``op``/``average`` arguments as one ``ReduceOp`` (default Average).

    With ``allowed``, any other op raises :class:`~ronde.UnsupportedError` (a
    ``RuntimeError`` and a ``ValueError``, as Horovod's frameworks raise) naming ``what``.
    """
    resolved = _resolve_op(op, average)
    if allowed is not None and resolved not in allowed:
        names = " or ".join(o.name.capitalize() for o in allowed)
        raise UnsupportedError(f"{what or 'this collective'} does not support "
                               f"op={resolved.name.capitalize()}; use {names}")
    return resolved


def _resolve_op(op: Any, average: bool | None) -> ReduceOp:
    if average is None and type(op) is ReduceOp:
        return op
    if average is not None and op is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return Average
    try:
        return ReduceOp(int(op))
    except ValueError:
        raise ValueError(f"unknown reduction op {op!r}; use ronde.Average, Sum, Min, Max or "
                         "Product") from None


def poll(handle: Handle) -> bool:
    """True if the async operation behind ``handle`` finished."""
    return handle.poll()


def synchronize(handle: Handle) -> Any:
    """Wait for an async operation and return its result (or raise its error)."""
    return handle.wait()


# -- collectives ---------------------------------------------------------------------------
def allreduce_async(tensor: Any, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None, *, out: np.ndarray | None = None,
                    alloc: Allocator | None = None) -> Handle:
    """Start an allreduce; ``synchronize()`` the handle for the reduced array."""
    arr = as_array(tensor, "allreduce")
    resolved = _resolve_op(op, average)
    if resolved == ReduceOp.ADASUM and arr.dtype.kind != "f":
        raise UnsupportedError(f"allreduce: op=Adasum needs floating-point tensors, got "
                               f"{arr.dtype} (use Sum or Average for integers)")
    rt = runtime()  # the hot path of a training step: no keyword forwarding
    ps_id, name = _scoped(rt, Kind.ALLREDUCE, name, process_set)
    req = Request(Kind.ALLREDUCE, name, arr, ps_id=ps_id, op=resolved,
                  prescale=prescale_factor, postscale=postscale_factor, out=out, alloc=alloc)
    return rt.engine.submit(req).handle


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet | None = None) -> np.ndarray:
    """Reduce ``tensor`` over all ranks of the process set (default: Average)."""
    return allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                           process_set).wait()


#: Horovod's name for a handle over several handles (``wait()`` returns the list)
GroupHandle = GroupOfHandles


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet | None = None, *,
                    alloc: Allocator | None = None) -> Handle:
    """Start an allgather (first dimension may differ per rank)."""
    arr = as_array(tensor, "allgather")
    if arr.ndim == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; "
                         "reshape scalars to shape (1,)")
    return submit(Kind.ALLGATHER, arr, name, process_set, alloc=alloc)


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet | None = None) -> np.ndarray:
    """Concatenate every rank's tensor along the first dimension, in rank order."""
    return allgather_async(tensor, name, process_set).wait()


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet | None = None, *, out: np.ndarray | None = None,
                    alloc: Allocator | None = None) -> Handle:
    """Start a broadcast from ``root_rank`` (a global rank)."""
    arr = as_array(tensor, "broadcast")
    return submit(Kind.BROADCAST, arr, name, process_set, root=int(root_rank), out=out,
                  alloc=alloc)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None) -> np.ndarray:
    """Return the root rank's tensor on every rank."""
    return broadcast_async(tensor, root_rank, name, process_set).wait()


def alltoall_async(tensor: Any, splits: Sequence[int] | None = None, name: str | None = None,
                   process_set: ProcessSet | None = None, *,
                   alloc: Allocator | None = None) -> Handle:
    """Start an alltoall; see :func:`alltoall`."""
    arr = as_array(tensor, "alltoall")
    if arr.ndim == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    rt = runtime()
    ps = process_set if process_set is not None else global_process_set
    n = len(ps.ranks) if ps.ranks is not None else rt.topo.size
    if splits is not None:
        splits = [int(s) for s in np.asarray(splits).reshape(-1)]
        if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != arr.shape[0]:
            raise ArgumentError(f"alltoall splits {splits} must be {n} non-negative counts summing "
                             f"to the first dimension ({arr.shape[0]})")
    elif arr.shape[0] % n:
        raise ArgumentError(f"alltoall without splits needs the first dimension ({arr.shape[0]}) "
                         f"divisible by the number of ranks ({n}); pass splits=")
    given = splits is not None

    def finish(req: Request, value: Any) -> Any:
        return value if given else value[0]

    return submit(Kind.ALLTOALL, arr, name, process_set, splits=splits, alloc=alloc,
                  finish=finish)


def alltoall(tensor: Any, splits: Sequence[int] | None = None, name: str | None = None,
             process_set: ProcessSet | None = None) -> Any:
    """Send block i of ``tensor`` (rows ``splits[i]``, or equal blocks) to rank i.

    Returns the concatenation of the blocks received, in rank order; when
    ``splits`` is given, returns ``(output, received_splits)`` as Horovod does.
    """
    return alltoall_async(tensor, splits, name, process_set).wait()


def reducescatter_async(tensor: Any, op: Any = None, name: str | None = None,
                        process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *,
                        alloc: Allocator | None = None) -> Handle:
    """Start a reducescatter; see :func:`reducescatter`."""
    arr = as_array(tensor, "reducescatter")
    if arr.ndim == 0:
        raise UnsupportedError("reducescatter needs a tensor with at least one dimension; "
                               "reshape scalars to shape (1,)")
    resolved = resolve_op(op, None, what="reducescatter", allowed=REDUCESCATTER_OPS)
    return submit(Kind.REDUCESCATTER, arr, name, process_set, op=resolved,
                  prescale=prescale_factor, postscale=postscale_factor, alloc=alloc)


def reducescatter(tensor: Any, op: Any = None, name: str | None = None,
                  process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce over ranks and give rank r its slice of the first dimension.

    The first dimension is split as evenly as possible, earlier ranks taking one
    extra row when it does not divide (as Horovod does). Default op: Average.
    """
    return reducescatter_async(tensor, op, name, process_set, prescale_factor,
                               postscale_factor).wait()


def barrier(process_set: ProcessSet | None = None) -> None:
    """Return once every rank of the process set reached the barrier."""
    submit(Kind.BARRIER, None, None, process_set).wait()


def join(device: int = -1, process_set: ProcessSet | None = None) -> int:
    """Signal that this rank has no more data; return the rank that joined last.

    Until every rank has joined, this rank keeps taking part in the other ranks'
    allreduces with zeros, and ``Average`` still divides by the number of ranks in
    the set, as in Horovod. Other collectives fail with ``JoinedError`` meanwhile.
    """
    rt = runtime()
    ps_id = _ps_id(process_set)
    req = Request(Kind.JOIN, f"join.{ps_id}", None, ps_id=ps_id)
    return int(rt.engine.submit(req).handle.wait())


# -- process sets --------------------------------------------------------------------------
def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank must call this with the same ranks."""
    rt = runtime()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    ranks = sorted(int(r) for r in ps.ranks or ())
    if not ranks or ranks[0] < 0 or ranks[-1] >= rt.topo.size or len(set(ranks)) != len(ranks):
        raise ValueError(f"process set ranks {ranks} must be distinct ranks in 0..{rt.topo.size - 1}")
    req = Request(Kind.BARRIER, f"process_set.add.{ranks}", None)
    ps_id = rt.engine.request_process_set("add", ranks, req).handle.wait()
    ps._bind(int(ps_id), ranks, rt.topo.rank)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective over all ranks)."""
    rt = runtime()
    if process_set.process_set_id in (None, 0):
        return False
    ps_id = process_set.process_set_id
    req = Request(Kind.BARRIER, f"process_set.remove.{ps_id}", None)
    rt.engine.request_process_set("remove", ps_id, req).handle.wait()
    process_set._unbind()
    return True


# -- timeline ------------------------------------------------------------------------------
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline (rank 0; ``{rank}`` in the path: every rank).

    Open the file in chrome://tracing or https://ui.perfetto.dev. It stays loadable
    even if the job is killed while writing it.
    """
    from . import _runtime

    rt = runtime()
    _runtime.start_timeline(rt.engine, file_path, rt.topo.rank, mark_cycles)


def stop_timeline() -> None:
    """Stop and close the timeline started by ``start_timeline`` or ``RONDE_TIMELINE``."""
    rt = runtime()
    tl = rt.engine.set_timeline(None)
    if tl is not None:
        tl.close()


Callback = Callable[[Handle], None]
