"""How many cores the ranks of each host have together, and what that decides.

Where it sits: step 2 of ``init()`` (``_runtime.py``) puts each rank's CPU affinity into
its rendezvous entry; from the table every rank computes, alike, the cores of every
host (the union of its ranks' affinities: ranks bound to one core each still add up).
A host with more ranks than cores negotiates over the control sockets rather than
shared-memory mailboxes (``RONDE_SHM_CONTROL=auto``). From ``RONDE_COORDINATOR_MIN``
ranks on the rounds go through rank 0 (``core/coordinator.py``) over the sockets,
except in a one-host job whose ranks use mailboxes; both sides of every round must
take the same path, and they do, since every rank decides from the same table. And a
rank whose host has more ranks than cores does not spin and holds rounds longer, unless
told otherwise: :func:`for_this_host`.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from typing import Any, Callable

from . import _config

log = logging.getLogger("ronde")

#: DDP's first bucket: small, so that the first allreduce starts early in the backward
FIRST_BUCKET_BYTES = 1 << 20


def my_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity), for its peers on this host."""
    from .transport.futex import cpus

    return cpus()


def host_cores(peers: list[dict[str, Any]], rank: int, hosts: list[str] | None = None) -> int:
    """CPUs the ranks on this rank's host may use together (the union of their
    affinities, from the rendezvous table: every rank there computes the same number);
    0 when a peer did not say (the caller then falls back on this process's own)."""
    hosts = hosts or [str(p.get("host")) for p in peers]
    union: set[int] = set()
    for r, p in enumerate(peers):
        if hosts[r] != hosts[rank]:
            continue
        got = p.get("cpus")
        if not (isinstance(got, list) and 0 < len(got) <= 65536
                and all(isinstance(c, int) and 0 <= c < 1 << 20 for c in got)):
            return 0  # untrusted input: a malformed list counts as unknown
        union.update(got)
    return len(union)


def cores_by_rank(peers: list[dict[str, Any]], hosts: list[str] | None = None
                   ) -> tuple[int, ...]:
    """For every rank, the cores of its host (:func:`host_cores`)."""
    hosts = hosts or [str(p.get("host")) for p in peers]
    per_host = {h: host_cores(peers, hosts.index(h), hosts) for h in dict.fromkeys(hosts)}
    return tuple(per_host[h] for h in hosts)


def _cores_of(topo: Any, rank: int, cores_by_rank: tuple[int, ...]) -> int:
    """The cores of ``rank``'s host: from the rendezvous table, else this process's."""
    got = cores_by_rank[rank] if len(cores_by_rank) == topo.size else 0
    if got:
        return got
    from .transport.futex import cores

    return cores()


def mailbox_hosts(cfg: _config.Config, topo: Any, cores_by_rank: tuple[int, ...]
                   ) -> set[str]:
    """The hosts whose ranks negotiate through shared-memory mailboxes: every rank
    computes the same set from the rendezvous table (the coordinator is off when it is
    not empty: both sides of a round must use the same path)."""
    if cfg.shm_control == "off" or topo.size == 1:
        return set()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()  # the slots rely on total store order
    out = set()
    for h in set(topo.hosts):
        ranks = [r for r in range(topo.size) if topo.hosts[r] == h]
        n_cores = _cores_of(topo, ranks[0], cores_by_rank)
        if len(ranks) > 1 and (cfg.shm_control == "on" or len(ranks) <= n_cores):
            out.add(h)
    return out


