"""The per-process runtime: ``init()`` wires rendezvous, mesh, communicators and engine.

``init()`` works out who this process is (:mod:`ronde.runner.env`), meets the
others (:mod:`ronde.runner.rendezvous`), connects the mesh, builds one
communicator per process set (shared memory when all members share a host, tcp
otherwise, as ``RONDE_TRANSPORT`` allows) and starts the engine. ``shutdown()``
undoes all of it, so ``init()`` may be called again (a new *generation*).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import sys
import threading
import traceback
from typing import Any, Callable

from . import _config, _cores as cores_mod
from ._errors import (ConfigError, DeadlockError, PeerLostError, RendezvousError, RondeError,
                      ShutdownError, StallError)
from .core import autotune, tree
from .core.engine import Engine
from .runner import env as worker_env
from .runner import lifeline, meeting, rendezvous
from .transport import mesh as mesh_mod
from .transport.net import free_port, route_address
from .transport import factory as factory_mod
from .transport import shm_room

log = logging.getLogger("ronde")

_generation = 0
_atexit_registered = False
_dying = False
_reports: list[threading.Thread] = []  # lost-peer reports still being sent


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where every rank lives, from the rendezvous table."""

    rank: int
    size: int
    hosts: tuple[str, ...]  # host key of every rank
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool

    @staticmethod
    def build(rank: int, hosts: list[str]) -> "Topology":
        size = len(hosts)
        order: list[str] = []
        for h in hosts:
            if h not in order:
                order.append(h)
        local = [r for r in range(size) if hosts[r] == hosts[rank]]
        local_rank = local.index(rank)
        # Horovod's cross rank: index among the ranks that share this local rank
        same_local = [r for r in range(size)
                      if [q for q in range(size) if hosts[q] == hosts[r]].index(r) == local_rank]
        counts = {h: hosts.count(h) for h in order}
        return Topology(rank, size, tuple(hosts), local_rank, len(local),
                        same_local.index(rank), len(same_local), len(set(counts.values())) == 1)


class Runtime:
    """Everything ``init()`` built; ``ronde._api`` holds the current one."""

    def __init__(self, cfg: _config.Config, topo: Topology, engine: Engine, wenv: Any,
                 mesh: mesh_mod.Mesh | None, generation: int, transport: str) -> None:
        self.cfg, self.topo, self.engine, self.wenv = cfg, topo, engine, wenv
        self.mesh, self.generation, self.transport = mesh, generation, transport
        #: the next number of each (kind, process set)'s unnamed collectives
        self.counters: dict[tuple[str, int], int] = {}

    def describe_rank(self, r: int) -> str:
        return f"{r} (host {self.topo.hosts[r]})"


def _is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("localhost", "::1")


def init(process_sets: list[Any] | None = None) -> Runtime:
    """Build the runtime, in four steps: settings, peers, communicators, engine."""
    global _generation, _atexit_registered
    cfg = _settings()
    lifeline.watch()  # stop with the launcher, even one killed by SIGKILL
    wenv = worker_env.detect()
    _generation += 1
    gen = _generation
    wenv, gen, hosts, ctl, mesh, secret, room = _meet_peers(wenv, cfg, gen)
    _generation = gen
    topo = Topology.build(wenv.rank, hosts)
    cfg = room.config(cfg, hosts[wenv.rank])  # what this host's /dev/shm can hold
    room.warn(hosts[wenv.rank])
    if cfg.torchrun_env:
        _export_torchrun(wenv, topo)
    _tune_heap(cfg, topo)
    cfg = dataclasses.replace(cfg, first_bucket_bytes=cores_mod.first_bucket(
        cfg, topo, wenv.host_cores))
    engine_box: list[Engine] = []
    factory = _communicators(cfg, topo, wenv, mesh, secret, gen, engine_box, room)
    engine = _start_engine(cfg, topo, wenv, ctl, factory, gen)
    engine_box.append(engine)
    meeting.watch(engine.fail)  # rank 0 of an open start-up: a rank found taken ends it
    rt = Runtime(cfg, topo, engine, wenv, mesh, gen, factory.kinds[0])
    if wenv.rank == 0:
        log.info("ronde initialised: size=%d hosts=%d transport=%s source=%s; %s", topo.size,
                 len(set(hosts)), factory.kinds[0], wenv.source, cfg.describe())
    if not _atexit_registered:
        atexit.register(_atexit_shutdown)
        _install_excepthook()
        _atexit_registered = True
    return rt


