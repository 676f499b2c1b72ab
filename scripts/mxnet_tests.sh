#!/usr/bin/env bash
# Build the MXNet virtual environment and run the MXNet binding's tests in it.
#
# MXNet 1.9.1 (its last release) needs numpy<1.24, which cannot share a venv with
# JAX or torch's numpy 2, so the MXNet tests get their own venv. The venv lives in
# build/venv-mxnet (ignored by git) unless RONDE_MXNET_VENV names another folder.
# Extra arguments go to pytest; RONDE_MXNET_CORE=1 also runs the core on numpy 1.23: its
# unit suites (tests/core, tests/collectives) and every collective against numpy at np=2,
# 3 and 4 on each transport (the numpy-facing code; the transports' own scenarios move
# bytes the same way on any numpy and run once, in the main venv: they were half the
# CPU of this venv's run, beside the main run).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RONDE_MXNET_VENV:-build/venv-mxnet}"
PY="${RONDE_MXNET_PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import mxnet" 2>/dev/null; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # numpy<1.24: mxnet 1.9.1 uses the np.bool/np.int aliases removed in numpy 1.24.
    # scikit-learn<1.6 and scipy<1.14 still support numpy 1.23.
    "$VENV/bin/pip" install -q 'mxnet==1.9.1' 'numpy<1.24' 'scikit-learn<1.6' 'scipy<1.14' \
        'pytest>=7' 'pytest-timeout>=2.1' 'ml-dtypes>=0.3,<0.5'
    "$VENV/bin/pip" install -q --no-deps -e .
fi
TESTS=(tests/mxnet_binding)
if [ "${RONDE_MXNET_CORE:-0}" = "1" ]; then
    TESTS+=(tests/core tests/collectives
            tests/integration/test_collectives.py::test_every_collective_matches_numpy
            tests/integration/test_collectives.py::test_every_collective_at_np4)
fi
# -p no:cacheprovider: the main venv's pytest cache is not this venv's business.
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
