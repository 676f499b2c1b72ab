"""Addresses: which local address reaches a host, and a free port to listen on.

Shared by the launcher (what to tell remote workers), the runtime (what a rank
advertises to its peers) and the bindings that start a torch.distributed store.
"""

from __future__ import annotations

import logging
import socket

from .._config import setting

log = logging.getLogger(__name__)


def route_address(host: str) -> str:
    """The address of this machine that routes to ``host`` (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return str(s.getsockname()[0])
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        log.warning("cannot find an address of this machine that %s can reach; "
                    "using 127.0.0.1 (set RONDE_BIND_ADDR)", host)
        return "127.0.0.1"


def bind_for(told: str) -> str:
    """Where a service listens whose peers are told to connect to ``told`` (a host name
    or an address of this machine): ``RONDE_BIND_ADDR`` if set, else ``told``'s address
    when this machine has it, never every interface unless asked (docs/security.md). A
    name that does not resolve to one of this machine's addresses falls back to every
    interface, with a warning naming the fix."""
    asked = str(setting("bind_addr") or "")  # checked: an address or a name that resolves
    if asked:
        return asked
    try:
        addr = socket.gethostbyname(told)
        with socket.socket() as s:
            s.bind((addr, 0))
        return addr
    except OSError as exc:
        log.warning("ronde: peers are told to connect to %s, which is not an address of this "
                    "machine (%s); listening on every interface: set RONDE_BIND_ADDR to "
                    "the address peers reach", told, exc)
        return "0.0.0.0"


def free_port(bind: str = "") -> int:
    """A TCP port that is free on ``bind`` now (all interfaces when empty or 0.0.0.0)."""
    with socket.socket() as s:
        s.bind((bind if bind not in ("", "0.0.0.0") else "", 0))
        return int(s.getsockname()[1])
