"""Test helpers shipped with ronde, so users can test their own distributed code."""

from .ranks import RanksFailedError, run_ranks, run_ranks_many
from .scripts import rank0_metric, run_script

__all__ = ["RanksFailedError", "rank0_metric", "run_ranks", "run_ranks_many", "run_script"]
