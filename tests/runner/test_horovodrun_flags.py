"""Every horovodrun flag: ronderun does the same, maps it, ignores it with a note, or refuses
it with the reason (exit 2); the table in docs/compat.md says which. In process: the job
launch is replaced by a recorder, so what the flags set is checked without workers."""

from __future__ import annotations

import os
import pathlib
import re
import types
from typing import Any

import pytest

from ronde.runner import horovodrun_flags, launch, mpi_launch
from ronde.runner.cli import build_parser, main
from ronde.runner.horovodrun_flags import HOROVODRUN_FLAGS, IGNORED, REFUSED

pytestmark = pytest.mark.timeout(10)

COMPAT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "docs", "compat.md")


def _launched(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
              *args: str) -> tuple[dict[str, Any], str]:
    """Run ``ronderun -np 1 ARGS true`` with the launch recorded, not run: (what
    launch.run got, with the launcher's RONDE_BIND_ADDR as ``bind``; ronderun's stderr)."""
    seen: dict[str, Any] = {}

    def record(command: list[str], np: int, **kwargs: Any) -> types.SimpleNamespace:
        seen.update(kwargs, command=command, np=np, bind=os.environ.get("RONDE_BIND_ADDR"))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(launch, "run", record)
    monkeypatch.setenv("RONDE_BIND_ADDR", "")  # so that undo removes what main() sets
    monkeypatch.delenv("RONDE_BIND_ADDR")
    assert main(["-np", "1", *args, "true"]) == 0
    return seen, capsys.readouterr().err


def test_every_horovodrun_flag_is_a_ronderun_flag() -> None:
    known = build_parser()._option_string_actions  # argparse's table of flags
    assert [f for f in HOROVODRUN_FLAGS if f not in known] == []


def test_the_compat_docs_table_gives_each_horovodrun_flag_its_status() -> None:
    with open(COMPAT, encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("\n## horovodrun flags\n", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, str] = {}
    for row in section.splitlines():
        if row.startswith("| `"):
            flags, status = row.split("|")[1:3]
            for flag in re.findall(r"`([^`]+)`", flags):
                assert flag not in documented, f"{flag} is in two rows"
                documented[flag] = status.strip()
    assert documented == HOROVODRUN_FLAGS


@pytest.mark.parametrize("args, expected", [
    (["--cache-capacity", "0"], {"RONDE_CACHE_CAPACITY": "0"}),
    (["--hierarchical-allreduce"], {"RONDE_HIERARCHICAL_ALLREDUCE": "1"}),
    (["--no-hierarchical-allreduce"], {"RONDE_HIERARCHICAL_ALLREDUCE": "0"}),
    (["--no-torus-allreduce"], {}),
    (["--timeline-mark-cycles"], {"RONDE_TIMELINE_MARK_CYCLES": "1"}),
    (["--no-timeline-mark-cycles"], {"RONDE_TIMELINE_MARK_CYCLES": "0"}),
    (["--no-stall-check"], {"RONDE_STALL_CHECK": "0"}),
    (["--stall-check"], {"RONDE_STALL_CHECK": "1"}),
    (["--autotune"], {"RONDE_AUTOTUNE": "1"}),
    (["--no-autotune"], {"RONDE_AUTOTUNE": "0"}),
    (["--tcp"], {"RONDE_TRANSPORT": "tcp"}),
    (["--gloo"], {"RONDE_TRANSPORT": "gloo"}),
    (["--log-level", "TRACE"], {"RONDE_LOG_LEVEL": "TRACE"}),
    (["--no-hierarchical-allgather", "--no-mpi-threads-disable"], {}),
])
def test_mapped_flags_set_the_workers_variables_silently(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str],
        expected: dict[str, str]) -> None:
    seen, err = _launched(monkeypatch, capsys, *args)
    assert seen["env"] == expected
    assert err == ""


@pytest.mark.parametrize("args", [["--torus-allreduce"],
                                  ["--torus-allreduce", "--hierarchical-allreduce"]])
def test_torus_allreduce_is_the_hierarchical_allreduce_with_a_note(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        args: list[str]) -> None:
    seen, err = _launched(monkeypatch, capsys, *args)
    assert seen["env"] == {"RONDE_HIERARCHICAL_ALLREDUCE": "1"}
    assert err == ("ronderun: note: --torus-allreduce: ronde has no NCCL torus allreduce; its "
                   "hierarchical allreduce runs instead (shm within hosts, tcp across: "
                   "RONDE_HIERARCHICAL_ALLREDUCE=1)\n")


