"""Running contenders' jobs in interleaved rounds and combining their points (what the
driver, ``__main__.py``, and the ``scale`` case share)."""

from __future__ import annotations

import sys
import time
from typing import Any, Sequence

from ._contenders import Contender, JobFailedError
from ._report import Point, combine
from ._timing import Settings


def run_rounds(contenders: Sequence[Contender], rounds: int, np_: int, cases: Sequence[str],
               sizes: Sequence[int], settings: Settings, timeout_s: float,
               coll_sizes: Sequence[int] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Run every contender ``rounds`` times, interleaved; per impl, its job summaries."""
    raw: dict[str, list[dict[str, Any]]] = {c.impl: [] for c in contenders}
    for r in range(rounds):
        k = r % len(contenders)
        for c in [*contenders[k:], *contenders[:k]]:
            t0 = time.monotonic()
            print(f"round {r + 1}/{rounds}: {c.impl} ...", end="", file=sys.stderr, flush=True)
            try:
                raw[c.impl].append(c.run(np_, cases, sizes, settings, timeout_s, coll_sizes))
                print(f" {time.monotonic() - t0:.1f} s", file=sys.stderr)
            except (JobFailedError, OSError) as e:
                print(f" failed, its points lack this round\n{e}", file=sys.stderr)
    return raw


def _points(contenders: Sequence[Contender], cases: Sequence[str], np_: int,
            raw: dict[str, list[dict[str, Any]]]) -> list[Point]:
    points: list[Point] = []
    for c in contenders:
        for case in cases:
            per_round = [doc["results"].get(case, []) for doc in raw[c.impl]]
            if case != "fusion":
                points.extend(combine(case, c.impl, c.transport, np_, per_round))
                continue
            for variant in ("single", "tensors", "views"):
                points.extend(combine(f"fusion.{variant}", c.impl, c.transport, np_,
                                      [[s for s in summaries if s.get("variant") == variant]
                                       for summaries in per_round]))
    return points