def _settings() -> _config.Config:
    """Step 1: the configuration, and the ``ronde`` logger's level."""
    cfg = _config.load()
    if cfg.log_level:
        level = {"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(cfg.log_level.upper(),
                                                            cfg.log_level.upper())
        logging.getLogger("ronde").setLevel(level)
    return cfg


def _tune_heap(cfg: _config.Config, topo: Topology) -> None:
    """Once, at init: where peers on this host may read this rank's tensors in place
    (shm with ``RONDE_CMA`` and ``RONDE_HUGEPAGES``, another rank here, transparent huge
    pages available), set malloc's thresholds so tensors come from the heap, whose
    blocks can move onto huge pages (see transport/hugepages.py)."""
    if not (cfg.cma and cfg.hugepages and topo.local_size > 1
            and cfg.transport in ("auto", "shm")):
        return
    from .transport import hugepages

    if hugepages.HugePages(True).active and hugepages.heap_for_tensors() \
            and topo.local_rank == 0:
        log.info("ronde: malloc's mmap threshold set to %d MiB and trim threshold to %d MiB "
                 "(RONDE_HUGEPAGES=0 leaves malloc alone)", hugepages.MMAP_THRESHOLD >> 20,
                 2 * hugepages.MMAP_THRESHOLD >> 20)


Met = tuple[worker_env.WorkerEnv, int, list[str], dict[int, socket.socket],
            mesh_mod.Mesh | None, bytes, shm_room.Room]


def _meet_peers(wenv: worker_env.WorkerEnv, cfg: _config.Config, gen: int) -> Met:
    """Step 2: rendezvous and connect to every peer; returns the worker's place (an
    elastic job's rendezvous hands out rank, size and generation), every rank's host,
    the control sockets, the mesh (none of either for a job of one), the job's secret
    (empty for a job of one) and what each host's ``/dev/shm`` holds (every rank sends
    its free bytes: ``transport/shm_room.py``)."""
    if wenv.elastic:
        return _meet_elastic(wenv, cfg)
    rank, size = wenv.rank, wenv.size
    if size == 1:
        return wenv, gen, [wenv.host], {}, None, b"", shm_room.Room()
    rdv_host = wenv.rendezvous[0] if wenv.rendezvous else "127.0.0.1"
    local_job = wenv.rendezvous_mode == "file" or _is_loopback(rdv_host)
    bind = cfg.bind_addr or ("127.0.0.1" if local_job else route_address(rdv_host))
    listener = mesh_mod.listen(bind)
    advertised = bind if bind not in ("0.0.0.0", "::", "") else route_address(rdv_host)
    info = {"rank": rank, "size": size, "generation": gen, "host": wenv.host,
            "addr": advertised, "port": listener.getsockname()[1], "cpus": cores_mod.my_cpus(),
            "torch_port": free_port(bind) if rank == 0 else 0,
            "shm_free": shm_room.free_bytes()}
    store = None
    if cfg.transport == "gloo" and rank == 0:
        from .transport import torch_dist

        store = torch_dist.master_store(bind, cfg.start_timeout_s)
        info["store_port"] = store.port
    try:
        peers, secret = meeting.meet(wenv, cfg, info)
    except BaseException:
        listener.close()
        raise
    wenv = dataclasses.replace(wenv, host_cores=cores_mod.cores_by_rank(peers),
                               master=_master(peers))
    hosts = [str(p.get("host")) for p in peers]
    room = _room(cfg, rank, hosts, peers, wenv.host_cores)
    mesh = mesh_mod.Mesh(rank, size, gen, secret, listener, peers, cfg.start_timeout_s,
                         _ctl_peers(room.config(cfg, hosts[rank]), rank, hosts,
                                    wenv.host_cores))
    mesh.connect()
    if cfg.transport == "gloo":
        from .transport import torch_dist

        torch_dist.init_world(rank, size, str(peers[0]["addr"]), int(peers[0]["store_port"]),
                              cfg.start_timeout_s, store)
    return wenv, gen, hosts, mesh.ctl, mesh, secret, room


