"""The timeline: a Chrome-trace record of every tensor's way through the engine.

Where it sits in the engine cycle: ``submit`` stamps each request; the control
thread records the *queue* phase (submit to announce) and the *negotiate* phase
(announce to agreement) and, with ``mark_cycles``, an instant event per round; the
executor records *memcpy_in* (fusion), *transfer* (the collective) and
*memcpy_out* (unpacking), or one *inline* phase for allreduces that travelled with
negotiation. Each tensor name gets its own row (a Chrome-trace thread) under the
rank's process.

The file is a JSON array written one event per line, without the closing bracket,
which Chrome's trace format makes optional; events are handed to the OS in batches
(at most ``_FLUSH_S`` apart, whole lines only), so a job killed mid-run still leaves
a file that chrome://tracing and Perfetto load, and :func:`load` parses, missing at
most the last fraction of a second. Disabled, it costs one attribute test per phase.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

_US = 1e6
_FLUSH_S = 0.1
_FLUSH_BYTES = 1 << 16


def now_us() -> float:
    return time.perf_counter() * _US


class Timeline:
    """Appends Chrome-trace events for one rank to ``path``."""

    def __init__(self, path: str, rank: int, mark_cycles: bool = False) -> None:
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._rows: dict[str, int] = {}
        self._pending: list[str] = []
        self._pending_bytes = 0
        self._last_flush = time.monotonic()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._write_raw("[\n")
        self._emit({"name": "process_name", "ph": "M", "pid": rank,
                    "args": {"name": f"rank {rank}"}})

    def _write_raw(self, text: str) -> None:
        data = text.encode()
        while data:
            n = os.write(self._fd, data)
            data = data[n:]

    def _emit(self, event: dict[str, Any]) -> None:
        self._append(json.dumps(event, separators=(",", ":")) + ",\n")

    def _append(self, line: str) -> None:
        self._pending.append(line)
        self._pending_bytes += len(line)
        now = time.monotonic()
        if self._pending_bytes > _FLUSH_BYTES or now - self._last_flush > _FLUSH_S:
            self._flush(now)

    def _flush(self, now: float) -> None:
        if self._pending:
            self._write_raw("".join(self._pending))
            self._pending.clear()
            self._pending_bytes = 0
        self._last_flush = now

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": row,
                        "args": {"name": name}})
        return row

    def phase(self, name: str, phase: str, start_us: float, end_us: float,
              args: dict[str, Any] | None = None) -> None:
        """Record ``phase`` of tensor ``name`` from ``start_us`` to ``end_us``."""
        with self._lock:
            if self._fd < 0:
                return
            tid = self._row(name)
            dur = max(0.0, end_us - start_us)
            extra = f',"args":{json.dumps(args, separators=(",", ":"))}' if args else ""
            self._append(f'{{"name":"{phase}","ph":"X","pid":{self.rank},"tid":{tid},'
                         f'"ts":{start_us:.1f},"dur":{dur:.1f}{extra}}},\n')

    def queued(self, reqs: list[Any]) -> None:
        """Requests leaving the outbox for a round, or held for the other ranks from now
        on (``holding.py``: NEGOTIATE shows that wait): their QUEUE phase ends now, once."""
        stamp = now_us()
        for r in reqs:
            if not r.t_announce:
                r.t_announce = stamp
                self.phase(r.name, "QUEUE", r.t_submit or stamp, stamp)

    def negotiated(self, round_no: int, responses: list[Any], pending: dict[str, Any]) -> None:
        """A round agreed on ``responses``: their NEGOTIATE phase ends now (``pending``:
        the engine's requests by name, read under its lock)."""
        self.cycle(round_no)
        stamp = now_us()
        for resp in responses:
            for name in resp.names:
                req = pending.get(name)
                if req is not None and req.t_announce:
                    self.phase(name, "NEGOTIATE", req.t_announce, stamp,
                               {"error": resp.error} if resp.error else None)

    def tick(self) -> None:
        """Flush if events have waited longer than ``_FLUSH_S`` (control thread, idle)."""
        now = time.monotonic()
        if self._pending and now - self._last_flush > _FLUSH_S:
            with self._lock:
                if self._fd >= 0:
                    self._flush(now)

    def cycle(self, round_no: int) -> None:
        if not self.mark_cycles:
            return
        with self._lock:
            if self._fd >= 0:
                self._emit({"name": f"round {round_no}", "ph": "i", "s": "p",
                            "pid": self.rank, "tid": 0, "ts": round(now_us(), 1)})

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                self._flush(time.monotonic())
                self._write_raw("{}]\n")  # a closed file is strict JSON as well
                os.close(self._fd)
                self._fd = -1


def load(path: str) -> list[dict[str, Any]]:
    """Parse a timeline file, complete or cut short by a crash."""
    with open(path) as fh:
        lines = fh.read().splitlines()
    body = [ln.rstrip(",") for ln in lines[1:] if ln.endswith(",") or ln == "{}]"]
    return [e for e in json.loads("[" + ",".join(b.rstrip("]") for b in body) + "]") if e]
