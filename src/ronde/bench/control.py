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

Printed: microseconds per round (median of ``--repeats``) and each one's growth from
the smallest N. Socket system calls and wake-ups are not in these numbers (the
``scale`` case measures those, with real processes); they are what grows with N at the
coordinator only: ``N - 1`` frames in and out, against one each on a member.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from ..core import coordinator, protocol
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

    return {"all-to-all": _time(all_to_all, repeats), "member": _time(member, repeats),
            "coordinator": _time(root, repeats), "bundle_bytes": float(len(bundle))}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ronde.bench control",
                                description="one negotiation round's work on a rank, "
                                            "against N (in one process)")
    p.add_argument("--np", default="4,16,64,256,1024", help="job sizes (comma list)")
    p.add_argument("--tensors", type=int, default=161,
                   help="cached gradients announced each round (default: ResNet-50's 161)")
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    sizes = [int(n) for n in args.np.split(",") if n]
    rows = [(n, measure(n, args.tensors, args.repeats)) for n in sizes]
    base = rows[0][1]
    print(f"control: one steady round, {args.tensors} cached tensors, us per round "
          "(x: growth from the first N)\n")
    print("| N | all-to-all | x | member | x | coordinator | x | bundle bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for n, m in rows:
        cells = []
        for k in ("all-to-all", "member", "coordinator"):
            cells += [f"{m[k]:.0f}", f"{m[k] / base[k]:.1f}"]
        print(f"| {n} | " + " | ".join(cells) + f" | {m['bundle_bytes']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