def _room(cfg: _config.Config, rank: int, hosts: list[str], peers: list[dict[str, Any]],
          host_cores: tuple[int, ...]) -> shm_room.Room:
    """What each host's ``/dev/shm`` can hold, from the table (the same on every rank)."""
    mailboxes = cores_mod.mailbox_hosts(cfg, Topology.build(rank, hosts), host_cores)
    return shm_room.plan(cfg, hosts, [p.get("shm_free") for p in peers], mailboxes)


def _meet_elastic(wenv: worker_env.WorkerEnv, cfg: _config.Config) -> Met:
    """Step 2 in an elastic job: register this worker's slot and wait (up to
    ``RONDE_ELASTIC_TIMEOUT``) until the driver has formed the next generation."""
    from ._errors import WorkerRemovedError

    if cfg.transport == "gloo":
        raise ConfigError("RONDE_TRANSPORT=gloo is not supported in an elastic job; use "
                          "shm/tcp (the default) or mpi")
    assert wenv.rendezvous is not None and wenv.secret is not None
    rdv_host = wenv.rendezvous[0]
    bind = cfg.bind_addr or ("127.0.0.1" if _is_loopback(rdv_host) else route_address(rdv_host))
    listener = mesh_mod.listen(bind)
    advertised = bind if bind not in ("0.0.0.0", "::", "") else route_address(rdv_host)
    info = {"elastic": True, "host": wenv.host, "slot": wenv.slot, "addr": advertised,
            "port": listener.getsockname()[1], "pid": os.getpid(), "node": wenv.node,
            "cpus": cores_mod.my_cpus(), "torch_port": free_port(bind),
            "shm_free": shm_room.free_bytes()}
    wait_s = cfg.elastic_timeout_s + cfg.start_timeout_s
    try:
        reply = rendezvous.exchange(wenv.rendezvous, wenv.secret, info, wait_s)
    except BaseException:
        listener.close()
        raise
    if reply.get("kind") == "removed":
        listener.close()
        raise WorkerRemovedError(f"slot {wenv.slot} of host {wenv.host} is not part of the "
                                 "re-formed job")
    try:
        rank, size, gen = int(reply["rank"]), int(reply["size"]), int(reply["generation"])
        peers = reply["peers"]
        if not (isinstance(peers, list) and len(peers) == size and 0 <= rank < size):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        listener.close()
        raise RendezvousError("malformed elastic rendezvous reply") from None
    hosts = [str(p.get("node") or p.get("host")) for p in peers]  # machines, for locality
    from .runner.hosts import places

    where = places(hosts)[rank]
    wenv = dataclasses.replace(wenv, rank=rank, size=size,
                               notice=float(reply.get("notice") or 0.0),
                               local_rank=where.local_rank, local_size=where.local_size,
                               host_cores=cores_mod.cores_by_rank(peers, hosts),
                               master=_master(peers))
    if size == 1:
        listener.close()
        return wenv, gen, hosts, {}, None, b"", shm_room.Room()
    room = _room(cfg, rank, hosts, peers, wenv.host_cores)
    mesh = mesh_mod.Mesh(rank, size, gen, wenv.secret, listener, peers, cfg.start_timeout_s,
                         _ctl_peers(room.config(cfg, hosts[rank]), rank, hosts,
                                    wenv.host_cores))
    mesh.connect()
    return wenv, gen, hosts, mesh.ctl, mesh, wenv.secret, room


def _master(peers: list[dict[str, Any]]) -> tuple[str, int] | None:
    """Rank 0's address and the port it found free (``MASTER_ADDR``/``MASTER_PORT``)."""
    try:
        port = int(peers[0].get("torch_port") or 0)
    except (TypeError, ValueError):
        return None
    return (str(peers[0].get("addr")), port) if port > 0 else None