def for_this_host(cfg: _config.Config, topo: Any, cores_by_rank: tuple[int, ...],
                  explicit: set[str]) -> _config.Config:
    """The settings of a rank whose host has more ranks than cores, where not set:

    * ``RONDE_SPIN_TIME`` 0. A waiter that polls there takes the core that the peer it
      waits for needs, as the shm waits already knew (``transport/shm/counters.py``):
      measured at np=4 and 8 on 2 cores, not spinning made small collectives as fast or
      faster (np=4: 4-byte latency 625-664 us against 763-769, allreduce 696-722 us
      against 874-958) and cost the transformer's ranks in ``python -m ronde.bench
      train`` about 0.4 ms less CPU a step at np=8 (docs/benchmarks.md).
    * ``RONDE_ROUND_HOLD`` times the ranks per core (rounded up). Ranks that share a core
      reach a bucket further apart (at np=8 on 2 cores a step takes ~150 ms of wall time),
      so the 50 ms hold ran out before the last rank came and the round it started could
      complete nothing: 2.67 rounds a step for the transformer's 2 buckets at np=8, 4.30
      for ResNet's, against 2.00 and 2.37 with 200 ms.

    Only this rank's own behaviour (each rank spins and holds its own rounds): nothing
    to agree on."""
    mine = [r for r in range(topo.size) if topo.hosts[r] == topo.hosts[topo.rank]]
    n_cores = _cores_of(topo, topo.rank, cores_by_rank)
    if len(mine) <= n_cores:
        return cfg
    changes: dict[str, float] = {}
    if "spin_time_us" not in explicit:
        changes["spin_time_us"] = 0.0
    if "round_hold_ms" not in explicit:
        changes["round_hold_ms"] = cfg.round_hold_ms * -(-len(mine) // n_cores)
    log.debug("ronde: %d ranks on %d cores here: %s (set the variables to override)",
              len(mine), n_cores, changes)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def first_bucket(cfg: _config.Config, topo: Any, cores_by_rank: tuple[int, ...]) -> int:
    """``RONDE_FIRST_BUCKET_BYTES`` with ``auto`` resolved: :data:`FIRST_BUCKET_BYTES`, or
    ``RONDE_BUCKET_BYTES`` in a one-host job whose ranks have no core to spare. There a
    bucket's reduction (shared memory: loads, adds and stores) can only run on a core
    the backward pass is using: a small first bucket overlaps nothing, and its thread
    hand-off and the cache it takes cost the ResNet of ``python -m ronde.bench train``
    at np=2 on 2 cores 2 ms of CPU a step (docs/benchmarks.md). Every rank computes the
    same; rank 0's layout is the one used."""
    if cfg.first_bucket_bytes is not None:
        return cfg.first_bucket_bytes
    one_host = len(set(topo.hosts)) == 1
    if one_host and topo.size > 1 and topo.size >= _cores_of(topo, 0, cores_by_rank):
        return cfg.bucket_bytes
    return FIRST_BUCKET_BYTES


def coordinated(cfg: _config.Config, topo: Any, cores_by_rank: tuple[int, ...]) -> bool:
    """Whether the job's rounds go through rank 0 (``core/coordinator.py``): from
    ``RONDE_COORDINATOR_MIN`` ranks on, unless the job is one host whose ranks use
    mailboxes (all-to-all through shared memory costs no system call: faster there).
    Then no rank uses mailboxes (both sides of a round take the same path); every rank
    decides alike, from the rendezvous table."""
    if cfg.coordinator_min <= 0 or topo.size < max(cfg.coordinator_min, 2):
        return False
    return len(set(topo.hosts)) > 1 or not mailbox_hosts(cfg, topo, cores_by_rank)


def control_mailboxes(cfg: _config.Config, topo: Any, rank: int, size: int,
                       path_of: Callable[[int], str], cores_by_rank: tuple[int, ...] = ()
                       ) -> Any:
    """Shared-memory negotiation mailboxes with the ranks on this host (see
    ``transport/mailbox.py``), or None (RONDE_SHM_CONTROL=0, not x86-64, no such peer,
    or, with ``auto``, more ranks on this host than cores, or rounds through the
    coordinator)."""
    if coordinated(cfg, topo, cores_by_rank) or \
            topo.hosts[rank] not in mailbox_hosts(cfg, topo, cores_by_rank):
        log.debug("ronde: negotiation with this host's ranks over the control sockets "
                  "(RONDE_SHM_CONTROL=%s)", cfg.shm_control)
        return None
    peers = [r for r in range(size) if r != rank and topo.hosts[r] == topo.hosts[rank]]
    from .transport.mailbox import Mailboxes

    return Mailboxes(rank, peers, path_of, cfg.start_timeout_s)
