"""Imported by a zygote in tests/runner/test_zygote.py: a worker that finds this module
imported in another process was forked from it."""

import os

IMPORTED_IN = os.getpid()

import numpy.random  # noqa: E402,F401  as torch's import does: the global state exists here
