"""How much of ``/dev/shm`` a job's segments take on each host, decided alike everywhere.

Where it sits: step 2 of ``init()`` (``_runtime.py``). Every segment's memory is
reserved when it is made (``segments.py``: ``posix_fallocate``), so that a full
``/dev/shm`` is never a SIGBUS in the middle of a collective. By default that is about
``local ranks x 2 x RONDE_SHM_SEGMENT`` (the global set's segment and the steady lane's)
plus the negotiation mailboxes: 260 MiB at np=2, four times a container's default
64 MiB ``/dev/shm``. So before making any, each rank measures the free space of the shm
directory (:func:`free_bytes`, sent in its rendezvous entry as ``shm_free``), and every
rank computes from the same table, per host, the same :class:`Room` (:func:`plan`):

* what the configuration needs fits in the least free space any rank of the host saw:
  nothing changes;
* else the host's segments shrink to the largest whole number of MiB (down to
  :data:`FLOOR_BYTES`) whose total takes at most half of that free space (the rest is
  left to the job's later process sets and to other users, such as torch's DataLoader
  workers);
* else the host's ranks make no shm segment: the process sets with a member there run
  over tcp (every rank chooses the same: ``factory.choose``), and its ranks negotiate
  over the sockets where even the mailboxes do not fit.

The ranks of a host whose plan changed each log one WARNING naming the directory, its
free bytes, what was needed and the remedies. Decided from the table, never from a
rank's own view: ranks that chose differently would wait for each other forever.
Another process that takes the space between the measure and the reservation still
gets the :class:`~ronde.ConfigError` of ``segments.create_segment``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
from typing import Any, Mapping, Sequence

from .._config import Config
from .segments import shm_dir

log = logging.getLogger(__name__)

#: the smallest data region a host's segments shrink to before its ranks give up
#: shared memory (collectives of more move in pieces of it)
FLOOR_BYTES = 1 << 20
_MIB = 1 << 20
_GIB = 1 << 30


def free_bytes() -> int | None:
    """The bytes an unprivileged process may still allocate in the shm directory, or
    None where that cannot be measured."""
    try:
        st = os.statvfs(shm_dir())
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _known(value: Any) -> int | None:
    """A peer's ``shm_free`` (untrusted input): a non-negative int, else unknown."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62:
        return value
    return None


@dataclasses.dataclass(frozen=True)
class Room:
    """The plan of every host (by host key) where the configuration does not fit."""

    #: the data region of the host's shm segments, where shrunk
    segment_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: hosts whose ranks make no shm segment, and why (for ``RONDE_TRANSPORT=shm``'s error)
    no_shm: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: hosts whose ranks negotiate over the sockets, not through mailboxes
    no_mailboxes: frozenset[str] = frozenset()
    #: the warning of each host whose plan changed
    warnings: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def config(self, cfg: Config, host: str) -> Config:
        """The settings of a rank on ``host``: its segments' size, its mailboxes."""
        changes: dict[str, Any] = {}
        if host in self.segment_bytes:
            changes["shm_segment_bytes"] = self.segment_bytes[host]
        if host in self.no_mailboxes:
            changes["shm_control"] = "off"
        return dataclasses.replace(cfg, **changes) if changes else cfg

    def warn(self, host: str) -> None:
        """Log the WARNING of ``host``'s plan, if it changed (once per rank and init)."""
        if host in self.warnings:
            log.warning("ronde: %s", self.warnings[host])


def segments_per_rank(cfg: Config, one_host: bool) -> int:
    """The shm segments each rank of a host makes at ``init()`` with ``cfg``: the global
    set's (or its host-local part's), and the steady lane's in a one-host job."""
    if cfg.transport not in ("auto", "shm") \
            or platform.machine().lower() not in ("x86_64", "amd64"):
        return 0
    return 1 + int(one_host and cfg.steady_lane and not cfg.autotune)


def plan(cfg: Config, hosts: Sequence[str], free_by_rank: Sequence[Any],
         mailbox_hosts: set[str]) -> Room:
    """Every host's :class:`Room` from the rendezvous table: ``hosts`` and ``free_by_rank``
    (each rank's ``shm_free``) by rank, ``mailbox_hosts`` those whose ranks would use
    mailboxes (``_cores.mailbox_hosts``). The same on every rank."""
    from .mailbox import SEGMENT_BYTES as MAILBOX_BYTES
    from .shm.protocol import segment_total

    k = segments_per_rank(cfg, len(set(hosts)) == 1)
    want = cfg.shm_segment_bytes
    sizes: dict[str, int] = {}
    no_shm: dict[str, str] = {}
    no_mailboxes: set[str] = set()
    warnings: dict[str, str] = {}
    for host in dict.fromkeys(hosts):
        ranks = [r for r, h in enumerate(hosts) if h == host]
        n = len(ranks)
        seen = [f for f in (_known(free_by_rank[r]) for r in ranks) if f is not None]
        mb = MAILBOX_BYTES if host in mailbox_hosts else 0
        shm_k = k if n > 1 else 0

        def need(segment_bytes: int, shm_k: int = shm_k, mb: int = mb, n: int = n) -> int:
            return n * (shm_k * segment_total(segment_bytes) + mb)

        if not seen or need(want) <= min(seen):
            continue
        free = min(seen)
        budget = free // 2
        per_segment = (budget // n - mb) // shm_k - segment_total(0) if shm_k else -1
        fit = min(want, per_segment // _MIB * _MIB) if per_segment >= _MIB else 0
        if shm_k and fit >= min(want, FLOOR_BYTES):
            sizes[host] = fit
            outcome = (f"running with {_size(fit)} segments instead (collectives of more "
                       "move in pieces)")
        elif shm_k:
            no_shm[host] = (f"{shm_dir()} on host {host} has {free} bytes free; its {n} "
                            f"ranks' shared-memory segments need {need(FLOOR_BYTES)} even "
                            f"at {_size(FLOOR_BYTES)}, more than half of it")
            outcome = (f"too few even for {_size(FLOOR_BYTES)} segments: the process sets "
                       "with a rank on this host run over tcp")
            if n * mb > budget:
                no_mailboxes.add(host)
        else:
            if mb:
                no_mailboxes.add(host)
                log.info("ronde: %s on host %s has %d bytes free: its ranks negotiate over "
                         "the sockets, not shared-memory mailboxes", shm_dir(), host, free)
            continue
        warnings[host] = (
            f"{shm_dir()} has {free} bytes free on host {host}, but shared memory for its {n} "
            f"ranks needs {need(want)} bytes ({shm_k} segment(s) a rank of "
            f"RONDE_SHM_SEGMENT={_size(want)}, reserved at init"
            f"{', and the negotiation mailboxes' if mb else ''}); {outcome}. Give it more "
            f"room (Docker: `docker run --shm-size={_remedy_gib(need(want))}g`; else "
            f"`mount -o remount,size={_remedy_gib(need(want))}G {shm_dir()}`), or set "
            "RONDE_TRANSPORT=tcp to run over sockets without this warning")
    return Room(sizes, no_shm, frozenset(no_mailboxes), warnings)


def _size(n: int) -> str:
    return f"{n // _MIB}MiB" if n % _MIB == 0 else f"{n // 1024}KiB"


def _remedy_gib(need: int) -> int:
    """Room for the job's segments twice over (later process sets, the DataLoader's)."""
    return max(1, -(-2 * need // _GIB))
