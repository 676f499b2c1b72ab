"""``python -m ronde.bench control``: one negotiation round's work on one rank against N.

What it measures: the Python work a rank does for one steady training round (every
rank announcing the same ``--tensors`` cached gradients) at job sizes no 2-core
machine can run as processes (up to thousands of ranks), by calling the engine's own
functions in one process, with no sockets: the frames every other rank would send are
built once, and each timed round decodes them and applies them to a real
:class:`~ronde.core.negotiation.Negotiator`, as the exchange does.

* **all-to-all**: what a rank does when frames go all-to-all (``exchange.py``, below
  ``RONDE_COORDINATOR_MIN`` ranks): it decodes ``N - 1`` frames (the decoder's memo
  makes each a comparison), then the negotiator looks at ``N`` messages.
* **member**: a rank under the coordinator (``coordinator.py``): it unpacks one bundle,
  which tells the part every rank sent once, with a bit mask of its senders.
* **coordinator**: rank 0 groups the ``N`` frames it received by JSON part, decodes
  each distinct part once and packs the bundle (what it sends ``N - 1`` times).
* **tree root**: rank 0 when rounds go over the tree (``tree.py``): it unpacks and
  checks its ``log2 N`` children's aggregates, merges them with its own frame, packs
  the bundle and decodes it (relays do less: fewer children).

Then rank 0's whole round *with its system calls*, as the star's coordinator and as
the tree's root, over real TCP loopback sockets whose peers' frames were written
before the round (so no wake-up is in it), and a *model* of the round's critical path:
``--hop-us`` of one-way network latency per hop (2 for the star, ``2 log2 N`` for the
tree) plus the work of each rank on the path (a relay at level ``k`` does what the
root of a tree of ``2^k`` ranks does) plus a member's decode. A model, not a
measurement of real jobs: on this machine every rank shares two cores, so no run of N
processes can show the critical path of N machines.

Printed: microseconds per round (median of ``--repeats``) and each one's growth from
the smallest N. Socket system calls and wake-ups are not in these numbers (the
``scale`` case measures those, with real processes); they are what grows with N at the
coordinator only: ``N - 1`` frames in and out, against one each on a member.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from ..core import coordinator, protocol, tree
from ..core.negotiation import Negotiator
from ..core.requests import Kind, Request


def _steady(size: int, tensors: int) -> tuple[Negotiator, protocol.RoundMessage]:
    """A negotiator of ``size`` ranks that completed ``tensors`` gradients once, and
    the message every rank sends when it announces them again."""
    neg = Negotiator(size, {0: list(range(size))}, fusion_threshold_bytes=64 << 20,
                     cache_capacity=1024)
    names = [f"grad.{i}" for i in range(tensors)]
    metas = [Request(Kind.ALLREDUCE, n, np.ones(1024, np.float32)).meta() for n in names]
    first = [protocol.RoundMessage(tuple(protocol.ByName(n, m) for n, m in zip(names, metas)))
             ] * size
    neg.apply_round(first)
    again = protocol.RoundMessage(tuple(neg.encode_announcement(0, n, m)
                                        for n, m in zip(names, metas)))
    assert all(type(a) is protocol.ById for a in again.announced)
    return neg, again


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    fn()  # the memos warm
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def measure(size: int, tensors: int, repeats: int) -> dict[str, float]:
    """Microseconds per round on each side, for ``size`` ranks."""
    neg, msg = _steady(size, tensors)
    payload = protocol.pack_round(msg)
    frames = {r: bytes(bytearray(payload)) for r in range(size)}  # distinct, as received
    decoder = protocol.Decoder()
    messages: list[protocol.RoundMessage] = [msg] * size
    blobs = [b""] * size

    def all_to_all() -> None:
        for r in range(1, size):
            messages[r], blobs[r] = decoder.unpack(frames[r], r)
        neg.apply_round(messages, blobs)

    bundle = coordinator.pack_bundle(coordinator.group(frames))[protocol.wire.HEADER_BYTES:]
    others = set(range(size)) - {1}

    def member() -> None:
        g = coordinator.unpack_bundle(bundle, size)
        coordinator.decode(decoder, g, size, messages, blobs, others)
        neg.apply_round(messages, blobs)

    root_others = set(range(1, size))

    def root() -> None:
        g = coordinator.group(frames)
        coordinator.decode(decoder, g, size, messages, blobs, root_others)
        coordinator.pack_bundle(g)
        neg.apply_round(messages, blobs)

    kids = tree.children(0, size)
    aggregates = {c: coordinator.pack_bundle(coordinator.group(
        {r: frames[r] for r in tree.subtree(c, size)}))[protocol.wire.HEADER_BYTES:]
        for c in kids}
    own = {0: frames[0]}

    def tree_root() -> None:
        got = []
        for c, body in aggregates.items():
            g = coordinator.unpack_bundle(body, size)
            tree.check_aggregate(g, c, size)
            got.append(g)
        g = tree.merge([coordinator.group(own), *got])
        coordinator.pack_bundle(g)
        coordinator.decode(decoder, g, size, messages, blobs, root_others)
        neg.apply_round(messages, blobs)

    return {"all-to-all": _time(all_to_all, repeats), "member": _time(member, repeats),
            "coordinator": _time(root, repeats), "tree root": _time(tree_root, repeats),
            "bundle_bytes": float(len(bundle))}


def _tcp_pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    """``n`` connected TCP loopback pairs: (rank 0's end, the peer's end)."""
    with socket.create_server(("127.0.0.1", 0), backlog=n) as listener:
        out = []
        for _ in range(n):
            far = socket.create_connection(listener.getsockname())
            near, _ = listener.accept()
            for s_ in (near, far):
                s_.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out.append((near, far))
    return out


def root_round_us(size: int, tensors: int, repeats: int, over_tree: bool) -> float:
    """Rank 0's whole round with its system calls, over real TCP loopback sockets, as
    the star's coordinator (``N - 1`` peers) or the tree's root (its ``log2 N``
    children): the peers' frames (or aggregates) are written into the sockets before
    each timed round, so no wake-up is in the figure; what rank 0 sends is drained
    after it. Microseconds, median."""
    from .. import _config
    from ..core.channels import Channels
    from ..transport import wire

    neg, msg = _steady(size, tensors)
    payload = protocol.pack_round(msg)
    peers = tree.children(0, size) if over_tree else list(range(1, size))
    pairs = dict(zip(peers, _tcp_pairs(len(peers))))
    ch = Channels(0, size, {r: near for r, (near, _) in pairs.items()}, _config.Config(), str)
    if over_tree:
        sent = {c: coordinator.pack_bundle(coordinator.group(
            {r: payload for r in tree.subtree(c, size)}), tree.KIND_AGGREGATE) for c in peers}
    else:
        sent = {r: wire.encode_frame(protocol.KIND_ROUND, payload) for r in peers}
    for _, far in pairs.values():
        far.setblocking(False)
    times = []
    messages: list[protocol.RoundMessage] = [msg] * size
    blobs = [b""] * size
    try:
        for i in range(repeats + 2):
            for r, (_, far) in pairs.items():
                far.sendall(sent[r])
            time.sleep(0.001)  # the frames are in rank 0's receive buffers
            t0 = time.perf_counter()
            if over_tree:
                tree.run(ch, payload, messages, blobs, lambda: None)
            else:
                coordinator.run(ch, i, payload, messages, blobs, lambda: None, set())
            neg.apply_round(messages, blobs)  # the engine's part of the round
            if i >= 2:
                times.append(time.perf_counter() - t0)
            for _, far in pairs.values():  # goes and bundles, untimed
                try:
                    while far.recv(1 << 20):
                        pass
                except BlockingIOError:
                    pass
    finally:
        for near, far in pairs.values():
            near.close()
            far.close()
    return statistics.median(times) * 1e6


def critical_path_us(size: int, tree_roots: dict[int, float], star_root: float,
                     member: float, hop_us: float) -> tuple[float, float]:
    """The modelled critical path of one round, star and tree (see the module's
    docstring): hops plus the work of each rank on the path, a relay at level ``k``
    doing what the root of a tree of ``2^k`` ranks does."""
    star = 2 * hop_us + star_root + member
    levels = (size - 1).bit_length()
    path = sum(tree_roots[min(1 << k, size)] for k in range(1, levels + 1))
    return star, 2 * levels * hop_us + path + member


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ronde.bench control",
                                description="one negotiation round's work on a rank, "
                                            "against N (in one process)")
    p.add_argument("--np", default="4,16,64,256,1024", help="job sizes (comma list)")
    p.add_argument("--tensors", type=int, default=161,
                   help="cached gradients announced each round (default: ResNet-50's 161)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--hop-us", type=float, default=25.0,
                   help="one-way network latency per hop for the model (default 25 us)")
    args = p.parse_args(argv)
    sizes = [int(n) for n in args.np.split(",") if n]
    rows = [(n, measure(n, args.tensors, args.repeats)) for n in sizes]
    base = rows[0][1]
    print(f"control: one steady round, {args.tensors} cached tensors, us per round "
          "(x: growth from the first N)\n")
    keys = ("all-to-all", "member", "coordinator", "tree root")
    print("| N | " + " | ".join(f"{k} | x" for k in keys) + " | bundle bytes |")
    print("|---|" + "---|---|" * len(keys) + "---|")
    for n, m in rows:
        cells = []
        for k in keys:
            cells += [f"{m[k]:.0f}", f"{m[k] / base[k]:.1f}"]
        print(f"| {n} | " + " | ".join(cells) + f" | {m['bundle_bytes']:.0f} |")
    print(f"\nrank 0's round with its system calls (real TCP loopback sockets, peers' "
          f"frames already there; us), and a model of the round's critical path with "
          f"{args.hop_us:g} us a hop:\n")
    print("| N | frames at rank 0: star | tree | rank 0: star | tree | critical path: "
          "star | tree | star / tree |")
    print("|---|---|---|---|---|---|---|---|")
    roots: dict[int, float] = {}
    reps = max(20, args.repeats // 4)
    for n, m in rows:
        for k in range(1, (n - 1).bit_length() + 1):
            sub = min(1 << k, n)
            if sub not in roots:
                roots[sub] = root_round_us(sub, args.tensors, reps, over_tree=True)
        star_root = root_round_us(n, args.tensors, reps, over_tree=False)
        star, path = critical_path_us(n, roots, star_root, m["member"], args.hop_us)
        levels = (n - 1).bit_length()
        print(f"| {n} | {2 * (n - 1)} | {2 * levels} | {star_root:.0f} | {roots[n]:.0f} | "
              f"{star:.0f} | {path:.0f} | {star / path:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
