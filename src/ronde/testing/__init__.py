"""Test helpers shipped with ronde, so users can test their own distributed code."""

from .ranks import RanksFailedError, run_ranks

__all__ = ["RanksFailedError", "run_ranks"]
