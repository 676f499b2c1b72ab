"""Counting backward passes for ``backward_passes_per_step`` (framework-neutral).

Each gradient key (a parameter) has a window of ``passes_per_step`` backward
passes. :meth:`PassCounter.record` is called once per pass, when the key's
gradient is ready; it says when the window is complete (start the allreduce now).
A window may end early: ``optimizer.step()`` after fewer passes reduces what was
accumulated so far (a partial last window) and :meth:`reset` starts a new window.
"""

from __future__ import annotations

from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


class TooManyPassesError(RuntimeError):
    """More backward passes than ``backward_passes_per_step`` before ``step()``."""


class PassCounter(Generic[K]):
    """Per-key countdown of backward passes.

    Args:
        passes_per_step: backward passes accumulated locally before one allreduce (>= 1).
    """

    def __init__(self, passes_per_step: int) -> None:
        if int(passes_per_step) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes_per_step}")
        self.passes_per_step = int(passes_per_step)
        self._seen: dict[K, int] = {}

    def record(self, key: K, what: str = "gradient", *args: object) -> bool:
        """Count one backward pass of ``key``; True when its window is now complete.
        ``what`` names it in the error, formatted with ``args`` (only then: a hook
        calls this for every gradient of every step).

        Raises:
            TooManyPassesError: the window already completed and was not reset by a step.
        """
        seen = self._seen.get(key, 0)
        if seen >= self.passes_per_step:
            raise self.too_many(seen + 1, what, *args)
        self._seen[key] = seen + 1
        return seen + 1 == self.passes_per_step

    def too_many(self, passes: int, what: str, *args: object) -> TooManyPassesError:
        """The error of a key computed ``passes`` times in one window (``what`` and
        ``args`` as for :meth:`record`); a caller that counts on its own raises it too."""
        return TooManyPassesError(
            f"{what.format(*args)} was computed {passes} times before optimizer.step() with "
            f"backward_passes_per_step={self.passes_per_step}; call step() (or "
            "synchronize()) after each window, or raise backward_passes_per_step")

    def passes(self, key: K) -> int:
        """Backward passes counted for ``key`` in the current window."""
        return self._seen.get(key, 0)

    def reset(self) -> None:
        """Start a new window for every key (after the step)."""
        self._seen.clear()
