"""A bounded connection flood against the listeners of given processes, for the tests.

``python flooder.py --pids 123,456 --rate 1500 --seconds 6`` opens connections to every
TCP port that those processes (``--tree``: and every process below them) listen on at
127.0.0.1 (found in ``/proc``, re-read every 50 ms, so listeners that appear later are
flooded too), in turn, at most ``--rate`` a second. Each connection sends a valid-looking ronde hello (the magic and a random nonce)
and then stalls; at most ``--max-open`` stay open (the oldest is closed first, with an
RST so that no port lingers in TIME_WAIT). ``--ready PATH`` is created once ``--rate``
connections went out (the flood is on). The flood stops by itself after ``--seconds``,
or ``--count`` connections, or once every named process has exited, or when the test
that started it exits, and prints one JSON line: ``{"sent": N, "refused": M, "targets":
[...], ...}``.

Only 127.0.0.1 and only the listeners of the named processes are ever touched.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import socket
import struct
import sys
import time

HELLO_MAGIC = b"rd"  # ronde.transport.wire.MAGIC, kept literal: the flood imports no ronde


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports on 127.0.0.1 (or every interface) that ``pids`` listen on."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    ports: set[int] = set()
    try:
        with open("/proc/net/tcp") as fh:
            next(fh)
            for line in fh:
                f = line.split()
                local, state, inode = f[1], f[3], f[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                addr, port = local.split(":")
                if addr in ("0100007F", "00000000"):  # 127.0.0.1, 0.0.0.0
                    ports.add(int(port, 16))
    except OSError:
        pass
    return ports


def with_descendants(roots: list[int]) -> list[int]:
    """``roots`` and every process below them (from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pids", required=True)
    ap.add_argument("--rate", type=float, default=1500.0)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--max-open", type=int, default=800)
    ap.add_argument("--ready", default="")
    ap.add_argument("--tree", action="store_true",
                    help="flood the processes below --pids too (found again every 0.2 s)")
    args = ap.parse_args()
    roots = pids = [int(p) for p in args.pids.split(",") if p]
    next_tree = 0.0
    parent = os.getppid()
    linger = struct.pack("ii", 1, 0)
    open_socks: collections.deque[socket.socket] = collections.deque()
    targets: list[int] = []
    seen: set[int] = set()
    sent = refused = 0
    start = time.monotonic()
    next_scan = 0.0
    i = 0
    first = last = 0.0  # when targets were first and last seen
    while True:
        now = time.monotonic()
        if now - start > args.seconds or sent >= args.count or os.getppid() != parent:
            break
        if now >= next_scan:
            if not any(os.path.exists(f"/proc/{pid}") for pid in roots):
                break
            if args.tree and now >= next_tree:
                pids, next_tree = with_descendants(roots), now + 0.2
            found = listening_ports(pids)
            targets = sorted(found)
            seen |= found
            if targets:
                first, last = first or now, now
            next_scan = now + 0.05
        due = int((now - start) * args.rate) - sent - refused
        if not targets or due <= 0:
            time.sleep(0.002)
            continue
        for _ in range(min(due, 50)):
            port = targets[i % len(targets)]
            i += 1
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            s.settimeout(0.05)
            try:
                s.connect(("127.0.0.1", port))
                s.send(HELLO_MAGIC + os.urandom(16))
            except OSError as exc:
                s.close()
                refused += 1
                if exc.errno == errno.EMFILE:
                    time.sleep(0.01)
                continue
            sent += 1
            open_socks.append(s)
            if args.ready and sent == int(args.rate):
                open(args.ready, "w").close()
            while len(open_socks) > args.max_open:
                open_socks.popleft().close()
    for s in open_socks:
        s.close()
    print(json.dumps({"sent": sent, "refused": refused, "targets": sorted(seen),
                      "seconds": round(time.monotonic() - start, 2),
                      "targeted_s": round(last - first, 2)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
