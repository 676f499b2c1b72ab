"""Rendezvous: how the workers of one job find each other.

A :class:`RendezvousServer` runs in the launcher (or, without a launcher, in rank
0). Each worker connects, authenticates with the job secret, and registers
``{rank, size, generation, host, addrs}``. When every rank of a generation has
registered, the server answers all of them with the full table; if the start
timeout passes first, every waiting worker is told exactly which ranks are missing.
A new ``ronde.init()`` after ``shutdown()`` registers under the next generation, so
one server serves a whole job, re-initialisations included.

Workers also report their failures here (``{"kind": "failure"}``), so the launcher
can tell the first failure from the secondary ones it causes.

The first registration of a rank wins: a second one for the same rank and generation
(a second job on the same address, or an intruder) fails that generation on every
rank, naming both addresses; it never replaces the first.

An *open* server (``open_generation``: rank 0 of a torchrun or Slurm job that was
given no ``RONDE_SECRET`` and runs with ``RONDE_OPEN_STARTUP=1``) also admits clients
holding the public :data:`wire.OPEN_KEY`, only to register ranks 1 and up of that one
generation (its first start-up), and only for ``start_timeout_s`` after it began: the
first to register a rank is that rank, and their table carries the job's random secret,
which every later connection (the mesh, re-initialisations) must prove. A public-key
registration for anything else (another generation, rank 0, another size, a query) gets
an error that says nothing of the job: no secret, no size, and nothing formed or
locked. A public-key registration for a rank of the formed generation (the real rank,
late, whose place another process took) is told the address that took it, and
``on_taken`` ends the job on rank 0 (runner/meeting.py), which tells every rank. Until
the start-up completes such a job is as open as torch.distributed's own store is
(docs/security.md).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable

from .._errors import AuthenticationError, ProtocolError, RendezvousError
from ..transport import wire
from ..transport.admission import Admission

log = logging.getLogger(__name__)

KIND_JSON = 1
_MAX_REGISTER_BYTES = 1 << 16
#: what a public-key client gets for anything but a registration the open start-up takes
_NOT_OPEN = ("this rendezvous admits a process without the job's secret only to register "
             "one of the ranks its start-up is forming, while it forms: give every rank "
             "the same RONDE_SECRET (docs/security.md)")


class RendezvousServer:
    """Collects worker registrations and hands back the peer table."""

    def __init__(self, size: int, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 start_timeout_s: float = 30.0, open_generation: int | None = None,
                 on_taken: Callable[[str, int], None] | None = None) -> None:
        self.size = size
        self.secret = secret
        self.start_timeout_s = start_timeout_s
        #: the one generation the public key may register for (see the module doc)
        self._open_gen = open_generation
        #: until when it may: ``start_timeout_s`` after that generation began
        self._open_until = time.monotonic() + start_timeout_s
        self._open_began = False
        #: called (message, rank) when a rank of the formed open generation is claimed
        #: again; on the acceptor's thread: it must not block
        self._on_taken = on_taken
        self._lock = threading.Lock()
        # generation -> rank -> (socket, registration)
        self._waiting: dict[int, dict[int, tuple[socket.socket, dict[str, Any]]]] = {}
        # generation -> rank -> (peer address, admitted by the open key)
        self._origin: dict[int, dict[int, tuple[str, bool]]] = {}
        # generation -> why it failed (a rank registered twice)
        self._failed: dict[int, str] = {}
        # generation -> rank -> address, of the generations that formed
        self._formed: dict[int, dict[int, str]] = {}
        self._first_seen: dict[int, float] = {}
        self.failures: list[dict[str, Any]] = []
        #: connections dropped before they registered
        self.rejections = wire.Rejections(log, "rendezvous:")
        self._closed = False
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self._sock.getsockname()[:2]
        self._acceptor = Admission(
            self._sock, secret, self._admitted, rejections=self.rejections,
            max_frame_bytes=_MAX_REGISTER_BYTES, name="ronde-rendezvous",
            open_key=self._open_key)

    def start(self) -> "RendezvousServer":
        self._acceptor.start()
        threading.Thread(target=self._timeout_loop, name="ronde-rendezvous-timeout",
                         daemon=True).start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def close(self) -> None:
        self._closed = True
        self._acceptor.close()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            for members in self._waiting.values():
                for s, _ in members.values():
                    s.close()
            self._waiting.clear()

    # -- internals ---------------------------------------------------------------
    def _open_key(self) -> bytes | None:
        """The public key while the open start-up's window lasts, else None."""
        if self._open_gen is None or time.monotonic() > self._open_until:
            return None
        return wire.OPEN_KEY

    def _admitted(self, conn: socket.socket, peer: Any, kind: int, payload: bytes,
                  proven: bool) -> None:
        """A connection past the handshake (transport/admission.py) sent its message."""
        try:
            msg = wire.loads(payload)
            if kind != KIND_JSON or not isinstance(msg, dict):
                raise ProtocolError("expected a JSON object")
            if not proven and not self._open_registration(msg):
                if msg.get("kind") == "register":  # a rank may be misconfigured: say why
                    self._reply(conn, {"kind": "error", "message": _NOT_OPEN})
                raise AuthenticationError("the public key admits only a registration of "
                                          "the open start-up's ranks")
        except (AuthenticationError, ProtocolError) as exc:
            self.rejections.note(peer, exc)
            conn.close()
            return
        conn.settimeout(5.0)  # replies are small; a peer that does not read is dropped
        if msg.get("kind") == "failure":
            with self._lock:
                msg["time"] = time.monotonic()
                self.failures.append(msg)
            conn.close()
            return
        if msg.get("kind") == "query":
            self._reply(conn, self.answer(msg))
            conn.close()
            return
        self._register(conn, msg, _address(peer), not proven)

    def _open_registration(self, msg: dict[str, Any]) -> bool:
        """Whether a client of the public key may send ``msg``: a registration of a rank
        other than rank 0 (whose process serves), of the job's size, for the open
        generation."""
        try:
            return (msg.get("kind") == "register" and self._open_key() is not None
                    and int(msg["generation"]) == self._open_gen
                    and int(msg["size"]) == self.size and 0 < int(msg["rank"]) < self.size)
        except (KeyError, TypeError, ValueError):
            return False

    def answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The reply to a worker's query (``{"kind": "query", "what": ...}``); an elastic
        job's server answers ``"hosts"`` with the launcher's latest host notice."""
        return {"kind": "hosts", "timestamp": 0, "update": 0}

    def _register(self, conn: socket.socket, msg: dict[str, Any], peer: str = "",
                  admitted_open: bool = False) -> None:
        """A worker's registration: hold it until every rank of its generation has
        registered, then answer them all with the table. A rank registered twice
        fails its generation on every rank (the first registration is never replaced)."""
        try:
            rank, generation = int(msg["rank"]), int(msg["generation"])
            size = int(msg["size"])
        except (KeyError, TypeError, ValueError):
            conn.close()
            return
        if size != self.size or not 0 <= rank < self.size:
            self._reply(conn, {"kind": "error", "message":
                               f"rank {rank} registered with size {size}, but this job has "
                               f"{self.size} ranks; every worker must see the same RONDE_SIZE"})
            conn.close()
            return
        refused: list[socket.socket] = []
        taken = ""
        with self._lock:
            failed = self._failed.get(generation)
            formed = self._formed.get(generation, {})
            members = self._waiting.setdefault(generation, {})
            origin = self._origin.setdefault(generation, {})
            if failed is None and admitted_open and rank in formed:
                # the open start-up formed with another process in this rank's place
                failed = (
                    f"rank {rank}'s place in this job was taken by {formed[rank]}: the job "
                    f"started with that process as rank {rank} (without a secret, the first "
                    "to register a rank is that rank); if this process is the real rank "
                    f"{rank}, {formed[rank]} is not part of the job. The job stops on every "
                    "rank. Give every rank the same RONDE_SECRET (docs/security.md)")
                taken = (
                    f"rank {rank} was claimed by {peer} after the job had started with "
                    f"{formed[rank]} as rank {rank} (an open start-up: no RONDE_SECRET); one "
                    "of them is not part of this job, and what the job exchanged may have "
                    "gone to it: the job stops. Give every rank the same RONDE_SECRET "
                    "(docs/security.md)")
            elif failed is None and (rank in members or rank in formed):
                first = origin[rank][0] if rank in members else formed[rank]
                failed = (
                    f"rank {rank} registered twice, from {first} and then from {peer}: two "
                    "processes claim one rank (a second job on the same rendezvous address "
                    "and port, a worker started twice, or a process that is not part of this "
                    "job); the job stops. Give each job its own address and port, and a "
                    "secret (RONDE_SECRET, see docs/security.md)")
                if rank in members:  # fail the generation still forming
                    self._failed[generation] = failed
                    # rank 0 last: where rank 0 serves, its process may exit on its answer
                    refused = [members[r][0] for r in sorted(members, reverse=True)]
                    self._waiting.pop(generation, None)
                    self._first_seen.pop(generation, None)
            complete = False
            if failed is None:
                first_seen = self._first_seen.setdefault(generation, time.monotonic())
                if generation == self._open_gen and not self._open_began:
                    self._open_began = True
                    self._open_until = first_seen + self.start_timeout_s
                members[rank] = (conn, msg)
                origin[rank] = (peer, admitted_open)
                complete = len(members) == self.size
                if complete:
                    del self._waiting[generation]
                    self._first_seen.pop(generation, None)
                    self._formed[generation] = {r: o[0] for r, o in origin.items()}
                    openers = {r for r, o in origin.items() if o[1]}
                    self._origin.pop(generation, None)
            else:
                refused.insert(0, conn)
                if not members:
                    self._waiting.pop(generation, None)
                    self._origin.pop(generation, None)
        if taken:  # the job ends before the claimant hears why
            if self._on_taken is not None:
                self._on_taken(taken, rank)  # it must not block (this is the acceptor)
            else:
                log.error("ronde: %s", taken)
        for s in refused:
            self._reply(s, {"kind": "error", "message": failed})
            s.close()
        if complete:
            table = [members[r][1] for r in range(self.size)]
            for r, (s, _) in members.items():
                reply: dict[str, Any] = {"kind": "table", "peers": table}
                if r in openers:
                    reply["secret"] = self.secret.hex()
                self._reply(s, reply)
                s.close()

    def _reply(self, conn: socket.socket, obj: dict[str, Any]) -> None:
        try:
            wire.send_frame(conn, KIND_JSON, wire.dumps(obj))
        except OSError:
            pass

    def _timeout_loop(self) -> None:
        while not self._closed:
            time.sleep(0.2)
            now = time.monotonic()
            expired: list[tuple[int, dict[int, tuple[socket.socket, dict[str, Any]]]]] = []
            with self._lock:
                for gen, first in list(self._first_seen.items()):
                    if now - first > self.start_timeout_s:
                        expired.append((gen, self._waiting.pop(gen, {})))
                        del self._first_seen[gen]
                        self._origin.pop(gen, None)
            for gen, members in expired:
                missing = [r for r in range(self.size) if r not in members]
                msg = missing_ranks_message(missing, self.size, self.start_timeout_s)
                for s, _ in members.values():
                    self._reply(s, {"kind": "error", "message": msg, "missing": missing})
                    s.close()


def _address(peer: Any) -> str:
    """``host:port`` of a peer address tuple."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) or "an unknown address"


