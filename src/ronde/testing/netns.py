"""Simulated hosts: Linux network namespaces joined by a bridge, for multi-host tests.

Each simulated host is a network namespace with one veth link to a bridge in the
caller's namespace, optionally shaped with ``tc`` (rate limit and delay), so a
multi-host ronde job (tcp between hosts, shared memory within one) runs on one
machine. ``ronderun`` reaches the hosts through ``RONDE_REMOTE_SHELL`` (``ip netns
exec <ns> sh -c``) instead of ssh. Needs root and iproute2; everything created is
removed on exit, and only addresses inside the namespaces made here are used.

Example::

    with SimulatedHosts(2, rate="1gbit", delay="0.1ms") as hosts:
        subprocess.run(["ronderun", "-H", hosts.spec(2), ...], env=hosts.env())
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Mapping

_SUBNET = "10.231.{net}.{host}"


def available() -> bool:
    """True when namespaces can be created here (root and iproute2)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=20)


class SimulatedHosts:
    """``n`` namespaces named by their address, bridged, optionally rate-limited."""

    def __init__(self, n: int, rate: str | None = None, delay: str | None = None,
                 tag: str | None = None) -> None:
        self.n = n
        self.rate = rate
        self.delay = delay
        self.tag = tag or f"{os.getpid() % 10000}"
        self.net = 1 + os.getpid() % 250
        self.bridge = f"rdb{self.tag}"
        self.addresses = [_SUBNET.format(net=self.net, host=10 + i) for i in range(n)]
        self.gateway = _SUBNET.format(net=self.net, host=1)
        self.namespaces = [f"ronde-{a}" for a in self.addresses]
        self._created: list[str] = []
        self.delay_applied = False

    def __enter__(self) -> "SimulatedHosts":
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(f"link:{self.bridge}")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            inner, outer = f"rdv{self.tag}i{i}", f"rdv{self.tag}o{i}"
            _ip("netns", "add", ns)
            self._created.append(f"netns:{ns}")
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            self._created.append(f"link:{outer}")
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", self.gateway)
            if self.rate:
                # shape what leaves each host: its egress is its link to the "switch"
                self._tc(ns, inner, "tbf", "rate", self.rate, "burst", "256kb",
                         "latency", "50ms")
            if self.delay:
                # netem may be missing from the kernel; the delay is then left out
                self.delay_applied = self._tc(ns, inner, "netem", "delay", self.delay,
                                              parent=bool(self.rate), check=False)

    @staticmethod
    def _tc(ns: str, dev: str, *qdisc: str, parent: bool = False, check: bool = True) -> bool:
        where = ["parent", "1:1", "handle", "10:"] if parent else ["root", "handle", "1:"]
        proc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                               *where, *qdisc], capture_output=True, text=True, timeout=20)
        if check and proc.returncode != 0:
            raise RuntimeError(f"tc {' '.join(qdisc)} failed: {proc.stderr.strip()}")
        return proc.returncode == 0

    def spec(self, slots: int) -> str:
        """The ``-H`` argument: every simulated host with ``slots`` slots."""
        return ",".join(f"{a}:{slots}" for a in self.addresses)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for ``ronderun``: reach each host through its namespace."""
        out = dict(os.environ if base is None else base)
        out["RONDE_REMOTE_SHELL"] = "ip netns exec ronde-{host} sh -c"
        return out

    def close(self) -> None:
        for item in reversed(self._created):
            kind, name = item.split(":", 1)
            if kind == "netns":
                subprocess.run(["ip", "netns", "pids", name], capture_output=True)
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._created.clear()