def _export_torchrun(wenv: worker_env.WorkerEnv, topo: Topology) -> None:
    """torchrun's variables for this generation, for trainers that read them (see
    ``runner/env.export_torchrun``): rank, sizes, host index; rank 0's address and port
    where the launcher did not set them (an elastic job's move with rank 0)."""
    if topo.size < 2 or wenv.master is None:
        return
    hosts = list(dict.fromkeys(topo.hosts))
    values = worker_env.torchrun_vars(
        rank=topo.rank, size=topo.size, local_rank=topo.local_rank, local_size=topo.local_size,
        node_rank=hosts.index(topo.hosts[topo.rank]), nodes=len(hosts), master=wenv.master)
    changing = [n for n in values if wenv.elastic or not n.startswith("MASTER_")]
    worker_env.export_torchrun(os.environ, values, update=changing)


def _ctl_peers(cfg: _config.Config, rank: int, hosts: list[str],
               host_cores: tuple[int, ...]) -> list[int] | None:
    """The peers whose control sockets ``init()`` opens: every one (None) when rounds
    go all-to-all; under the coordinator, only rank 0's on the other ranks (N - 1 in
    all; after rank 0 leaves, the next coordinator's open on demand: core/exchange.py);
    over the tree (core/tree.py) only each rank's parent's and children's."""
    if not cores_mod.coordinated(cfg, Topology.build(rank, hosts), host_cores):
        return None
    size = len(hosts)
    if tree.wanted(cfg, size):
        return tree.neighbours(rank, size)  # the star's open when the tree ends
    return list(range(1, size)) if rank == 0 else [0]


def _communicators(cfg: _config.Config, topo: Topology, wenv: worker_env.WorkerEnv,
                   mesh: mesh_mod.Mesh | None, secret: bytes, gen: int,
                   engine_box: list[Engine], room: shm_room.Room) -> factory_mod.Factory:
    """Step 3: the factory of every process set's communicator (see transport/factory.py);
    its shared-memory segments are named from the job's ``secret`` (transport/segments.py:
    no other user can tell their names), and made only on hosts with room for them
    (``room``: tcp for the sets with a member elsewhere)."""
    mpi_world = None
    if cfg.transport == "mpi":
        from .transport import mpi as mpi_mod

        mpi_world = mpi_mod.check_world(wenv.rank, wenv.size)

    def aborted() -> BaseException | None:
        # the engine's Event: one attribute read per check while nothing failed
        if not engine_box or not engine_box[0].aborted.is_set():
            return None
        return engine_box[0].failed

    def urgent() -> bool:
        # a thread waits for a result: shm waits poll (never the steady lane's: Factory.lane)
        return not engine_box or engine_box[0].waiters.waiting()

    from .transport.segments import Names

    names = Names(wenv.job_id or f"pid{os.getppid()}", secret)
    ctx = factory_mod.Context(cfg, wenv.rank, wenv.size, topo.hosts, names, gen, aborted, mesh,
                              mpi_world, urgent, room.no_shm)
    return factory_mod.Factory(ctx)


def _start_engine(cfg: _config.Config, topo: Topology, wenv: worker_env.WorkerEnv,
                  ctl: dict[int, socket.socket], factory: factory_mod.Factory,
                  gen: int) -> Engine:
    """Step 4: the global set's communicator, the engine on top, its timeline; started."""
    rank, size = topo.rank, topo.size
    world = factory(0, list(range(size)))
    assert world is not None
    if not cores_mod.coordinated(cfg, topo, wenv.host_cores):
        cfg = dataclasses.replace(cfg, coordinator_min=0)  # every rank alike (see there)
    # more ranks than cores here: no spinning, a longer round hold (where not set)
    cfg = cores_mod.for_this_host(cfg, topo, wenv.host_cores, _config.explicit_fields())
    mesh = factory.ctx.mesh
    # the steady lane (core/lane.py): a second shm communicator of the global set; not
    # under autotune, which scores negotiated collectives (the lane's have none of its knobs)
    lane = (lambda: factory.lane(0, list(range(size)))) \
        if cfg.steady_lane and not cfg.autotune and factory.kinds[0] == "shm" else None
    engine = Engine(rank, size, cfg, ctl, {0: world}, {0: list(range(size))}, factory,
                    factory.ctx.describe,
                    cores_mod.control_mailboxes(cfg, topo, rank, size,
                                                factory.ctx.segments.of(f"g{gen}-ctl"),
                                                wenv.host_cores),
                    mesh, lane)
    if wenv.rendezvous_mode == "server" and wenv.rendezvous and wenv.secret:
        engine.on_failure = _lost_peer_reporter(wenv)
    if cfg.timeline_path:
        start_timeline(engine, cfg.timeline_path, rank, cfg.timeline_mark_cycles)
    if cfg.autotune and rank == 0:
        engine.autotune = autotune.for_config(cfg, _config.explicit_fields())
    engine.start()
    return engine