def test_the_single_dash_hostfile_is_the_hostfile(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: pathlib.Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n")
    seen, _ = _launched(monkeypatch, capsys, "-hostfile", str(hostfile))
    assert seen["hostfile"] == str(hostfile)


LOGS = ("ronde logs through Python's logging and installs no handler: timestamps are your "
        "program's logging format")


IGNORED_CASES = [
    (["--disable-cache"], "ronderun runs no host checks before a job, so it caches none"),
    (["--hierarchical-allgather"], "ronde's allgather has no hierarchical form (its "
                                   "hierarchical transport covers allreduce)"),
    (["--mpi-threads-disable"], "ronde's mpi transport needs MPI_THREAD_MULTIPLE (its "
                                "executor thread makes the MPI calls)"),
    (["--num-nccl-streams", "2"], "ronde has no NCCL stream setting (CUDA tensors use one "
                                  "torch.distributed NCCL group per process set)"),
    (["--thread-affinity", "3"], "ronde has no background-thread affinity setting; pin the "
                                 "whole process instead (taskset, numactl)"),
    (["--gloo-timeout-seconds", "30"], "ronde has no Gloo operation timeout; a stalled "
                                       "collective fails after "
                                       "--stall-check-shutdown-time-seconds"),
    (["--log-with-timestamp"], LOGS),
    (["--log-without-timestamp"], LOGS),
    (["--log-hide-timestamp"], LOGS),
    (["--no-log-hide-timestamp"], LOGS),
    (["-prefix-timestamp"], "ronderun prefixes each output line with its rank, not a time"),
    (["--prefix-output-with-timestamp"], "ronderun prefixes each output line with its rank, "
                                         "not a time"),
]


@pytest.mark.parametrize("args, reason", IGNORED_CASES)
def test_ignored_flags_run_the_job_with_a_note(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str],
        reason: str) -> None:
    seen, err = _launched(monkeypatch, capsys, *args)
    assert seen["env"] == {} and seen["command"] == ["true"]
    assert err == f"ronderun: note: {args[0]} is ignored: {reason}\n"


def test_every_ignored_flag_is_tested() -> None:
    tested = {args[0] for args, _ in IGNORED_CASES}
    assert tested == {f for f, s in HOROVODRUN_FLAGS.items() if s == IGNORED}


REFUSED_CASES = [
    (["--config-file", "horovod.yaml"],
     "--config-file: ronderun reads no Horovod YAML config file; give its settings as flags, "
     "or as RONDE_*/HOROVOD_* variables (docs/configuration.md)"),
    (["--jsrun"],
     "--jsrun: ronderun cannot launch through jsrun; start the job with jsrun itself, as with "
     "mpirun (docs/launcher.md, 'Without ronderun'), or use -H/--hostfile"),
    (["--mpi-args=--map-by ppr:4:node"],
     "--mpi-args passes options to mpirun, which ronderun runs only with --mpi; add --mpi, or "
     "leave --mpi-args out (ronderun starts the workers itself)"),
    (["--binding-args=-bind-to core"],
     "--binding-args passes options to mpirun, which ronderun runs only with --mpi; add "
     "--mpi, or leave --binding-args out (ronderun starts the workers itself)"),
    (["--mpi", "--network-interface", "eth1"],
     "--network-interface with --mpi: name the interface to MPI itself, e.g. "
     "--mpi-args='--mca btl_tcp_if_include eth1' (Open MPI) or --mpi-args='-iface eth1' "
     "(MPICH)"),
    (["--network-interface", "lo", "--bind-addr", "127.0.0.1"],
     "--network-interface and --bind-addr exclude each other: give the interface or its "
     "address, not both"),
    (["--torus-allreduce", "--no-hierarchical-allreduce"],
     "--torus-allreduce and --no-hierarchical-allreduce contradict each other: ronde runs the "
     "torus as its hierarchical allreduce"),
    (["--min-np", "1", "--gloo"],
     "--gloo cannot run an elastic job (--min-np/--max-np/--host-discovery-script): torch's "
     "Gloo group has a fixed size; leave it out (ronde's own shm/tcp transports run elastic "
     "jobs)"),
    (["--mpi", "--mpi-args=--map-by 'ppr"],
     "--mpi-args \"--map-by 'ppr\": No closing quotation"),
]


