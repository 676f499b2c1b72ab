"""The stall inspector: collectives that some ranks submitted and others never did.

Where it sits in the engine cycle: rank 0's control thread calls :meth:`check` about
once a second. A pending entry older than ``RONDE_STALL_CHECK_TIME`` is logged once, with
the ranks that are ready and those that are missing, and the missing ranks are asked
(flag ``k`` in rank 0's next frame) for their main thread's Python stack, which they send
back (``st``); older than ``RONDE_STALL_SHUTDOWN_TIME`` (unless 0), the entry is aborted on
every rank (flag ``x``) with a :class:`~ronde.StallError` that repeats those stacks.
"""

from __future__ import annotations

import logging
from typing import Callable

from .._config import Config
from .negotiation import Negotiator
from .protocol import Abort
from .._text import ranks_text

log = logging.getLogger(__name__)


class StallInspector:
    """Keeps what was already reported; decides what to ask and what to abort."""

    def __init__(self, cfg: Config, describe_rank: Callable[[int], str]) -> None:
        self.cfg = cfg
        self.describe_rank = describe_rank
        self._warned: set[str] = set()
        #: what the ranks asked for their stacks were doing (rank -> stack text)
        self.stacks: dict[int, str] = {}

    def check(self, negotiator: Negotiator) -> tuple[list[int], Abort | None]:
        """Ranks to ask for their stacks, and the abort message to send (or None)."""
        cfg = self.cfg
        stalled = negotiator.stalled(cfg.stall_check_time_s)
        abort_names = []
        lines = []
        ask: set[int] = set()
        all_missing: set[int] = set()
        for name, ready, missing, age in stalled:
            if not missing:
                continue
            all_missing.update(missing)
            if name not in self._warned:
                self._warned.add(name)
                ask.update(missing)
                log.warning("stall: %r has been waiting %.0fs; ready on rank(s) %s, missing on "
                            "rank(s) %s (are they in a different code path, or slower?)",
                            name, age, ready, [self.describe_rank(m) for m in missing])
            if cfg.stall_shutdown_time_s > 0 and age > cfg.stall_shutdown_time_s:
                abort_names.append(name)
                lines.append(f"{name!r} (ready on rank(s) {ranks_text(ready)}, missing on "
                             f"rank(s) {ranks_text(missing)})")
        abort = None
        if abort_names:
            doing = "".join(f"\n--- rank {r} was at:\n{self.stacks[r]}"
                            for r in sorted(all_missing) if r in self.stacks)
            msg = (f"stalled for more than {cfg.stall_shutdown_time_s:g}s "
                   f"(RONDE_STALL_SHUTDOWN_TIME): {'; '.join(lines)}; the missing ranks never "
                   "submitted these collectives (a different code path, or fewer batches: "
                   f"see join())" + doing)
            abort = Abort(tuple(abort_names), msg)
            for n in abort_names:
                self._warned.discard(n)
        return sorted(ask), abort

    def record_stack(self, rank: int, text: str) -> None:
        self.stacks[rank] = text[-4000:]
        log.warning("stall: rank %s is at:\n%s", self.describe_rank(rank), self.stacks[rank])
