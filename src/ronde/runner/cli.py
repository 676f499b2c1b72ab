"""``ronderun``: the command-line launcher (flags spelled as ``horovodrun`` spells them).

Example::

    ronderun -np 4 -H host1:2,host2:2 -x PATH --fusion-threshold-mb 32 python train.py

Knob flags (``--transport``, ``--fusion-threshold-mb``, ...) only set ``RONDE_*``
variables for the workers; ``ronde._config`` reads them there. See docs/launcher.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence

from .._config import TRANSPORTS
from .._errors import ConfigError
from . import launch
from .hosts import resolve_hosts

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``ronderun: error: ...``) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        _fail(message)


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"ronderun: error: {message}\n")
    raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    """The ``ronderun`` argument parser."""
    p = _Parser(
        prog="ronderun",
        description="Run a command as N ronde workers, locally or on several hosts.",
        usage="ronderun [-np N] [-H HOSTS | --hostfile FILE] [options] [--] command ...",
    )
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=None,
                   help="number of ranks (default: all slots of -H/--hostfile)")
    p.add_argument("-H", "--hosts", default=None,
                   help="hosts and slots, e.g. host1:2,host2:2 (default: localhost)")
    p.add_argument("--hostfile", default=None,
                   help="file of 'host slots=N' lines (exclusive with -H)")
    p.add_argument("-p", "--ssh-port", type=int, default=None, help="ssh port for remote hosts")
    p.add_argument("-i", "--ssh-identity-file", default=None,
                   help="ssh identity file for remote hosts")
    p.add_argument("-x", dest="env", action="append", default=[], metavar="VAR[=VAL]",
                   help="set VAR for every worker; without =VAL, copy this shell's value "
                        "(repeatable)")
    p.add_argument("--start-timeout", type=float, default=None,
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
    el.add_argument("--elastic-timeout", type=float, default=None, metavar="SECONDS",
                    help="how long to wait for --min-np slots (default: "
                         "$RONDE_ELASTIC_TIMEOUT, $HOROVOD_ELASTIC_TIMEOUT or 600)")
    el.add_argument("--reset-limit", type=int, default=None,
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
    knobs.add_argument("--fusion-threshold-mb", type=float, default=None,
                       help="fusion buffer size in MiB (RONDE_FUSION_THRESHOLD, in bytes)")
    knobs.add_argument("--cycle-time-ms", type=float, default=None,
                       help="engine cycle time (RONDE_CYCLE_TIME)")
    knobs.add_argument("--timeline-filename", default=None,
                       help="write a timeline to this file (RONDE_TIMELINE)")
    knobs.add_argument("--stall-check-warning-time-seconds", type=float, default=None,
                       help="warn about stalled collectives after this long "
                            "(RONDE_STALL_CHECK_TIME)")
    knobs.add_argument("--stall-check-shutdown-time-seconds", type=float, default=None,
                       help="fail stalled collectives after this long "
                            "(RONDE_STALL_SHUTDOWN_TIME)")
    knobs.add_argument("--bind-addr", default=None,
                       help="address workers and the launcher listen on (RONDE_BIND_ADDR)")
    tune = p.add_argument_group("autotune (see docs/autotune.md)")
    tune.add_argument("--autotune", action="store_true", default=None,
                      help="tune fusion threshold, cycle time, inline and spin limits online "
                           "(RONDE_AUTOTUNE)")
    tune.add_argument("--autotune-log-file", default=None, metavar="FILE",
                      help="rank 0 writes each sample to this CSV (RONDE_AUTOTUNE_LOG)")
    for flag, kind, what in (("warmup-samples", int, "samples discarded first"),
                             ("steps-per-sample", int, "training steps per sample"),
                             ("bayes-opt-max-samples", int, "samples of the Bayesian search"),
                             ("gaussian-process-noise", float, "noise term of the search")):
        tune.add_argument(f"--autotune-{flag}", type=kind, default=None,
                          help=f"{what} (RONDE_AUTOTUNE_{flag.upper().replace('-', '_')})")
    knobs.add_argument("--log-level", default=None,
                       help="worker log level, e.g. DEBUG, INFO, WARNING (RONDE_LOG_LEVEL)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the worker command")
    return p


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


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
    knobs = {
        "RONDE_TRANSPORT": args.transport,
        "RONDE_FUSION_THRESHOLD": (None if args.fusion_threshold_mb is None
                                   else str(int(args.fusion_threshold_mb * 1024 * 1024))),
        "RONDE_CYCLE_TIME": None if args.cycle_time_ms is None else _num(args.cycle_time_ms),
        "RONDE_TIMELINE": args.timeline_filename,
        "RONDE_STALL_CHECK_TIME": (None if args.stall_check_warning_time_seconds is None
                                   else _num(args.stall_check_warning_time_seconds)),
        "RONDE_STALL_SHUTDOWN_TIME": (None if args.stall_check_shutdown_time_seconds is None
                                      else _num(args.stall_check_shutdown_time_seconds)),
        "RONDE_BIND_ADDR": args.bind_addr,
        "RONDE_LOG_LEVEL": args.log_level,
        "RONDE_AUTOTUNE": "1" if args.autotune else None,
        "RONDE_AUTOTUNE_LOG": args.autotune_log_file,
    }
    for flag in ("warmup_samples", "steps_per_sample", "bayes_opt_max_samples",
                 "gaussian_process_noise"):
        value = getattr(args, f"autotune_{flag}")
        knobs[f"RONDE_AUTOTUNE_{flag.upper()}"] = None if value is None else _num(value)
    out.update({k: v for k, v in knobs.items() if v is not None})
    return out


def _validate(args: argparse.Namespace) -> float:
    for flag, value in (("--fusion-threshold-mb", args.fusion_threshold_mb),
                        ("--stall-check-warning-time-seconds",
                         args.stall_check_warning_time_seconds),
                        ("--stall-check-shutdown-time-seconds",
                         args.stall_check_shutdown_time_seconds)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {_num(value)}")
    for flag, value in (("--cycle-time-ms", args.cycle_time_ms), ("--timeout", args.timeout),
                        ("--start-timeout", args.start_timeout)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {_num(value)}")
    start_timeout: float | None = args.start_timeout
    if start_timeout is None:
        raw = os.environ.get("RONDE_START_TIMEOUT") or os.environ.get("HOROVOD_START_TIMEOUT")
        try:
            start_timeout = float(raw) if raw else 30.0
        except ValueError:
            raise ConfigError(f"RONDE_START_TIMEOUT={raw!r} is not a number") from None
        if start_timeout <= 0:
            raise ConfigError(f"RONDE_START_TIMEOUT must be positive, got {raw}")
    if args.np is not None and args.np <= 0:
        raise ConfigError(f"-np must be at least 1, got {args.np}")
    if args.np is None and not (args.hosts or args.hostfile or args.host_discovery_script
                                or args.min_np):
        raise ConfigError("-np is required when no -H/--hosts or --hostfile is given")
    return start_timeout


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ronderun``; returns (and exits with) the job's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--check-build"], ["-cb"]):
        from ..cli import doctor

        return doctor()
    args = build_parser().parse_args(argv)
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
        if args.bind_addr:
            os.environ["RONDE_BIND_ADDR"] = args.bind_addr  # the launcher's server, too
        if _is_elastic(args):
            return _run_elastic(args, command, settings, start_timeout)
        if args.mpi:
            from .mpi_launch import run_mpi

            return run_mpi(command, args.np, args.hosts, args.hostfile, settings, start_timeout)
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


def _env_number(names: Sequence[str], default: float) -> float:
    for name in names:
        raw = os.environ.get(name)
        if raw:
            try:
                return float(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a number") from None
    return default


def _run_elastic(args: argparse.Namespace, command: list[str], settings: dict[str, str],
                 start_timeout: float) -> int:
    from .elastic import parse_cooldown, run_elastic

    if args.mpi:
        raise ConfigError("--mpi cannot run an elastic job (--min-np/--max-np/"
                          "--host-discovery-script): MPI's world has a fixed size")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        raise ConfigError("--host-discovery-script and -H/--hostfile exclude each other")
    min_np = args.min_np if args.min_np is not None else (args.np or 1)
    timeout = args.elastic_timeout if args.elastic_timeout is not None else _env_number(
        ("RONDE_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT"), 600.0)
    limit = args.reset_limit
    if limit is None and (os.environ.get("RONDE_RESET_LIMIT")
                          or os.environ.get("HOROVOD_RESET_LIMIT")):
        limit = int(_env_number(("RONDE_RESET_LIMIT", "HOROVOD_RESET_LIMIT"), 0))
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
