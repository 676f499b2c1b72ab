"""``ronderun``: the command-line launcher (flags spelled as ``horovodrun`` spells them).

Example::

    ronderun -np 4 -H host1:2,host2:2 -x PATH --fusion-threshold-mb 32 python train.py

Knob flags (``--transport``, ``--fusion-threshold-mb``, ...) only set ``RONDE_*``
variables for the workers; ``ronde._config`` reads them there. See docs/launcher.md.
horovodrun's flags that ronde maps, ignores or refuses are in ``horovodrun_flags``
(the table of all of horovodrun's flags: docs/compat.md).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, NoReturn, Sequence

from .. import __version__, _config
from .._config import KNOBS, TRANSPORTS
from .._errors import ConfigError
from . import horovodrun_flags, launch
from .hosts import MAX_RANKS, MAX_SLOTS_PER_HOST, resolve_hosts

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``ronderun: error: ...``) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        _fail(message)


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"ronderun: error: {message}\n")
    raise SystemExit(EXIT_USAGE)


def _knob_number(var: str, scale: int = 1) -> Callable[[str], float]:
    """An argparse type for a flag that sets knob ``var`` (to ``scale`` x the flag's value):
    a number inside the knob's range, else the range in the error (NaN never passes)."""
    knob = next(k for k in KNOBS if k.var == var)
    kind = int if knob.parse is int else float

    def convert(text: str) -> float:
        value = kind(text)  # a ValueError: argparse's "invalid float value: 'x'"
        try:
            knob.check(value * scale, repr(text) + (" MiB" if scale == 1 << 20 else ""))
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    convert.__name__ = kind.__name__
    return convert


def build_parser() -> argparse.ArgumentParser:
    """The ``ronderun`` argument parser."""
    p = _Parser(
        prog="ronderun",
        description="Run a command as N ronde workers, locally or on several hosts.",
        usage="ronderun [-np N] [-H HOSTS | --hostfile FILE] [options] [--] command ...",
    )
    p.add_argument("-v", "--version", action="version", version=f"ronderun (ronde) {__version__}",
                   help="print ronde's version and exit")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="print which transports and frameworks ronde can use on this machine "
                        "and exit (the same as 'ronde doctor')")
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=None,
                   help="number of ranks (default: all slots of -H/--hostfile)")
    p.add_argument("-H", "--hosts", default=None,
                   help="hosts and slots, e.g. host1:2,host2:2 (default: localhost)")
    p.add_argument("-hostfile", "--hostfile", default=None,
                   help="file of 'host slots=N' lines (exclusive with -H)")
    p.add_argument("-p", "--ssh-port", type=int, default=None, help="ssh port for remote hosts")
    p.add_argument("-i", "--ssh-identity-file", default=None,
                   help="ssh identity file for remote hosts")
    p.add_argument("-x", dest="env", action="append", default=[], metavar="VAR[=VAL]",
                   help="set VAR for every worker; without =VAL, copy this shell's value "
                        "(repeatable)")
    p.add_argument("--start-timeout", type=_knob_number("RONDE_START_TIMEOUT"), default=None,
                   help="seconds ranks may take to start and meet (default: "
                        "$RONDE_START_TIMEOUT or 30)")
    p.add_argument("--output-filename", default=None, metavar="DIR",
                   help="also write each rank's output to DIR/rank.N/{stdout,stderr}")
    p.add_argument("--verbose", action="store_true",
                   help="print the host/rank layout and worker commands at start")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="wall-clock limit for the whole job; exit 124 when reached")
    el = p.add_argument_group("elastic jobs (ranks may leave and join; see docs/elastic.md)")
    el.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, default=None,
                    help="run elastically with at least this many ranks")
    el.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, default=None,
                    help="at most this many ranks (default: every slot found)")
    el.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                    help="prints the available hosts, one 'host' or 'host:slots' per line")
    el.add_argument("--slots-per-host", "--slots", dest="slots_per_host", type=int, default=None,
                    help="slots of a discovered host without a count (default 1)")
    el.add_argument("--elastic-timeout", type=_knob_number("RONDE_ELASTIC_TIMEOUT"),
                    default=None, metavar="SECONDS",
                    help="how long to wait for --min-np slots (default: "
                         "$RONDE_ELASTIC_TIMEOUT, $HOROVOD_ELASTIC_TIMEOUT or 600)")
    el.add_argument("--reset-limit", type=_knob_number("RONDE_RESET_LIMIT"), default=None,
                    help="fail the job after this many re-formations")
    el.add_argument("--blacklist-cooldown-range", type=float, nargs=2, default=None,
                    metavar=("LO", "HI"),
                    help="a failed host comes back after a random LO..HI seconds "
                         "(default: never)")
    knobs = p.add_argument_group("worker settings (set RONDE_* variables for the workers)")
    knobs.add_argument("--transport", choices=TRANSPORTS, default=None,
                       help="data transport (RONDE_TRANSPORT)")
    knobs.add_argument("--mpi", action="store_true",
                       help="launch with the environment's mpiexec/mpirun and move the bytes "
                            "with MPI (RONDE_TRANSPORT=mpi)")
    for name in ("gloo", "tcp", "shm"):
        knobs.add_argument(f"--{name}", dest="transport", action="store_const", const=name,
                           help=f"same as --transport {name} (horovodrun spelling)")
    knobs.add_argument("--fusion-threshold-mb", default=None,
                       type=_knob_number("RONDE_FUSION_THRESHOLD", scale=1 << 20),
                       help="fusion buffer size in MiB (RONDE_FUSION_THRESHOLD, in bytes)")
    knobs.add_argument("--cycle-time-ms", type=_knob_number("RONDE_CYCLE_TIME"), default=None,
                       help="engine cycle time (RONDE_CYCLE_TIME)")
    knobs.add_argument("--cache-capacity", type=_knob_number("RONDE_CACHE_CAPACITY"),
                       default=None, metavar="N",
                       help="response cache entries (RONDE_CACHE_CAPACITY)")
    knobs.add_argument("--hierarchical-allreduce", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="shm within hosts, tcp across, where the layout allows "
                            "(RONDE_HIERARCHICAL_ALLREDUCE; default auto: on where it can)")
    knobs.add_argument("--timeline-filename", default=None,
                       help="write a timeline to this file (RONDE_TIMELINE)")
    knobs.add_argument("--timeline-mark-cycles", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="mark every negotiation round on the timeline "
                            "(RONDE_TIMELINE_MARK_CYCLES)")
    knobs.add_argument("--stall-check", action=argparse.BooleanOptionalAction, default=None,
                       help="--no-stall-check turns the stall inspector off (RONDE_STALL_CHECK)")
    knobs.add_argument("--stall-check-warning-time-seconds", default=None,
                       type=_knob_number("RONDE_STALL_CHECK_TIME"),
                       help="warn about stalled collectives after this long "
                            "(RONDE_STALL_CHECK_TIME)")
    knobs.add_argument("--stall-check-shutdown-time-seconds", default=None,
                       type=_knob_number("RONDE_STALL_SHUTDOWN_TIME"),
                       help="fail stalled collectives after this long "
                            "(RONDE_STALL_SHUTDOWN_TIME)")
    knobs.add_argument("--bind-addr", default=None,
                       help="address workers and the launcher listen on (RONDE_BIND_ADDR)")
    tune = p.add_argument_group("autotune (see docs/autotune.md)")
    tune.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=None,
                      help="tune fusion threshold, cycle time, inline and spin limits online "
                           "(RONDE_AUTOTUNE)")
    tune.add_argument("--autotune-log-file", default=None, metavar="FILE",
                      help="rank 0 writes each sample to this CSV (RONDE_AUTOTUNE_LOG)")
    for flag, what in (("warmup-samples", "samples discarded first"),
                       ("steps-per-sample", "training steps per sample"),
                       ("bayes-opt-max-samples", "samples of the Bayesian search"),
                       ("gaussian-process-noise", "noise term of the search")):
        var = f"RONDE_AUTOTUNE_{flag.upper().replace('-', '_')}"
        tune.add_argument(f"--autotune-{flag}", type=_knob_number(var), default=None,
                          help=f"{what} ({var})")
    knobs.add_argument("--log-level", default=None,
                       help="worker log level, e.g. DEBUG, INFO, WARNING (RONDE_LOG_LEVEL)")
    horovodrun_flags.add_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the worker command")
    return p


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _switch(value: bool | None) -> str | None:
    return None if value is None else ("1" if value else "0")


