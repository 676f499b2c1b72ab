"""Hosts and slots: where each rank of a ``ronderun`` job runs.

``ronderun`` takes its hosts from ``-H host1:2,host2:2`` or from ``--hostfile F``
and fills them in order, as ``horovodrun`` does: ranks ``0..s1-1`` go to the first
host's ``s1`` slots, the next ranks to the second host, and so on, until ``-np``
ranks are placed. Hosts left without a rank are not used.

Per rank this module computes:

* ``local_rank``: the rank's index among the ranks on its host;
* ``local_size``: the number of ranks on its host;
* ``cross_rank``: the index of the rank's host among the hosts used, in the order the
  hosts were given. (Horovod defines the cross rank as the index among the hosts that
  have a rank with the same ``local_rank``; with hosts filled in order and equal slot
  counts, as in nearly every real job, the two definitions agree.)
* ``cross_size``: the number of hosts used.

Slot counts are bounded (:data:`MAX_SLOTS_PER_HOST`, :data:`MAX_RANKS`): far beyond any
real host or job, but a typo such as ``slots=99999999999`` is refused at once instead of
filling the launcher's memory with rank records.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import re
import socket
from typing import Iterable

from .._errors import ConfigError

#: one label of a host name: letters, digits, '-' (not first or last) and '_' (used by
#: container networks' service names), 1 to 63 characters
_LABEL_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_\-]{0,61}[A-Za-z0-9_])?")
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}

#: the most ranks ``ronderun`` starts on one host (a slot count above it is refused)
MAX_SLOTS_PER_HOST = 4096
#: the most ranks ``ronderun`` starts in one job (``-np``, or every slot without ``-np``)
MAX_RANKS = 65536


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """One host and how many ranks it may run.

    Attributes:
        name: the host name or address, as the user wrote it (IPv6 without brackets).
        slots: number of ranks the host may run (at least 1).
    """

    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class RankSlot:
    """The place of one rank in the job (see the module docstring for definitions)."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def _parse_slots(text: str, where: str, host: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ConfigError(f"{where}: slot count {text!r} is not an integer") from None
    if slots <= 0:
        raise ConfigError(f"{where}: a host needs at least 1 slot, got {slots}")
    if slots > MAX_SLOTS_PER_HOST:
        raise ConfigError(f"{where}: host {host!r} has {slots} slots, more than the "
                          f"{MAX_SLOTS_PER_HOST} ranks ronderun starts on one host")
    return slots


def _split_host(item: str, where: str) -> HostSpec:
    """Parse ``host``, ``host:N``, ``[v6addr]`` or ``[v6addr]:N``."""
    item = item.strip()
    if not item:
        raise ConfigError(f"{where}: empty host entry")
    if item.startswith("["):
        end = item.find("]")
        if end < 0:
            raise ConfigError(f"{where}: unclosed '[' in {item!r}")
        name, rest = item[1:end], item[end + 1:]
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{where}: unexpected {rest!r} after {item[:end + 1]!r}")
        slots = _parse_slots(rest[1:], where, name) if rest else 1
    elif item.count(":") == 1:
        name, count = item.split(":")
        slots = _parse_slots(count, where, name)
    else:
        name, slots = item, 1  # a bare name, or a bare IPv6 address (several colons)
    if not valid_host_name(name):
        shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
        raise ConfigError(f"{where}: {shown} is not a valid host name (a name of labels of "
                          "letters, digits, '-' and '_', at most 253 characters, or an IP "
                          "address)")
    return HostSpec(name, slots)


def valid_host_name(name: str) -> bool:
    """Whether ``name`` is an IP address (IPv6 without brackets, with an optional
    ``%scope``) or a host name: dot-separated labels (``_LABEL_RE``), at most 253
    characters, an optional final dot."""
    if not name or len(name) > 253:
        return False
    if ":" in name:
        addr, _, scope = name.partition("%")
        try:
            ipaddress.IPv6Address(addr)
        except ValueError:
            return False
        return "%" not in name or bool(_LABEL_RE.fullmatch(scope))
    if re.fullmatch(r"[0-9.]+", name):  # digits and dots: an IPv4 address or nothing
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            return False
        return True
    labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
    return all(_LABEL_RE.fullmatch(label) for label in labels)


