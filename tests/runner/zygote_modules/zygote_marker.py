"""Imported by a zygote in tests/runner/test_zygote.py: a worker that finds this module
imported in another process was forked from it."""

import os

IMPORTED_IN = os.getpid()
