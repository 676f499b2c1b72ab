"""The transport registry: which communicator a process set gets, and building it.

``init()`` makes one :class:`Factory` for the job; the engine calls it for the global
set and for every process set added later. :func:`choose` names a transport for the
members (``RONDE_TRANSPORT``, the hosts they are on, the machine), and the builder
registered under that name (:func:`register`) makes the communicator:

========================  ===========================================================
``mpi``                   MPI through mpi4py (the job was started by an MPI launcher)
``gloo``                  a torch.distributed Gloo group (created on every rank)
``self``                  a set of one rank: nothing moves
``shm``                   shared memory, every member on this host (x86-64)
``hierarchical``          shm within each host, a tcp ring across hosts
``tcp``                   point-to-point over the mesh's data sockets
========================  ===========================================================

A new transport is one more builder and one more line in :func:`choose`.
"""

from __future__ import annotations

import dataclasses
import platform
from typing import Any, Callable, Mapping

from .._config import Config
from .._errors import ConfigError
from .base import Communicator, P2PCommunicator, SelfCommunicator
from .segments import Names

#: the engine's failure, or None while it runs
Aborted = Callable[[], "BaseException | None"]


@dataclasses.dataclass
class Context:
    """The job, as the builders see it."""

    cfg: Config
    rank: int
    size: int
    hosts: tuple[str, ...]   #: host key of every rank
    segments: Names          #: where this job's shared-memory segments are
    generation: int
    aborted: Aborted         #: the engine's failure, if any (waits check it)
    mesh: Any = None         #: the connected mesh (None for a job of one)
    mpi_world: Any = None    #: mpi4py's world, when the job runs on MPI
    #: whether a thread of this process waits for a collective's result now: shm waits
    #: poll only then (``shm/counters.py``); None: always
    urgent: Callable[[], bool] | None = None
    #: hosts whose ``/dev/shm`` cannot hold shm segments, and why (``shm_room.py``): the
    #: process sets with a member there run over tcp
    no_shm: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def describe(self, r: int) -> str:
        return f"{r} (host {self.hosts[r]})"


Builder = Callable[[Context, int, list[int]], "Communicator | None"]
BUILDERS: dict[str, Builder] = {}


def register(kind: str) -> Callable[[Builder], Builder]:
    """Register the builder of transport ``kind`` (``builder(ctx, ps_id, members)``)."""
    def deco(fn: Builder) -> Builder:
        BUILDERS[kind] = fn
        return fn
    return deco


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def choose(ctx: Context, members: list[int]) -> str:
    """The transport of a process set with these members (the same on every rank); tcp
    where a member's host has no room for shm segments (``ctx.no_shm``).

    Raises:
        ConfigError: ``RONDE_TRANSPORT=shm`` where it cannot work.
    """
    cfg = ctx.cfg
    if ctx.mpi_world is not None:
        return "mpi"
    if cfg.transport == "gloo" and ctx.size > 1:
        return "gloo"
    if len(members) == 1:
        return "self"
    same_host = len({ctx.hosts[r] for r in members}) == 1
    cramped = [ctx.no_shm[h] for h in dict.fromkeys(ctx.hosts[r] for r in members)
               if h in ctx.no_shm]
    if cfg.transport == "shm":
        if not same_host:
            raise ConfigError(
                "RONDE_TRANSPORT=shm needs every rank of the process set on one host; use "
                "RONDE_TRANSPORT=tcp (or auto) for multi-host jobs")
        if not _x86():
            raise ConfigError(
                "RONDE_TRANSPORT=shm relies on x86-64 memory ordering and is not available on "
                f"{platform.machine()}; use RONDE_TRANSPORT=tcp")
        if cramped:
            raise ConfigError(
                f"RONDE_TRANSPORT=shm: {cramped[0]}; enlarge it (in Docker, --shm-size=1g), "
                "or use RONDE_TRANSPORT=tcp (or auto, which falls back to tcp)")
        return "shm"
    if cfg.transport == "tcp" or not _x86() or cramped:
        return "tcp"
    if same_host:
        return "shm"
    if cfg.hierarchical != "off":
        per_host: dict[str, int] = {}
        for r in members:
            per_host[ctx.hosts[r]] = per_host.get(ctx.hosts[r], 0) + 1
        counts = set(per_host.values())
        if len(counts) == 1 and counts.pop() > 1:
            return "hierarchical"
    return "tcp"