def parse_host_item(item: str, where: str, default_slots: int) -> HostSpec:
    """Parse one ``host``, ``host:N``, ``[v6addr]`` or ``[v6addr]:N`` entry (a line of
    a discovery script's output); ``default_slots`` when it gives no count.

    Raises:
        ConfigError: naming ``where`` and what is wrong.
    """
    spec = _split_host(item, where)
    return spec if _has_slot_suffix(item.strip()) else HostSpec(spec.name, default_slots)


def _has_slot_suffix(item: str) -> bool:
    return "]:" in item if item.startswith("[") else item.count(":") == 1


def _check_unique(hosts: list[HostSpec], where: str) -> list[HostSpec]:
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise ConfigError(
                f"{where}: host {h.name!r} is listed twice; give it once with its total slots")
        seen.add(h.name)
    return hosts


def parse_hosts(text: str) -> list[HostSpec]:
    """Parse a ``-H`` value such as ``"host1:2,host2:2,host3"``.

    Args:
        text: comma-separated ``host[:slots]`` entries; a host without ``:N`` has 1 slot.

    Returns:
        The hosts in the order given.

    Raises:
        ConfigError: on empty entries, bad slot counts or duplicate hosts.
    """
    if not text.strip():
        raise ConfigError("-H/--hosts is empty; write e.g. -H host1:2,host2:2")
    where = f"-H {text}"
    return _check_unique([_split_host(item, where) for item in text.split(",")], where)


def parse_hostfile_lines(lines: Iterable[str], name: str = "hostfile") -> list[HostSpec]:
    """Parse hostfile lines: ``host slots=N``, ``host:N`` or ``host``.

    ``#`` starts a comment; blank lines are ignored.

    Raises:
        ConfigError: naming the file and line of the first bad entry.
    """
    hosts: list[HostSpec] = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{lineno}"
        parts = line.split()
        if len(parts) == 1:
            hosts.append(_split_host(parts[0], where))
            continue
        if len(parts) != 2 or not parts[1].startswith("slots="):
            raise ConfigError(
                f"{where}: cannot parse {line!r}; write 'host slots=N', 'host:N' or 'host'")
        spec = _split_host(parts[0], where)
        if _has_slot_suffix(parts[0]):
            raise ConfigError(f"{where}: give the slots once, either host:N or slots=N")
        hosts.append(HostSpec(spec.name, _parse_slots(parts[1][len("slots="):], where,
                                                      spec.name)))
    if not hosts:
        raise ConfigError(f"{name}: no hosts found (every line is blank or a comment)")
    return _check_unique(hosts, name)