def worker_settings(args: argparse.Namespace, environ: dict[str, str] | None = None,
                    ) -> dict[str, str]:
    """The variables the flags ask for: ``-x`` entries plus the knob flags.

    Raises:
        ConfigError: for a ``-x VAR`` whose VAR is not set here, or a bad name.
    """
    environ = dict(os.environ) if environ is None else environ
    out: dict[str, str] = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise ConfigError(f"-x {item!r}: {name!r} is not a valid variable name")
        if not sep:
            if name not in environ:
                raise ConfigError(f"-x {name}: {name} is not set in this shell; "
                                  f"export it or write -x {name}=VALUE")
            value = environ[name]
        out[name] = value
    hierarchical = args.hierarchical_allreduce
    if hierarchical is None and args.torus_allreduce:
        hierarchical = True  # ronde's nearest to Horovod's NCCL torus
    knobs = {
        "RONDE_TRANSPORT": args.transport,
        "RONDE_FUSION_THRESHOLD": (None if args.fusion_threshold_mb is None
                                   else str(int(args.fusion_threshold_mb * 1024 * 1024))),
        "RONDE_CYCLE_TIME": None if args.cycle_time_ms is None else _num(args.cycle_time_ms),
        "RONDE_CACHE_CAPACITY": None if args.cache_capacity is None else _num(args.cache_capacity),
        "RONDE_HIERARCHICAL_ALLREDUCE": _switch(hierarchical),
        "RONDE_TIMELINE": args.timeline_filename,
        "RONDE_TIMELINE_MARK_CYCLES": _switch(args.timeline_mark_cycles),
        "RONDE_STALL_CHECK": _switch(args.stall_check),
        "RONDE_STALL_CHECK_TIME": (None if args.stall_check_warning_time_seconds is None
                                   else _num(args.stall_check_warning_time_seconds)),
        "RONDE_STALL_SHUTDOWN_TIME": (None if args.stall_check_shutdown_time_seconds is None
                                      else _num(args.stall_check_shutdown_time_seconds)),
        "RONDE_BIND_ADDR": args.bind_addr,
        "RONDE_LOG_LEVEL": args.log_level,
        "RONDE_AUTOTUNE": _switch(args.autotune),
        "RONDE_AUTOTUNE_LOG": args.autotune_log_file,
    }
    for flag in ("warmup_samples", "steps_per_sample", "bayes_opt_max_samples",
                 "gaussian_process_noise"):
        value = getattr(args, f"autotune_{flag}")
        knobs[f"RONDE_AUTOTUNE_{flag.upper()}"] = None if value is None else _num(value)
    out.update({k: v for k, v in knobs.items() if v is not None})
    for name, value in horovodrun_flags.interface_variables(args).items():
        out.setdefault(name, value)  # -x NCCL_SOCKET_IFNAME=... wins
    return out


