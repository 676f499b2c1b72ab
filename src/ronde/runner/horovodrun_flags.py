"""horovodrun's flags that ``ronderun`` accepts for compatibility, and the table of all of them.

``ronderun`` (``runner/cli.py``) spells its flags as ``horovodrun`` does. Most of them mean
the same there; this module holds the others: flags mapped to ronde's nearest equivalent
(``--network-interface``, ``--torus-allreduce``, ``--mpi-args``, ``--binding-args``),
flags accepted and ignored with a one-line note (they tune parts ronde does not have),
and flags refused with the reason and what to do instead (exit code 2).

:data:`HOROVODRUN_FLAGS` lists every flag of ``horovodrun`` with what ``ronderun`` does
with it; docs/compat.md ("horovodrun flags") shows the same table, and a test keeps the
table, the docs and the parser in step.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import struct
import sys
from typing import Any, Sequence

from .._errors import ConfigError

SAME, MAPPED, IGNORED, REFUSED = "same", "mapped", "ignored", "refused"


def _each(status: str, *flags: str) -> dict[str, str]:
    return dict.fromkeys(flags, status)


#: every flag of ``horovodrun`` (``horovod/runner/launch.py`` at horovod/horovod@2626dc87,
#: Horovod 0.28.1) and what ``ronderun`` does with it: the same thing, its nearest
#: equivalent (mapped), nothing but a note (ignored), or an error naming why (refused)
HOROVODRUN_FLAGS: dict[str, str] = {
    **_each(SAME, "-h", "--help", "-v", "--version", "-np", "--num-proc", "-cb",
            "--check-build", "--start-timeout", "--output-filename", "--verbose", "-p",
            "--ssh-port", "-i", "--ssh-identity-file", "--fusion-threshold-mb",
            "--cycle-time-ms", "--cache-capacity", "--no-torus-allreduce",
            "--no-hierarchical-allgather", "--autotune", "--no-autotune",
            "--autotune-log-file", "--autotune-warmup-samples", "--autotune-steps-per-sample",
            "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise",
            "--min-np", "--min-num-proc", "--max-np", "--max-num-proc", "--slots-per-host",
            "--elastic-timeout", "--reset-limit", "--blacklist-cooldown-range",
            "--timeline-filename", "--timeline-mark-cycles", "--no-timeline-mark-cycles",
            "--no-stall-check", "--stall-check", "--stall-check-warning-time-seconds",
            "--stall-check-shutdown-time-seconds", "--no-mpi-threads-disable", "--mpi-args",
            "--binding-args", "--log-level", "-H", "--hosts", "-hostfile", "--hostfile",
            "--host-discovery-script", "--mpi"),
    **_each(MAPPED, "--network-interfaces", "--network-interface", "--hierarchical-allreduce",
            "--no-hierarchical-allreduce", "--torus-allreduce", "--tcp", "--gloo"),
    **_each(IGNORED, "--disable-cache", "--hierarchical-allgather", "--mpi-threads-disable",
            "--num-nccl-streams", "--thread-affinity", "--gloo-timeout-seconds",
            "--log-with-timestamp", "--log-without-timestamp", "--log-hide-timestamp",
            "--no-log-hide-timestamp", "-prefix-timestamp", "--prefix-output-with-timestamp"),
    **_each(REFUSED, "--config-file", "--jsrun"),
}

_LOG_FORMAT = ("ronde logs through Python's logging and installs no handler: timestamps "
               "are your program's logging format")
#: (spellings, type of the value or None for a switch, why it does nothing in ronde)
_IGNORED: tuple[tuple[tuple[str, ...], type | None, str], ...] = (
    (("--disable-cache",), None,
     "ronderun runs no host checks before a job, so it caches none"),
    (("--hierarchical-allgather",), None,
     "ronde's allgather has no hierarchical form (its hierarchical transport covers "
     "allreduce)"),
    (("--mpi-threads-disable",), None,
     "ronde's mpi transport needs MPI_THREAD_MULTIPLE (its executor thread makes the MPI "
     "calls)"),
    (("--num-nccl-streams",), int,
     "ronde has no NCCL stream setting (CUDA tensors use one torch.distributed NCCL group "
     "per process set)"),
    (("--thread-affinity",), int,
     "ronde has no background-thread affinity setting; pin the whole process instead "
     "(taskset, numactl)"),
    (("--gloo-timeout-seconds",), int,
     "ronde has no Gloo operation timeout; a stalled collective fails after "
     "--stall-check-shutdown-time-seconds"),
    (("--log-with-timestamp",), None, _LOG_FORMAT),
    (("--log-without-timestamp",), None, _LOG_FORMAT),
    (("--log-hide-timestamp",), None, _LOG_FORMAT),
    (("--no-log-hide-timestamp",), None, _LOG_FORMAT),
    (("-prefix-timestamp", "--prefix-output-with-timestamp"), None,
     "ronderun prefixes each output line with its rank, not a time"),
)
#: (spellings, takes a value, why ronderun refuses it and what to do instead)
_REFUSED: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("--config-file",), True,
     "ronderun reads no Horovod YAML config file; give its settings as flags, or as "
     "RONDE_*/HOROVOD_* variables (docs/configuration.md)"),
    (("--jsrun",), False,
     "ronderun cannot launch through jsrun; start the job with jsrun itself, as with mpirun "
     "(docs/launcher.md, 'Without ronderun'), or use -H/--hostfile"),
)
#: hidden in horovodrun's --help too
_HIDDEN = frozenset({"--log-with-timestamp", "--log-hide-timestamp", "--no-log-hide-timestamp"})
_TORUS_NOTE = ("--torus-allreduce: ronde has no NCCL torus allreduce; its hierarchical "
               "allreduce runs instead (shm within hosts, tcp across: "
               "RONDE_HIERARCHICAL_ALLREDUCE=1)")


def _note(namespace: argparse.Namespace, text: str) -> None:
    # a new list each time: argparse would share a default list between parses
    setattr(namespace, "horovodrun_notes", [*getattr(namespace, "horovodrun_notes", []), text])


class _Ignored(argparse.Action):
    """Accepts the flag (and its value); leaves a note saying why it has no effect."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "",
                 **kwargs: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if self.reason:
            _note(namespace, f"{option_string} is ignored: {self.reason}")