@pytest.mark.parametrize("args, message", REFUSED_CASES)
def test_refused_flags_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str],
                                              args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["-np", "1", *args, "true"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"ronderun: error: {message}\n"


def test_every_refused_flag_is_tested() -> None:
    tested = {args[0] for args, _ in REFUSED_CASES}
    assert {f for f, s in HOROVODRUN_FLAGS.items() if s == REFUSED} <= tested


def test_mpi_args_go_to_mpiexec_before_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(mpi_launch, "run_mpi", lambda command, *rest: seen.append(command) or 0)
    assert main(["-np", "2", "--mpi", "--mpi-args=--map-by ppr:1:core -x 'A=a b'",
                 "--binding-args=-bind-to core", "python", "t.py"]) == 0
    command = ["-bind-to", "core", "--map-by", "ppr:1:core", "-x", "A=a b", "python", "t.py"]
    assert seen == [command]
    # mpi_argv puts ronde's options first and appends the command: mpiexec reads these
    assert mpi_launch.mpi_argv("mpiexec", "hydra", 2, None, {}, command) == [
        "mpiexec", "-n", "2", "-prepend-rank", *command]


def test_a_network_interface_binds_the_launcher_and_names_it_to_gloo_and_nccl(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen, err = _launched(monkeypatch, capsys, "--network-interface", "lo")
    # the address is this host's: not sent to the workers, whose hosts may differ
    assert seen["env"] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert seen["bind"] == "127.0.0.1" and err == ""


def test_x_keeps_the_users_socket_interface(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    seen, _ = _launched(monkeypatch, capsys, "--nics", "lo", "-x", "NCCL_SOCKET_IFNAME=eth1")
    assert seen["env"] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "eth1"}


@pytest.mark.parametrize("args", [["--network-interfaces", "ib0,lo"],
                                  ["--network-interface", "ib0", "--network-interface", "lo"],
                                  ["--network-interface", "ib0,lo,ib0"]])
def test_the_first_named_interface_with_an_ipv4_address_is_bound(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        args: list[str]) -> None:
    monkeypatch.setattr(horovodrun_flags.socket, "if_nameindex",
                        lambda: [(1, "lo"), (2, "ib0")])
    monkeypatch.setattr(horovodrun_flags, "interface_ipv4", {"lo": "127.0.0.1"}.get)
    seen, _ = _launched(monkeypatch, capsys, *args)
    assert seen["bind"] == "127.0.0.1"
    assert seen["env"] == {"GLOO_SOCKET_IFNAME": "ib0,lo", "NCCL_SOCKET_IFNAME": "ib0,lo"}


@pytest.mark.parametrize("args, message", [
    (["--network-interface", "ib0"],
     "--network-interface ib0: ib0 has no IPv4 address on this host; name an interface that "
     "has one (see `ip -4 addr`), or give --bind-addr ADDR"),
    (["--network-interfaces", "ib0,ib1"],
     "--network-interface ib0,ib1: none of ib0, ib1 has an IPv4 address on this host; name "
     "an interface that has one (see `ip -4 addr`), or give --bind-addr ADDR"),
    (["--network-interface", "eth9"],
     "--network-interface eth9: no such network interface on this host (it has: lo, ib0, ib1)"),
    (["--network-interface", "lo,"], "--network-interface 'lo,': an empty interface name"),
])
def test_an_interface_without_an_ipv4_address_is_an_error_naming_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str],
        message: str) -> None:
    monkeypatch.setattr(horovodrun_flags.socket, "if_nameindex",
                        lambda: [(1, "lo"), (2, "ib0"), (3, "ib1")])
    monkeypatch.setattr(horovodrun_flags, "interface_ipv4", {"lo": "127.0.0.1"}.get)
    with pytest.raises(SystemExit) as exc:
        main(["-np", "1", *args, "true"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"ronderun: error: {message}\n"


def test_interface_ipv4_reads_the_loopbacks_address() -> None:
    assert horovodrun_flags.interface_ipv4("lo") == "127.0.0.1"