def _setting(field: str) -> float:
    """A float knob's value from this shell's environment (read and checked as the workers
    read it), else its default."""
    value = _config.setting(field)
    if value is None:
        value = getattr(_config.Config(), field)
    return float(value)  # type: ignore[arg-type]


def _validate(args: argparse.Namespace) -> float:
    # the knob flags were range-checked as they were parsed (_knob_number)
    if args.timeout is not None and not 0 < args.timeout < math.inf:
        raise ConfigError(
            f"--timeout must be a positive number of seconds, got {_num(args.timeout)}")
    start_timeout = args.start_timeout
    if start_timeout is None:
        start_timeout = _setting("start_timeout_s")
    if args.np is not None and args.np <= 0:
        raise ConfigError(f"-np must be at least 1, got {args.np}")
    for flag, count in (("-np", args.np), ("--min-np", args.min_np), ("--max-np", args.max_np)):
        if count is not None and count > MAX_RANKS:
            raise ConfigError(f"{flag} {count}: ronderun starts at most {MAX_RANKS} ranks")
    if args.slots_per_host is not None and not 1 <= args.slots_per_host <= MAX_SLOTS_PER_HOST:
        raise ConfigError(f"--slots-per-host {args.slots_per_host}: need 1 to "
                          f"{MAX_SLOTS_PER_HOST} (the most ranks ronderun starts on one host)")
    if args.np is None and not (args.hosts or args.hostfile or args.host_discovery_script
                                or args.min_np):
        raise ConfigError("-np is required when no -H/--hosts or --hostfile is given")
    horovodrun_flags.check(args)
    return start_timeout


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ronderun``; returns (and exits with) the job's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.check_build:
        from ..cli import doctor

        return doctor()
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        _fail("no command given; write e.g. ronderun -np 2 python train.py")
    after_dashes = "--" in argv[:len(argv) - len(command)]
    if command[0].startswith("-") and not after_dashes:
        _fail(f"unknown option {command[0]!r} (the command starts at the first argument "
              "that is not an option; put -- before it if it starts with '-')")
    try:
        start_timeout = _validate(args)
        resolve_hosts(args.hosts, args.hostfile)  # report host errors before anything runs
        settings = worker_settings(args)
        _config.check(settings)  # e.g. -x RONDE_CYCLE_TIME=nan: refused before any worker
        # --network-interface's address is this host's: the launcher's server and the
        # workers here bind to it; other hosts' workers bind where it routes from there
        bind_addr = args.bind_addr
        if args.nics:
            bind_addr = horovodrun_flags.bind_address(args.nics)
        for note in getattr(args, "horovodrun_notes", []):
            sys.stderr.write(f"ronderun: note: {note}\n")
        if bind_addr:
            os.environ["RONDE_BIND_ADDR"] = bind_addr  # the launcher's server, too
        if _is_elastic(args):
            return _run_elastic(args, command, settings, start_timeout)
        if args.mpi:
            from .mpi_launch import run_mpi

            # mpiexec's own options go last before the command (mpi_argv appends it)
            return run_mpi(horovodrun_flags.mpi_options(args) + command, args.np, args.hosts,
                           args.hostfile, settings, start_timeout)
        result = launch.run(
            command, args.np, hosts=args.hosts, hostfile=args.hostfile, env=settings,
            start_timeout_s=start_timeout, output_dir=args.output_filename,
            verbose=args.verbose, timeout_s=args.timeout, ssh_port=args.ssh_port,
            ssh_identity=args.ssh_identity_file)
    except ConfigError as exc:
        _fail(str(exc))
    return result.returncode


