"""A memory cap per process: a child cgroup of its own (v1 or v2), for the capacity bench.

:func:`find_hierarchy` picks where children can be made: under this process's own memory
cgroup first (so a limit the job already has still applies above the child), else at
the hierarchy's root; it makes a child there to be sure, and removes it. v2 is used where
``<mount>/cgroup.controllers`` exists, v1 where ``<mount>/memory`` is the memory
controller's hierarchy. :func:`create` makes a child with a limit (and the same limit on
memory plus swap, or no swap at all, where the kernel offers it, so that a capped
process cannot swap instead of failing); the process joins it by writing its pid
(:func:`join`, at its start); :func:`oom_kills` and :func:`peak_bytes` read what
happened; :func:`remove` takes the child away once its processes are gone.

What a cgroup charges: the anonymous memory its processes touch after they joined (heap,
tensors, the allocator's arenas), the tmpfs and ``/dev/shm`` pages they touch first
(ronde's shared-memory segments: charged to the rank that touched a page first), page
cache they read in; not the file pages already cached before (the code of ``libtorch``
that another process had read, which RSS does count).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time

log = logging.getLogger(__name__)

MOUNT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
#: how long :func:`remove` retries while the kernel is still taking the killed away
REMOVE_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """Where this process makes its children: ``parent`` (a directory), cgroup ``version``."""

    parent: str
    version: int


@dataclasses.dataclass(frozen=True)
class Cap:
    """One child cgroup with a memory limit of ``limit_bytes``."""

    path: str
    version: int
    limit_bytes: int


def _own_path(proc_cgroup: str, version: int) -> str | None:
    """This process's cgroup path in the hierarchy of ``version`` (``/`` for the root)."""
    try:
        with open(proc_cgroup, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if version == 2 and parts[0] == "0" and parts[1] == "":
            return parts[2]
        if version == 1 and "memory" in parts[1].split(","):
            return parts[2]
    return None


def _candidates(mount: str, proc_cgroup: str) -> list[Hierarchy]:
    if os.path.exists(os.path.join(mount, "cgroup.controllers")):
        version, root = 2, mount
    elif os.path.isdir(os.path.join(mount, "memory")):
        version, root = 1, os.path.join(mount, "memory")
    else:
        return []
    own = _own_path(proc_cgroup, version)
    parents = [os.path.join(root, own.strip("/"))] if own and own.strip("/") else []
    return [Hierarchy(p, version) for p in dict.fromkeys(parents + [root])]


def find_hierarchy(mount: str = MOUNT, proc_cgroup: str = PROC_CGROUP) -> Hierarchy | None:
    """Where memory-capped children can be made here, or None (no cgroup, not writable)."""
    for hierarchy in _candidates(mount, proc_cgroup):
        try:
            cap = create(hierarchy, f"ronde-probe-{os.getpid()}", 1 << 30)
        except OSError as exc:
            log.debug("no memory cgroup under %s: %s", hierarchy.parent, exc)
            continue
        remove(cap)
        return hierarchy
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as fh:
        fh.write(value)


def _try_write(path: str, value: str) -> bool:
    try:
        _write(path, value)
    except OSError:
        return False
    return True


def create(hierarchy: Hierarchy, name: str, limit_bytes: int) -> Cap:
    """Make the child ``name`` of ``hierarchy`` with its memory limited to ``limit_bytes``.

    Raises:
        OSError: the child cannot be made or limited (then nothing is left behind).
    """
    if hierarchy.version == 2:  # children get a memory.max only where the parent hands it down
        _try_write(os.path.join(hierarchy.parent, "cgroup.subtree_control"), "+memory")
    path = os.path.join(hierarchy.parent, name)
    os.mkdir(path)
    cap = Cap(path, hierarchy.version, limit_bytes)
    try:
        if hierarchy.version == 2:
            _write(os.path.join(path, "memory.max"), str(limit_bytes))
            _try_write(os.path.join(path, "memory.swap.max"), "0")
        else:
            _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
            # memory + swap at the same limit: no swapping instead of failing (where swap
            # is accounted); charges made before the process joins move with it where the
            # kernel still offers it (Linux 6.18 refuses it: deprecated)
            _try_write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(limit_bytes))
            _try_write(os.path.join(path, "memory.move_charge_at_immigrate"), "1")
    except OSError:
        remove(cap)
        raise
    return cap


def join(path: str, pid: int = 0) -> None:
    """Move process ``pid`` (0: this one) into the cgroup at ``path``."""
    _write(os.path.join(path, "cgroup.procs"), str(pid or os.getpid()))


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def usage_bytes(cap: Cap) -> int | None:
    """The memory charged to the cgroup now."""
    name = "memory.current" if cap.version == 2 else "memory.usage_in_bytes"
    return _read_int(os.path.join(cap.path, name))


def peak_bytes(cap: Cap) -> int | None:
    """The most memory ever charged to the cgroup (None where the kernel does not say)."""
    name = "memory.peak" if cap.version == 2 else "memory.max_usage_in_bytes"
    return _read_int(os.path.join(cap.path, name))


def oom_kills(cap: Cap) -> int:
    """How many processes the kernel killed in the cgroup for want of memory."""
    name = "memory.events" if cap.version == 2 else "memory.oom_control"
    try:
        with open(os.path.join(cap.path, name), encoding="ascii") as fh:
            fields = dict(line.split() for line in fh if len(line.split()) == 2)
    except OSError:
        return 0
    return int(fields.get("oom_kill", 0))


def remove(cap: Cap) -> None:
    """Remove the (empty) cgroup; retries while its killed processes are still going."""
    deadline = time.monotonic() + REMOVE_WAIT_S
    while True:
        try:
            os.rmdir(cap.path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                log.warning("could not remove the cgroup %s: %s; remove it with rmdir",
                            cap.path, exc.strerror)
                return
            time.sleep(0.05)
