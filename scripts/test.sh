#!/usr/bin/env bash
# Set up a virtual environment with everything the tests need, then run them.
# torch is pinned by constraints.txt (an unpinned torch pulls a multi-GB CUDA build).
# MXNet needs numpy<1.24, so its binding (and the core, on that numpy) is tested in a
# second venv by scripts/mxnet_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -c constraints.txt -e '.[test]'
# the tests start hundreds of processes: give them ronde's bytecode once (an editable
# install under PYTHONDONTWRITEBYTECODE=1 would compile every module in every process)
.venv/bin/python -m compileall -q src/ronde > /dev/null
.venv/bin/python -m pytest -q "$@"
RONDE_MXNET_CORE=1 bash scripts/mxnet_tests.sh -k "not gloo"
