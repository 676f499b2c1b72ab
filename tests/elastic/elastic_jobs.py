"""What the elastic end-to-end tests share: a discovery script over a hosts file."""

from __future__ import annotations

import stat
from pathlib import Path


def discovery_script(tmp_path: Path, hosts: list[str]) -> Path:
    """A script printing ``tmp_path/hosts`` (one host per line), written with ``hosts``;
    the workers change that file to add and remove hosts while the job runs."""
    (tmp_path / "hosts").write_text("".join(f"{h}\n" for h in hosts))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script