def parse_hostfile(path: str | os.PathLike[str]) -> list[HostSpec]:
    """Read and parse a hostfile (see :func:`parse_hostfile_lines`).

    The file is read as bytes: a line whose entry (the part before any ``#``) is not
    UTF-8 is a bad line; a comment may hold any bytes.

    Raises:
        ConfigError: if the file cannot be read or has a bad line.
    """
    name = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read hostfile {name!r}: {exc.strerror}") from None
    lines = []
    for lineno, raw in enumerate(data.splitlines(), 1):
        entry = raw.split(b"#", 1)[0]
        try:
            lines.append(entry.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{name}:{lineno}: byte {entry[exc.start]:#04x} at column {exc.start + 1} is "
                f"not UTF-8 text; write 'host slots=N', 'host:N' or 'host'") from None
    return parse_hostfile_lines(lines, name)


def assign_ranks(hosts: list[HostSpec], np: int) -> list[RankSlot]:
    """Place ``np`` ranks on ``hosts``, filling each host's slots before the next.

    Args:
        hosts: the hosts, in order.
        np: number of ranks.

    Returns:
        One :class:`RankSlot` per rank, in rank order.

    Raises:
        ConfigError: if ``np`` is not positive, exceeds the total number of slots or
            :data:`MAX_RANKS`.
    """
    total = sum(h.slots for h in hosts)
    if np <= 0:
        raise ConfigError(f"-np must be at least 1, got {np}")
    if np > MAX_RANKS:
        raise ConfigError(f"-np {np}: ronderun starts at most {MAX_RANKS} ranks")
    if np > total:
        listing = ", ".join(f"{h.name}:{h.slots}" for h in hosts)
        raise ConfigError(
            f"-np {np} but the hosts give only {total} slot{'s' if total != 1 else ''}: "
            f"{listing}; add hosts or slots, or lower -np")
    placed: list[tuple[str, int]] = []  # (host, ranks on it)
    left = np
    for h in hosts:
        if left == 0:
            break
        take = min(h.slots, left)
        placed.append((h.name, take))
        left -= take
    out: list[RankSlot] = []
    for cross_rank, (name, count) in enumerate(placed):
        for local_rank in range(count):
            out.append(RankSlot(rank=len(out), host=name, local_rank=local_rank,
                                local_size=count, cross_rank=cross_rank,
                                cross_size=len(placed)))
    return out


def resolve_hosts(hosts: str | None = None, hostfile: str | os.PathLike[str] | None = None,
                  ) -> list[HostSpec]:
    """The host list from ``-H`` or ``--hostfile``, or an empty list if neither is given.

    Raises:
        ConfigError: if both are given, or either is malformed.
    """
    if hosts and hostfile:
        raise ConfigError("give either -H/--hosts or --hostfile, not both")
    if hosts:
        return parse_hosts(hosts)
    if hostfile:
        return parse_hostfile(hostfile)
    return []


def layout(np: int | None, hosts: str | None = None,
           hostfile: str | os.PathLike[str] | None = None) -> list[RankSlot]:
    """Resolve ``-np``/``-H``/``--hostfile`` into the per-rank layout.

    Without hosts, all ranks run on ``localhost``. Without ``np``, every slot is used.

    Raises:
        ConfigError: on bad input (see :func:`parse_hosts`, :func:`assign_ranks`).
    """
    specs = resolve_hosts(hosts, hostfile)
    if not specs:
        if np is None:
            raise ConfigError("-np is required when no -H/--hosts or --hostfile is given")
        if np > MAX_SLOTS_PER_HOST:
            raise ConfigError(f"-np {np} on localhost: more than the {MAX_SLOTS_PER_HOST} "
                              "ranks ronderun starts on one host; give hosts with -H/--hostfile")
        specs = [HostSpec("localhost", max(np, 1))]
    return assign_ranks(specs, ranks_wanted(specs, np))


def ranks_wanted(specs: list[HostSpec], np: int | None) -> int:
    """``np``, or without it every slot of ``specs``.

    Raises:
        ConfigError: if that is more than :data:`MAX_RANKS`.
    """
    if np is not None:
        return np
    total = sum(h.slots for h in specs)
    if total > MAX_RANKS:
        raise ConfigError(f"the hosts give {total} slots, more than the {MAX_RANKS} ranks "
                          "ronderun starts in one job; give -np")
    return total


@functools.lru_cache(maxsize=1)
def _own_names_and_addresses() -> frozenset[str]:
    names = {"localhost"}
    try:
        hostname = socket.gethostname()
        names.add(hostname.lower())
        names.add(socket.getfqdn().lower())
        for info in socket.getaddrinfo(hostname, None):
            names.add(str(info[4][0]))
    except OSError:
        pass
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        # the address the default route would use; connect() on UDP sends nothing
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                names.add(str(s.getsockname()[0]))
        except OSError:
            pass
    return frozenset(names)


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (so its ranks are started without ssh).

    True for ``localhost``, any ``127.x.y.z``, ``::1``, this machine's host name and
    fully qualified name, and its own addresses. Names are not looked up in DNS: an
    alias that resolves to this machine counts as remote (and works over ssh).
    """
    name = host.strip("[]").lower()
    if name in _LOCAL_NAMES:
        return True
    try:
        addr = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        addr = None
    if addr is not None and (addr.is_loopback or addr.is_unspecified):
        return True
    return name in _own_names_and_addresses()


def places(hosts: list[str]) -> list[RankSlot]:
    """Rank, local and cross rank of each rank, given every rank's host (in rank order):
    what a launcher tells its workers (cross rank = the host's index in order of first
    appearance). Shared by ronderun's elastic driver, Ray and Spark."""
    order = list(dict.fromkeys(hosts))
    out = []
    for rank, host in enumerate(hosts):
        local = [r for r, h in enumerate(hosts) if h == host]
        out.append(RankSlot(rank, host, local.index(rank), len(local), order.index(host),
                            len(order)))
    return out
