"""``python -m ronde.run ...``: the same command line as ``ronderun``."""

from __future__ import annotations

import sys

from .runner.cli import main

if __name__ == "__main__":
    sys.exit(main())
