"""The elastic driver: which slots form each generation of an elastic job, and when.

Where it sits: backend-neutral; ``runner/elastic.py`` runs it over ``ronderun``'s
processes, ``ray/elastic.py`` over Ray actors. The rules (discovery, assignment,
blacklist, waits below the minimum, the reset limit, hung workers, the end) are in
``runner/elastic.py``'s docstring and docs/elastic.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import signal
import time
from typing import Any, Callable, Sequence

from .._errors import ConfigError
from .discovery import DISCOVER_EVERY_S, Discovery
from .elastic_rendezvous import ElasticRendezvous, Slot
from .env import worker_env_vars
from .hosts import HostSpec, RankSlot, places

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Blacklist:
    """Hosts that failed, until when (``inf``: for good)."""

    cooldown: tuple[float, float] | None = None
    until: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, host: str) -> None:
        if self.cooldown is None:
            self.until[host] = float("inf")
        else:
            self.until[host] = time.monotonic() + random.uniform(*self.cooldown)

    def blocked(self, host: str) -> bool:
        return self.until.get(host, 0.0) > time.monotonic()


def assign(hosts: list[HostSpec], survivors: list[Slot], max_np: int | None,
           left_out: set[Slot] = frozenset()) -> list[Slot]:  # type: ignore[assignment]
    """The next generation's slots in rank order (see the module docstring): hosts with
    survivors first, survivors first on each host in their old order, then new slots up
    to ``max_np``."""
    alive = [s for s in survivors if any(h.name == s[0] for h in hosts)]
    order = sorted(hosts, key=lambda h: (0 if any(s[0] == h.name for s in alive) else 1))
    room = None if max_np is None else max(0, max_np - len(alive))
    new: dict[str, list[int]] = {}
    for h in order:
        for i in range(h.slots):
            if room is not None and room <= 0:
                break
            slot = (h.name, i)
            if slot not in alive and slot not in left_out:
                new.setdefault(h.name, []).append(i)
                if room is not None:
                    room -= 1
    out: list[Slot] = []
    for h in order:
        out.extend(s for s in alive if s[0] == h.name)
        out.extend((h.name, i) for i in new.get(h.name, []))
    return out


class ElasticDriver:
    """Runs an elastic job on top of a job that starts and watches workers.

    The job is ``launch._Job``'s process handling for ``ronderun`` (:class:`ElasticJob`),
    or Ray's actors (``ronde/ray/elastic.py``). What the driver uses of it: ``workers``
    (every worker started, in start order), ``_spawn(worker)``, ``failed_workers``,
    ``signals``, ``server`` (an :class:`ElasticRendezvous`), ``stderr``, ``out_lock``
    and optionally ``name`` (what its lines start with; default ``ronderun``). What it uses of a worker: ``returncode`` (None while running),
    ``alive``, ``killpg(signal)``, ``signalled`` (stopped by the driver), ``exit_time``
    and ``slot``; it sets ``elastic_slot``, ``removed`` and ``hung`` on it.
    """

    def __init__(self, job: Any, discovery: Discovery, min_np: int, max_np: int | None,
                 np: int | None, make_worker: Callable[[int, Slot, RankSlot], Any],
                 elastic_timeout_s: float, reset_limit: int | None,
                 blacklist: Blacklist, start_timeout_s: float) -> None:
        self.job, self.discovery = job, discovery
        self.min_np, self.max_np, self.np = min_np, max_np, np
        self.make_worker = make_worker
        self.elastic_timeout_s, self.reset_limit = elastic_timeout_s, reset_limit
        self.blacklist, self.start_timeout_s = blacklist, start_timeout_s
        self.server: ElasticRendezvous = job.server
        self.assignment: list[Slot] = []
        self.by_slot: dict[Slot, Any] = {}
        self.left_out: set[Slot] = set()
        self.hosts: list[HostSpec] = []
        self.resets = 0
        self.finishing = False
        self.short_since: float | None = None  # fewer than min_np slots since then
        self.fatal = ""
        self._handled: set[int] = set()
        self._last_discovery = 0.0

    # -- start ---------------------------------------------------------------------------
    def start(self) -> None:
        deadline = time.monotonic() + self.elastic_timeout_s
        while True:
            self.hosts = self._available(self.discovery.find())
            if sum(h.slots for h in self.hosts) >= self.min_np:
                break
            if time.monotonic() > deadline or self.job.signals:
                raise ConfigError(
                    f"elastic: only {sum(h.slots for h in self.hosts)} slot(s) available "
                    f"after {self.elastic_timeout_s:g}s, --min-np needs {self.min_np}")
            time.sleep(DISCOVER_EVERY_S)
        first = self.max_np  # as Horovod: every slot found, up to --max-np
        self._form(assign(self.hosts, [], first), removed=[])
        self._last_discovery = time.monotonic()

    # -- one step of the job's loop --------------------------------------------------------
    def step(self) -> str:
        """Handle exits, discovery and waits; the job's end reason, or ""."""
        for slot in self.server.take_leaving():
            w = self.by_slot.get(slot)
            if w is not None and slot in self.assignment:
                w.removed = True  # its exit is a removal, not a failure
                self.left_out.add(slot)
                self._say("worker %s[%d] leaves (SIGTERM); its state was committed",
                          slot[0], slot[1])
                self._change(failure=False)
        for w in self.job.workers:
            if w.returncode is None or id(w) in self._handled:
                continue
            self._handled.add(id(w))
            self._exited(w)
            if self.fatal:
                return "failure"
        now = time.monotonic()
        if self.discovery.dynamic and now - self._last_discovery > DISCOVER_EVERY_S:
            self._last_discovery = now
            try:
                found = self._available(self.discovery.find())
            except ConfigError as exc:
                self._say("%s (keeping the last host list)", exc)
                found = self.hosts
            if [(h.name, h.slots) for h in found] != [(h.name, h.slots) for h in self.hosts]:
                self.hosts = found
                self._change(failure=False)
        elif self.short_since is not None:
            self.hosts = self._available(self.discovery.find())
            self._change(failure=False)
        if self.short_since is not None and now - self.short_since > self.elastic_timeout_s:
            self.fatal = (f"elastic: fewer than --min-np {self.min_np} slots for "
                          f"{self.elastic_timeout_s:g}s (--elastic-timeout)")
            return "failure"
        self._stop_hung(now)
        if self.fatal:
            return "failure"
        formed = [self.by_slot[s] for s in self.server.formed() if s in self.by_slot]
        if self.finishing and formed and all(w.returncode == 0 for w in formed):
            for w in self.job.workers:  # started for a generation that never formed
                if w.alive:
                    w.removed = w.signalled = True
                    w.killpg(signal.SIGTERM)
            return "done"
        if not any(w.alive for w in self.job.workers):
            self.fatal = self.fatal or "elastic: no worker is left"
            return "failure"
        return ""

    # -- internals -------------------------------------------------------------------------
    def _say(self, fmt: str, *args: Any) -> None:
        """A line of the driver's on the launcher's stderr (``ronderun: elastic: ...``)."""
        who = getattr(self.job, "name", "ronderun")
        text = f"{who}: elastic: " + (fmt % args if args else fmt) + "\n"
        with self.job.out_lock:
            try:
                self.job.stderr.write(text)
                self.job.stderr.flush()
            except (OSError, ValueError):
                pass

    def _available(self, hosts: list[HostSpec]) -> list[HostSpec]:
        return [h for h in hosts if not self.blacklist.blocked(h.name)]

    def _exited(self, w: Any) -> None:
        slot = w.elastic_slot
        if getattr(w, "removed", False) or slot not in self.assignment:
            return
        if w.returncode == 0:
            self.finishing = True
            return
        if w.signalled and not getattr(w, "hung", False):
            return  # stopped by the driver (its host left the job)
        if self.finishing:
            if slot in self.server.formed():
                self.fatal = "elastic: a worker failed after the job started to finish"
            return
        self.job.failed_workers.append(w)
        host = slot[0]
        rest = sum(h.slots for h in self.hosts if h.name != host)
        replaced = getattr(self.discovery, "replaces_failed", False)
        if rest >= self.min_np or replaced:
            self.blacklist.add(host)
            self.hosts = [h for h in self.hosts if h.name != host]
            if replaced:  # the discovery offers the slot again under a new name (Spark)
                self.hosts = self._available(self.discovery.find())
            self._say("worker %s on %s failed (%s); host blacklisted", slot[1], host,
                        w.returncode)
        else:
            self.left_out.add(slot)
            self._say("worker %s on %s failed (%s); slot left out", slot[1], host,
                        w.returncode)
        self._change(failure=True)

    def _change(self, failure: bool) -> None:
        if self.finishing:
            return
        survivors = [s for s in self.assignment if s in self.by_slot
                     and self.by_slot[s].alive and not getattr(self.by_slot[s], "removed", False)]
        nxt = assign(self.hosts, survivors, self.max_np, self.left_out)
        if len(nxt) < self.min_np:
            if self.short_since is None:
                self.short_since = time.monotonic()
                self._say("%d slot(s) available, --min-np is %d; waiting up to "
                            "%gs for more", len(nxt), self.min_np, self.elastic_timeout_s)
            return
        self.short_since = None
        if nxt == self.assignment and not failure:
            return
        if self.reset_limit is not None and self.resets >= self.reset_limit:
            self.fatal = f"elastic: the job re-formed {self.resets} times (--reset-limit)"
            return
        self.resets += 1
        removed = [s for s in self.assignment if s not in nxt]
        added = [s for s in nxt if s not in self.assignment]
        for s in removed:
            w = self.by_slot.get(s)
            if w is not None and w.alive:
                w.removed = True
                if self.blacklist.blocked(s[0]):
                    w.signalled = True
                    w.killpg(signal.SIGTERM)
        self._form(nxt, removed)
        if not failure:
            from ..elastic.notify import ADDED, REMOVED

            self.server.announce((ADDED if added else 0) | (REMOVED if removed else 0))

    def _form(self, slots: list[Slot], removed: list[Slot]) -> None:
        self._say("generation %d: %s", self.server.generation + 1,
                 ", ".join(f"{h}[{i}]" for h, i in slots))
        self.assignment = slots
        self.server.set_assignment(slots, removed)
        for rank_slot, slot in zip(places([h for h, _ in slots]), slots):
            w = self.by_slot.get(slot)
            if w is not None and w.alive:
                continue
            w = self.make_worker(len(self.job.workers), slot, rank_slot)
            w.elastic_slot = slot
            self.by_slot[slot] = w
            self.job.workers.append(w)
            self.job._spawn(w)

    def _stop_hung(self, now: float) -> None:
        held, since = self.server.waiting()
        if since is None or now - since < self.start_timeout_s:
            return
        for s in self.assignment:
            w = self.by_slot.get(s)
            if s not in held and w is not None and w.alive:
                self._say("worker %s[%d] did not come back to the rendezvous "
                            "within %gs; stopping it", s[0], s[1], self.start_timeout_s)
                w.hung = True
                w.signalled = True
                w.killpg(signal.SIGKILL)