def _is_elastic(args: argparse.Namespace) -> bool:
    return args.min_np is not None or args.max_np is not None \
        or args.host_discovery_script is not None


def _run_elastic(args: argparse.Namespace, command: list[str], settings: dict[str, str],
                 start_timeout: float) -> int:
    from .elastic import parse_cooldown, run_elastic

    if args.mpi:
        raise ConfigError("--mpi cannot run an elastic job (--min-np/--max-np/"
                          "--host-discovery-script): MPI's world has a fixed size")
    if args.transport == "gloo":
        raise ConfigError("--gloo cannot run an elastic job (--min-np/--max-np/"
                          "--host-discovery-script): torch's Gloo group has a fixed size; "
                          "leave it out (ronde's own shm/tcp transports run elastic jobs)")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        raise ConfigError("--host-discovery-script and -H/--hostfile exclude each other")
    min_np = args.min_np if args.min_np is not None else (args.np or 1)
    timeout = args.elastic_timeout if args.elastic_timeout is not None else _setting(
        "elastic_timeout_s")
    limit = args.reset_limit
    if limit is None:
        env_limit = _config.setting("reset_limit")
        limit = None if env_limit is None else int(env_limit)  # type: ignore[call-overload]
    result = run_elastic(
        command, args.np, min_np, args.max_np, hosts=args.hosts, hostfile=args.hostfile,
        discovery_script=args.host_discovery_script, slots_per_host=args.slots_per_host or 1,
        elastic_timeout_s=timeout, reset_limit=limit,
        cooldown=parse_cooldown(args.blacklist_cooldown_range), env=settings,
        start_timeout_s=start_timeout, output_dir=args.output_filename,
        timeout_s=args.timeout, ssh_port=args.ssh_port, ssh_identity=args.ssh_identity_file)
    return result.returncode


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