class _Refused(argparse.Action):
    """Stops the parse: ``ronderun: error: FLAG: reason`` and exit code 2."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "",
                 **kwargs: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {self.reason}")


class _Torus(argparse.Action):
    """``--torus-allreduce`` (ronde's hierarchical allreduce, with a note) and its negation."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const)
        if self.const:
            _note(namespace, _TORUS_NOTE)


class _Interfaces(argparse.Action):
    """``--network-interface(s) A[,B]``, repeatable: the names in order, each once."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        names = list(getattr(namespace, self.dest, None) or [])
        for name in str(values).split(","):
            if not name.strip():
                parser.error(f"{option_string} {values!r}: an empty interface name")
            if name.strip() not in names:
                names.append(name.strip())
        setattr(namespace, self.dest, names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add horovodrun's flags that only this module handles to ``parser``."""
    group = parser.add_argument_group(
        "more horovodrun flags (what each does here: docs/compat.md, 'horovodrun flags')")
    group.add_argument("--network-interfaces", "--network-interface", "--nics", dest="nics",
                       action=_Interfaces, default=None, metavar="IFACE",
                       help="bind the launcher and this host's workers to the first of these "
                            "interfaces that has an IPv4 address (other hosts' workers use "
                            "their address on that network); also sets GLOO_SOCKET_IFNAME "
                            "and NCCL_SOCKET_IFNAME for the workers")
    group.add_argument("--torus-allreduce", dest="torus_allreduce", action=_Torus, nargs=0,
                       const=True, default=None,
                       help="ronde's hierarchical allreduce (it has no NCCL torus)")
    group.add_argument("--no-torus-allreduce", dest="torus_allreduce", action=_Torus, nargs=0,
                       const=False, help=argparse.SUPPRESS)
    group.add_argument("--mpi-args", default=None, metavar="'ARGS'",
                       help="with --mpi: more options for mpiexec/mpirun, e.g. "
                            "--mpi-args='--map-by ppr:4:node'")
    group.add_argument("--binding-args", default=None, metavar="'ARGS'",
                       help="with --mpi: process-binding options for mpiexec/mpirun")
    group.add_argument("--no-hierarchical-allgather", "--no-mpi-threads-disable",
                       action=_Ignored, nargs=0, help=argparse.SUPPRESS)
    for flags, kind, reason in _IGNORED:
        group.add_argument(*flags, action=_Ignored, reason=reason,
                           nargs=0 if kind is None else None, type=kind,
                           metavar=None if kind is None else "N",
                           help=(argparse.SUPPRESS if flags[0] in _HIDDEN
                                 else "ignored (a note says why)"))
    for flags, takes_value, reason in _REFUSED:
        group.add_argument(*flags, action=_Refused, reason=reason,
                           nargs=None if takes_value else 0, help=argparse.SUPPRESS)


def check(args: argparse.Namespace) -> None:
    """Refuse combinations of these flags that ronderun cannot honour.

    Raises:
        ConfigError: naming the flags, the reason and what to do instead.
    """
    for flag, value in (("--mpi-args", args.mpi_args), ("--binding-args", args.binding_args)):
        if value is not None and not args.mpi:
            raise ConfigError(f"{flag} passes options to mpirun, which ronderun runs only with "
                              f"--mpi; add --mpi, or leave {flag} out (ronderun starts the "
                              "workers itself)")
    if args.nics and args.mpi:
        iface = args.nics[0]
        raise ConfigError(f"--network-interface with --mpi: name the interface to MPI itself, "
                          f"e.g. --mpi-args='--mca btl_tcp_if_include {iface}' (Open MPI) or "
                          f"--mpi-args='-iface {iface}' (MPICH)")
    if args.nics and args.bind_addr:
        raise ConfigError("--network-interface and --bind-addr exclude each other: give the "
                          "interface or its address, not both")
    if args.torus_allreduce and args.hierarchical_allreduce is False:
        raise ConfigError("--torus-allreduce and --no-hierarchical-allreduce contradict each "
                          "other: ronde runs the torus as its hierarchical allreduce")


def mpi_options(args: argparse.Namespace) -> list[str]:
    """``--binding-args`` then ``--mpi-args``, split as a shell would, for mpiexec."""
    out: list[str] = []
    for flag, value in (("--binding-args", args.binding_args), ("--mpi-args", args.mpi_args)):
        try:
            out += shlex.split(value or "")
        except ValueError as exc:
            raise ConfigError(f"{flag} {value!r}: {exc}") from None
    return out


def interface_variables(args: argparse.Namespace) -> dict[str, str]:
    """What ``--network-interface`` tells torch's Gloo and NCCL (as Horovod does)."""
    if not args.nics:
        return {}
    names = ",".join(args.nics)
    return {"GLOO_SOCKET_IFNAME": names, "NCCL_SOCKET_IFNAME": names}


_SIOCGIFADDR = 0x8915  # Linux: an interface's (first) IPv4 address


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` on this host; None when it has none."""
    import fcntl

    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        except OSError:  # EADDRNOTAVAIL: no IPv4 address; ENODEV: no such interface
            return None
    return socket.inet_ntoa(reply[20:24])


def bind_address(names: Sequence[str]) -> str:
    """The address ``--network-interface NAME[,NAME]`` binds to: the IPv4 address of the
    first named interface that has one, on this host.

    Raises:
        ConfigError: for an interface this host lacks, or when none of them has an IPv4
            address; the message lists this host's interfaces.
    """
    if not sys.platform.startswith("linux"):
        raise ConfigError(f"--network-interface {','.join(names)}: ronderun finds an "
                          "interface's address on Linux only; give --bind-addr ADDR")
    known = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name not in known:
            raise ConfigError(f"--network-interface {name}: no such network interface on this "
                              f"host (it has: {', '.join(known)})")
    for name in names:
        addr = interface_ipv4(name)
        if addr is not None:
            return addr
    which = (f"{names[0]} has no" if len(names) == 1
             else f"none of {', '.join(names)} has an")
    raise ConfigError(f"--network-interface {','.join(names)}: {which} IPv4 address on "
                      "this host; name an interface that has one (see `ip -4 addr`), or give "
                      "--bind-addr ADDR")