def timeline_path_for(path: str, rank: int) -> str | None:
    """Rank 0 writes ``path`` (as Horovod does); with ``{rank}`` in it, every rank does."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    return path if rank == 0 else None


def start_timeline(engine: Engine, path: str, rank: int, mark_cycles: bool) -> None:
    from .core.timeline import Timeline

    target = timeline_path_for(path, rank)
    if target is None:
        return
    old = engine.set_timeline(Timeline(target, rank, mark_cycles))
    if old is not None:
        old.close()


def _lost_peer_reporter(wenv: Any) -> Callable[[BaseException], None]:
    """Tell the launcher which rank this one lost, so it can lead with that rank.

    The launcher otherwise orders failures by the exit times it observes, and a
    survivor that catches ``PeerLostError`` and exits may be seen to exit before the
    lost rank's process is reaped. Sent from a thread (the engine's threads must not
    block on the launcher); :func:`shutdown` gives it a moment to finish.
    """
    def report(exc: BaseException) -> None:
        lost = getattr(exc, "rank", None)
        if not isinstance(exc, PeerLostError) or lost is None:
            return
        t = threading.Thread(target=rendezvous.report_failure, daemon=True,
                             name="ronde-report-lost",
                             args=(wenv.rendezvous, wenv.secret, wenv.rank, str(exc)),
                             kwargs={"secondary": True, "lost": int(lost)})
        _reports.append(t)
        t.start()

    return report


def shutdown(rt: Runtime) -> None:
    if _dying:
        rt.engine.cfg = dataclasses.replace(rt.engine.cfg, shutdown_timeout_s=0.5)
        if rt.wenv.elastic:
            # an elastic worker dying of an exception is a lost peer, not one that
            # finished: leave without announcing a shutdown, so that the survivors'
            # collectives fail with PeerLostError and the job re-forms without it
            rt.engine.fail(RondeError(f"rank {rt.topo.rank} is exiting on an uncaught "
                                      "exception"))
    rt.engine.shutdown()
    for t in _reports:
        t.join(timeout=1.0)
    from .transport import torch_dist  # torch itself is imported only if it was used

    if torch_dist.holds_groups():  # Gloo transport, torch device path
        mesh = rt.mesh
        if rt.topo.size == 1:  # nobody else can still be using them
            torch_dist.destroy_world(lambda: None)
        elif rt.engine.failed is None and mesh is not None:
            torch_dist.destroy_world(lambda: mesh.barrier(10.0))
        else:
            torch_dist.destroy_world(None)
    if rt.mesh is not None:
        rt.mesh.close()


def _atexit_shutdown() -> None:
    # ronde._api registered its shutdown() after this, so it ran first (atexit is LIFO)
    meeting.close()


def _install_excepthook() -> None:
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        global _dying
        _dying = True
        try:
            wenv = worker_env.detect()
            if wenv.rendezvous_mode == "server" and wenv.rendezvous and wenv.secret:
                text = "".join(traceback.format_exception(exc_type, exc, tb))
                secondary = isinstance(exc, (PeerLostError, ShutdownError, StallError)) \
                    and not isinstance(exc, DeadlockError)
                # the peer whose loss or early shutdown caused it: the launcher leads with it
                lost = getattr(exc, "rank", None) if secondary else None
                rendezvous.report_failure(wenv.rendezvous, wenv.secret, wenv.rank, text,
                                          secondary=secondary,
                                          lost=lost if isinstance(lost, int) else None,
                                          left=isinstance(exc, ShutdownError))
        except Exception:  # noqa: BLE001 - reporting is best effort
            pass
        previous(exc_type, exc, tb)

    sys.excepthook = hook