def missing_ranks_message(missing: list[int], size: int, timeout_s: float) -> str:
    arrived = size - len(missing)
    shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
    return (f"start-up timed out after {timeout_s:g}s: {arrived}/{size} ranks arrived; missing "
            f"rank(s) {shown}. Check that those workers started (see their output), that "
            f"their hosts can reach the rendezvous address, or raise --start-timeout")


def register(address: tuple[str, int], secret: bytes, info: dict[str, Any],
             timeout_s: float) -> list[dict[str, Any]]:
    """Register with the rendezvous server and return the peer table (rank order)."""
    reply = exchange(address, secret, info, timeout_s)
    peers = reply.get("peers")
    if not isinstance(peers, list) or len(peers) != info["size"]:
        raise RendezvousError("malformed rendezvous table")
    return peers


def register_open(address: tuple[str, int], info: dict[str, Any], timeout_s: float
                  ) -> tuple[list[dict[str, Any]], bytes]:
    """Register with an open server (a job given no secret) by its public key; returns
    the peer table and the job's secret, which the server makes and hands out."""
    try:
        reply = exchange(address, wire.OPEN_KEY, info, timeout_s)
    except AuthenticationError:
        raise RendezvousError(
            f"rank {info.get('rank')}: rank 0's rendezvous at {address[0]}:{address[1]} no "
            "longer admits a rank without the job's secret: its start-up has completed or "
            "timed out (RONDE_START_TIMEOUT) without this rank, or it was given a "
            "RONDE_SECRET this rank was not") from None
    peers = reply.get("peers")
    try:
        secret = bytes.fromhex(str(reply["secret"]))
    except (KeyError, ValueError):
        secret = b""
    if not isinstance(peers, list) or len(peers) != info["size"] or len(secret) < 16:
        raise RendezvousError("malformed rendezvous table (an open start-up's table must "
                              "carry the job's secret)")
    return peers, secret


