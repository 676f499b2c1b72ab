"""Which rank failed first, and the summary ``ronderun`` prints last.

When one rank fails, the others usually fail right after it, as a consequence. Workers
report their exception to the rendezvous service and mark the consequences
(``PeerLostError``, ``ShutdownError``, ``StallError``) as *secondary*; these functions
turn those reports and the exit statuses into the first failure and its summary.
Shared by :mod:`.launch` and :mod:`.mpi_launch`.
"""

from __future__ import annotations

import signal
from typing import Any, Protocol, Sequence


class Failed(Protocol):
    """What the summary needs to know about one rank's process."""

    returncode: int | None
    exit_time: float | None
    signalled: bool
    tail: Any
    slot: Any


#: ``first_failure``'s message for a rank that shut down on its own while others needed it
LEFT = "\0left"
#: ``first_failure``'s message for a rank its peers lost while it still ran (stopped by
#: SIGSTOP, hung), which ronderun then had to stop
SILENT = "\0silent"


def describe_status(code: int | None) -> str:
    if code is None:
        return "did not start"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name}"
    return f"exit code {code}"


def shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


def primary_reports(failures: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failures reported by the ranks themselves, not as a consequence of another."""
    return [f for f in failures if not f.get("secondary") and isinstance(f.get("rank"), int)]


def first_failure(workers: Sequence[Failed], failures: Sequence[dict[str, Any]]
                  ) -> tuple[Any | None, str]:
    """The worker that failed first and its reported message ("" if none)."""
    first, message = reported_cause(workers, failures)
    if first is not None:
        return first, message
    # A rank whose error says another rank caused it is not the cause while another
    # failed rank made no such claim, e.g. one that called sys.exit(3).
    secondary = {f.get("rank") for f in failures if f.get("secondary")}
    failed = [w for r, w in enumerate(workers) if w.returncode not in (None, 0)
              and not w.signalled and r not in secondary]
    if not failed:
        failed = [w for w in workers if w.returncode not in (None, 0) and not w.signalled]
    if not failed:
        failed = [w for w in workers if w.returncode not in (None, 0)]
    if not failed:
        return None, ""
    return min(failed, key=lambda w: (w.exit_time or 0.0, w.slot.rank)), ""


def reported_cause(workers: Sequence[Failed], failures: Sequence[dict[str, Any]]
                   ) -> tuple[Any | None, str]:
    """The worker that failed first by the ranks' own reports (``workers`` in rank
    order): the earliest primary failure, else the rank whose loss the others report
    and that caused it (:func:`_caused`); ``(None, "")`` when no report decides."""
    primary = [f for f in primary_reports(failures) if 0 <= f["rank"] < len(workers)]
    if primary:
        first = min(primary, key=lambda f: f.get("time", 0.0))
        return workers[first["rank"]], str(first.get("message", ""))
    # A rank that others reported losing, and that failed without ronderun's help, is
    # the cause: the exit times ronderun sees can put a survivor that caught the
    # PeerLostError and exited ahead of the lost rank's own (slower) death.
    # Whatever its exit code: a rank that exited 0 while the others still needed it
    # (an early sys.exit(0)) left first, and the ranks that lost it failed after it.
    # A rank that shut down on its own while the others still needed it (they report
    # ``left``) is the cause even when ronderun then had to stop it mid-shutdown.
    # So is a rank that stopped answering (SIGSTOP, a hung process) and that ronderun
    # had to stop: the loss was reported before ronderun signalled it.
    lost = [f for f in failures if isinstance(f.get("lost"), int)
            and 0 <= f["lost"] < len(workers) and _caused(workers[f["lost"]], f)]
    if lost:
        cause = min(lost, key=lambda f: f.get("time", 0.0))
        w = workers[cause["lost"]]
        return w, LEFT if cause.get("left") else SILENT if w.signalled else ""
    return None, ""


def _caused(w: Failed, report: dict[str, Any]) -> bool:
    """Whether ``w``, whose loss ``report`` names, ended the job: it shut down while
    needed, ended without ronderun's signal, or was still there, silent, when the loss
    was reported (ronderun signalled it only after)."""
    if report.get("left"):
        return True
    if w.returncode is None:
        return False
    if not w.signalled:
        return True
    at = getattr(w, "signalled_at", None)
    return at is not None and isinstance(report.get("time"), float) and report["time"] < at


def failure_lines(first: Failed, message: str, workers: Sequence[Failed]
                  ) -> tuple[int, str, list[str]]:
    """The job's exit code, its one-line cause and the summary lines."""
    raw = first.returncode if first.returncode is not None else 1
    code = shell_code(raw) or 1
    where = f"rank {first.slot.rank} (host {first.slot.host})"
    left = raw == 0 or (message == LEFT and first.signalled)  # not its own failure
    silent = message == SILENT and not left
    if message in (LEFT, SILENT):
        message = ""
    if silent:
        code = 1
        cause = (f"{where} failed first: it stopped answering while it still ran (its peers "
                 f"lost it; stopped or hung?), then ronderun had to stop it "
                 f"({describe_status(raw)[4:]})")
    elif left:
        code = 1
        cause = (f"{where} left first: it ended (with {describe_status(raw)}) while the other "
                 "ranks still needed it; end every rank alike (hvd.shutdown() on all, or "
                 "hvd.join() for uneven data)")
    elif first.signalled and raw < 0:  # it reported an error but did not exit in time
        code = 1
        cause = (f"{where} failed first: it reported an error, then ronderun had to stop "
                 f"it ({describe_status(raw)[4:]})")
    elif raw < 0:
        cause = f"{where} failed first: it {describe_status(raw)}"
    else:
        cause = f"{where} failed first with {describe_status(raw)}"
    lines = [f"ronderun: {cause}"]
    detail = list(first.tail) or (message.splitlines() if message else [])
    if detail:
        lines.append(f"ronderun: last stderr lines of rank {first.slot.rank}:")
        lines.extend(f"    {line}" for line in detail)
    others = []
    for w in workers:
        if w is first or w.returncode in (0, None):
            continue
        how = ("stopped by ronderun" if w.signalled
               else f"failed afterwards ({describe_status(w.returncode)})")
        others.append(f"{w.slot.rank} {how}")
    lines.append("ronderun: other ranks: " + ("; ".join(others) if others else
                                              "none failed or needed stopping"))
    return code, cause, lines
