"""What the elastic end-to-end tests and their workers share: a discovery script over a
hosts file, and a wait for a listed host to join."""

from __future__ import annotations

import stat
import time
from pathlib import Path


def discovery_script(tmp_path: Path, hosts: list[str]) -> Path:
    """A script printing ``tmp_path/hosts`` (one host per line), written with ``hosts``;
    the workers change that file to add and remove hosts while the job runs. Hosts in
    ``tmp_path/hosts.pending`` are listed once that file is 2 s old (a machine that
    arrives a while after another one was lost)."""
    (tmp_path / "hosts").write_text("".join(f"{h}\n" for h in hosts))
    script = tmp_path / "discover.sh"
    pending = tmp_path / "hosts.pending"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n"
                      f"if [ -f {pending} ] && [ $(( $(date +%s) - $(stat -c %Y {pending}) )) "
                      f"-ge 2 ]; then cat {pending}; fi\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def list_host(hosts_file: str, host: str) -> None:
    """Add ``host`` to the discovery file unless it is listed already (a worker that
    re-formed at the step where it added it must not list it twice)."""
    with open(hosts_file, "a+") as f:
        f.seek(0)
        if host not in f.read().split():
            f.write(host + "\n")


def wait_to_grow(commit, rounds: int = 600, every: float = 0.1) -> None:
    """Call ``commit`` every ``every`` seconds until the launcher's host update interrupts
    it, at most ``rounds`` times. A worker that has just listed a new host waits here for
    it instead of racing the rest of its steps against discovery (the join is then part
    of every run, however slow the machine). Every rank stays in lockstep: a commit's
    host check is collective, so all of them raise at the same round."""
    for _ in range(rounds):
        time.sleep(every)
        commit()