def elastic_worker_vars(slot: Slot, where: RankSlot, size: int, rendezvous: tuple[str, int],
                        secret: bytes, job_id: str, elastic_timeout_s: float,
                        start_timeout_s: float, reset_limit: int | None) -> dict[str, str]:
    """The environment of an elastic job's worker: the worker contract of
    ``runner/env.py`` for its first place, and its slot (the rank, size and peers of
    each generation come from the rendezvous)."""
    variables = worker_env_vars(
        rank=where.rank, size=size, local_rank=where.local_rank, local_size=where.local_size,
        cross_rank=where.cross_rank, cross_size=where.cross_size, host=slot[0],
        rendezvous=rendezvous, secret=secret, job_id=job_id)
    variables.update(RONDE_ELASTIC="1", RONDE_SLOT=str(slot[1]),
                     RONDE_ELASTIC_TIMEOUT=f"{elastic_timeout_s:g}",
                     RONDE_START_TIMEOUT=f"{start_timeout_s:g}")
    if reset_limit is not None:
        variables["RONDE_RESET_LIMIT"] = str(reset_limit)
    return variables


def parse_cooldown(values: Sequence[float] | None) -> tuple[float, float] | None:
    if not values:
        return None
    lo, hi = float(values[0]), float(values[1])
    if not 0 <= lo <= hi < math.inf:  # NaN fails every comparison
        raise ConfigError(f"--blacklist-cooldown-range {lo:g} {hi:g}: need 0 <= LO <= HI, "
                          "finite")
    return lo, hi


def drive(driver: ElasticDriver, wait: Callable[[float], None]) -> str:
    """Start ``driver`` and step it until the job ends (``wait(s)`` between steps: let
    the workers' ends be recorded); the end's reason (``done``, ``failure``)."""
    try:
        driver.start()
    except ConfigError as exc:
        driver.fatal = str(exc)
        return "failure"
    reason = ""
    while not reason:
        wait(0.1)
        reason = driver.step()
    return reason


def last_results(workers: Sequence[Any], server: ElasticRendezvous) -> list[Any]:
    """The results of the last generation's workers, in rank order (each worker's
    ``result``; they all ended with 0)."""
    by_slot = {w.elastic_slot: w for w in workers if w.returncode == 0}
    return [by_slot[s].result for s in server.formed()]
