"""Benchmarks shipped with ronde: ``python -m ronde.bench allreduce|latency``.

Each contender (ronde over each transport, and torch.distributed's Gloo backend as the
peer) runs the same measurement loop (:mod:`ronde.bench._timing`) in its own job of
``np`` processes; the driver (:mod:`ronde.bench.__main__`) interleaves the contenders
over several rounds, prints one JSON line per point and a table of ratios against the
peers. See docs/benchmarks.md for the method and a measured run.
"""
