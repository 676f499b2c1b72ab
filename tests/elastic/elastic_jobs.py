"""What the elastic end-to-end tests share: a discovery script over a hosts file."""

from __future__ import annotations

import stat
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