def exchange(address: tuple[str, int], secret: bytes, info: dict[str, Any],
             timeout_s: float) -> dict[str, Any]:
    """Send a registration and wait for the server's answer (retrying the connection
    while the server is not up yet); an ``error`` answer raises ``RendezvousError``."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    sock = None
    while time.monotonic() < deadline:
        try:
            sock = wire.connect(address[0], address[1], secret,
                                max(0.1, min(5.0, deadline - time.monotonic())))
            break
        except AuthenticationError:
            raise
        except socket.gaierror as exc:
            raise RendezvousError(
                f"cannot resolve rendezvous host {address[0]!r}: {exc}; check "
                "RONDE_RENDEZVOUS_ADDR / the host names given to ronderun") from None
        except OSError as exc:  # refused / unreachable: the server may not be up yet
            last_exc = exc
            time.sleep(0.05)
    if sock is None:
        raise RendezvousError(
            f"cannot reach the rendezvous service at {address[0]}:{address[1]} within "
            f"{timeout_s:g}s ({last_exc}); is the launcher (or rank 0) running, and is that "
            "address reachable from this host?")
    try:
        wire.send_frame(sock, KIND_JSON, wire.dumps(dict(info, kind="register")))
        # the server itself enforces the start timeout; allow slack on top of it
        try:
            _, payload = wire.recv_frame(sock, deadline + 5.0)
        except TimeoutError:
            raise RendezvousError(
                f"start-up timed out after {timeout_s:g}s waiting for the other ranks "
                "(the rendezvous service did not answer)") from None
        except ConnectionError:
            raise RendezvousError(
                "the rendezvous service closed the connection during start-up; the "
                "launcher probably stopped the job (see the first failure above)") from None
        reply = wire.loads(payload)
    finally:
        sock.close()
    if not isinstance(reply, dict):
        raise RendezvousError("malformed rendezvous reply")
    if reply.get("kind") == "error":
        raise RendezvousError(str(reply.get("message")))
    return reply


def query(address: tuple[str, int], secret: bytes, what: dict[str, Any],
          timeout_s: float = 2.0) -> dict[str, Any] | None:
    """Ask the rendezvous service something (see ``RendezvousServer.answer``); None when
    it cannot be reached or answers nonsense (never raises)."""
    try:
        sock = wire.connect(address[0], address[1], secret, timeout_s)
        try:
            wire.send_frame(sock, KIND_JSON, wire.dumps(dict(what, kind="query")))
            _, payload = wire.recv_frame(sock, time.monotonic() + timeout_s, _MAX_REGISTER_BYTES)
        finally:
            sock.close()
        reply = wire.loads(payload)
        return reply if isinstance(reply, dict) else None
    except Exception:  # noqa: BLE001 - a best-effort query
        return None


def report_failure(address: tuple[str, int], secret: bytes, rank: int, message: str,
                   secondary: bool = False, lost: int | None = None,
                   left: bool = False) -> None:
    """Best-effort: tell the launcher this rank failed, and how (never raises).

    ``secondary`` marks a failure caused by another rank (a lost peer, a shutdown),
    so the launcher can lead with the first, primary one; ``lost`` names the rank
    this one lost (a ``PeerLostError``), which the launcher prefers as the cause;
    ``left``: ``lost`` shut down on its own while this rank still needed it.
    """
    try:
        sock = wire.connect(address[0], address[1], secret, 2.0)
        try:
            wire.send_frame(sock, KIND_JSON, wire.dumps(
                {"kind": "failure", "rank": rank, "message": message[-8000:],
                 "secondary": secondary, "lost": lost, "left": left}))
        finally:
            sock.close()
    except Exception:  # noqa: BLE001 - best effort while already failing
        pass
