#!/usr/bin/env bash
# Set up a virtual environment with everything the tests need, then run them.
# torch is pinned by constraints.txt (an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -c constraints.txt -e '.[test]'
exec .venv/bin/python -m pytest -q "$@"