class Factory:
    """``factory(ps_id, members)``: the communicator of this rank in a process set.

    None where this rank is not a member. ``kinds`` records the transport chosen for
    each set (``active_transport()`` reports the global set's).
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.kinds: dict[int, str] = {}

    def __call__(self, ps_id: int, members: list[int]) -> Communicator | None:
        kind = choose(self.ctx, members)
        self.kinds[ps_id] = kind
        return BUILDERS[kind](self.ctx, ps_id, members)

    def lane(self, ps_id: int, members: list[int]) -> Communicator:
        """A second shared-memory communicator of process set ``ps_id`` (an ``shm`` one),
        for the steady lane (``core/lane.py``): its collectives run beside the
        executor's, never interleaved with them on one communicator."""
        assert self.kinds.get(ps_id) == "shm" and self.ctx.rank in members
        return _shm(self.ctx, members, f"ps{ps_id}-lane", poll=False)


def _members_only(fn: Builder) -> Builder:
    def build(ctx: Context, ps_id: int, members: list[int]) -> Communicator | None:
        return fn(ctx, ps_id, members) if ctx.rank in members else None
    build.__doc__ = fn.__doc__
    return build


@register("mpi")
def _mpi(ctx: Context, ps_id: int, members: list[int]) -> Communicator | None:
    """MPI: a sub-communicator (created on every rank, as MPI requires)."""
    from .mpi import MPICommunicator

    return MPICommunicator.create(ctx.mpi_world, members, ctx.rank)


@register("gloo")
def _gloo(ctx: Context, ps_id: int, members: list[int]) -> Communicator | None:
    """Gloo: ``new_group`` is collective over every rank, members or not."""
    from . import torch_dist

    group = torch_dist.new_group(members, ctx.size)
    if ctx.rank not in members:
        return None
    return torch_dist.TorchDistCommunicator(group, ctx.rank, members)


@register("self")
@_members_only
def _self(ctx: Context, ps_id: int, members: list[int]) -> Communicator | None:
    return SelfCommunicator()


def _never() -> bool:
    return False


def _shm(ctx: Context, members: list[int], name: str, poll: bool = True) -> Communicator:
    """``poll``: its waits may poll while a thread waits for a result (``ctx.urgent``);
    else they always sleep (``transport/shm/counters.py``)."""
    from .shm import ShmCommunicator

    cfg = ctx.cfg
    return ShmCommunicator(ctx.rank, members, ctx.segments.of(f"g{ctx.generation}-{name}"),
                           cfg.shm_segment_bytes, ctx.aborted, cfg.start_timeout_s,
                           cfg.stall_shutdown_time_s, cfg.cma, cfg.hugepages,
                           ctx.urgent if poll else _never,
                           cfg.stall_check_time_s if cfg.stall_check_enabled else float("inf"))


def _tcp(ctx: Context, group: list[int]) -> Communicator:
    from .tcp import SocketP2P

    assert ctx.mesh is not None
    mesh, wait_s = ctx.mesh, ctx.cfg.stall_shutdown_time_s
    p2p = SocketP2P(ctx.rank, group, lambda g: mesh.link(g, "data", wait_s, ctx.aborted),
                    ctx.describe, ctx.aborted, wait_s)
    return P2PCommunicator(p2p, ctx.cfg.small_allreduce_bytes)


register("shm")(_members_only(lambda ctx, ps_id, members: _shm(ctx, members, f"ps{ps_id}")))
register("tcp")(_members_only(lambda ctx, ps_id, members: _tcp(ctx, members)))


@register("hierarchical")
@_members_only
def _hierarchical(ctx: Context, ps_id: int, members: list[int]) -> Communicator | None:
    """shm among this host's members, tcp among the same local rank of every host."""
    from .hierarchical import HierarchicalCommunicator

    hosts = ctx.hosts
    local = [r for r in members if hosts[r] == hosts[ctx.rank]]
    in_order = list(dict.fromkeys(hosts[r] for r in members))
    cross = [[r for r in members if hosts[r] == h][local.index(ctx.rank)] for h in in_order]
    return HierarchicalCommunicator(_shm(ctx, local, f"ps{ps_id}-local"), _tcp(ctx, cross),
                                    _tcp(ctx, members))
