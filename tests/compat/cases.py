"""Many cases of a worker module in one launch (importing a framework is most of what a
launch costs): :func:`run_all` runs each, catching its error, so that a failing case
shows its own traceback and the others still run."""

from __future__ import annotations

import importlib
import traceback


def run_all(module: str, names: list[str]) -> dict[str, str]:
    """``{name: "ok" or the traceback}`` for the functions ``names`` of ``module``, run
    in order in this process."""
    mod = importlib.import_module(module)
    out = {}
    for name in names:
        try:
            out[name] = getattr(mod, name)()
        except Exception:  # noqa: BLE001 - reported per case
            out[name] = traceback.format_exc(limit=-3)
    return out
