"""The worker side of :func:`ronde.testing.run_ranks` (``python -m ronde.testing._child``).

Reads ``RONDE_TESTING_FN`` (``module:qualname``) and ``RONDE_TESTING_DIR`` (the
directory holding ``call.pkl``), calls the function, and writes ``rank.<N>.pkl``
with its return value, or ``rank.<N>.err`` with the traceback if it raised.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any, Callable

from .ranks import DIR_VAR, FN_VAR, resolve


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _report(rank: int, exc: BaseException, text: str) -> None:
    """Tell the launcher this rank failed; a lost peer, shutdown or stall is secondary."""
    from .._errors import DeadlockError, PeerLostError, ShutdownError, StallError

    if not os.environ.get("RONDE_SECRET") or not os.environ.get("RONDE_RENDEZVOUS_ADDR"):
        return
    try:
        from ..runner.rendezvous import report_failure

        address = (os.environ["RONDE_RENDEZVOUS_ADDR"], int(os.environ["RONDE_RENDEZVOUS_PORT"]))
        report_failure(address, bytes.fromhex(os.environ["RONDE_SECRET"]), rank, text,
                       secondary=isinstance(exc, (PeerLostError, ShutdownError, StallError))
                       and not isinstance(exc, DeadlockError))
    except Exception:  # noqa: BLE001 - best effort; the exit code still tells the launcher
        pass


def main() -> int:
    """Run the function for this rank; return the process exit code."""
    rank = int(os.environ.get("RONDE_RANK", "0"))
    workdir = os.environ[DIR_VAR]
    try:
        with open(os.path.join(workdir, "call.pkl"), "rb") as f:
            args, kwargs = pickle.load(f)
        fn = resolve(os.environ[FN_VAR])
        result = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(result)
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"rank {rank}: the return value {type(result).__name__} cannot "
                            f"be pickled ({exc}); return plain data") from exc
        _write(os.path.join(workdir, f"rank.{rank}.pkl"), payload)
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            raise
        text = traceback.format_exc()
        _write(os.path.join(workdir, f"rank.{rank}.err"), text.encode())
        sys.stderr.write(text)
        sys.stderr.flush()
        _report(rank, exc, text)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
