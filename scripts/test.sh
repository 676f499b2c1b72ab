#!/usr/bin/env bash
# Set up a virtual environment with everything the tests need, then run them.
#   bash scripts/test.sh            the whole suite (what .ci/run calls), MXNet's venv beside it
#   bash scripts/test.sh --quick    the edit-test tier: the same venv, reused as it is,
#                                   without the slow parts (tests/conftest.py, docs/testing.md)
# Other arguments go to pytest. torch is pinned by constraints.txt (an unpinned torch
# pulls a multi-GB CUDA build). MXNet needs numpy<1.24, so its binding (and the core, on
# that numpy) is tested in a second venv by scripts/mxnet_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
# uv installs what pip does, from the same places, in about 25 s where pip took 1:53 with
# every wheel in its cache (most of a fresh clone's install: unpacking TensorFlow, JAX,
# torch, Ray one after another); pip itself when uv cannot be had or fails
install_test_venv() {
    local args=() v
    if .venv/bin/pip install -q uv 2>/dev/null && [ -x .venv/bin/uv ]; then
        # uv reads no pip configuration: hand it pip's wheel folders and extra indexes
        # (where this kind of machine keeps torch's CPU build and a local mirror)
        for v in $(.venv/bin/pip config get global.find-links 2>/dev/null || true); do
            args+=(--find-links "$v")
        done
        for v in $(.venv/bin/pip config get global.extra-index-url 2>/dev/null || true); do
            args+=(--extra-index-url "$v")
        done
        if .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -c constraints.txt \
                ${args[@]+"${args[@]}"} -e '.[test]'; then
            # uv keeps every build of an sdist it cannot tell is the same (pyspark's,
            # 1.4 GB unpacked, once per fresh clone): 41 GB after a few days of runs
            # filled this machine's disk, and CI failed on "No space left on device".
            # Pruning drops what no current entry uses (seconds)
            .venv/bin/uv cache prune -q 2>/dev/null || true
            return 0
        fi
        echo "test.sh: uv could not install the test dependencies; pip will" >&2
    fi
    .venv/bin/pip install -q -c constraints.txt -e '.[test]'
}
for arg in "$@"; do
    [ "$arg" = "--quick" ] && quick=1
done
if [ "$quick" = 1 ] && .venv/bin/python -c "import ronde, torch, pytest, xdist" 2>/dev/null; then
    :  # reuse the venv as it is
else
    python3 -m venv .venv
    install_test_venv
fi
# the tests start hundreds of processes: give them ronde's bytecode once (an editable
# install under PYTHONDONTWRITEBYTECODE=1 would compile every module in every process)
.venv/bin/python -m compileall -q src/ronde > /dev/null
# MXNet's venv and tests (whole suite only) beside the main run, their output after it;
# at a lower CPU priority (nice), so that they take the main run's idle time instead of
# slowing it down (the main run is what the suite's time is); their time limits three
# times the main run's, since starved is not hung (tests/conftest.py). Not beside the main
# install: two editable installs of one source tree at once could race.
status=0
if [ "$quick" = 0 ]; then
    mkdir -p build
    RONDE_MXNET_CORE=1 RONDE_TEST_TIMEOUT_SCALE=3 nice -n 15 bash scripts/mxnet_tests.sh -k "not gloo" \
        > build/mxnet-tests.log 2>&1 &
    mxnet=$!
fi
# Three pytest workers (pytest-xdist, RONDE_TEST_WORKERS=0 for none): the tests'
# processes wait on sockets, peers and timeouts much of the time; one worker kept the two
# cores 115 % busy, two 171 %; since ranks are forked from a zygote that imported torch
# (tests/conftest.py) two left them 127 % busy, and a third took the main run from 16:09
# to 14:21 (docs/testing.md). Ray's tests take a lock: one local Ray at a time.
workers=(-n "${RONDE_TEST_WORKERS:-3}" --dist worksteal)
.venv/bin/python -m pytest -q "${workers[@]}" --durations=25 "$@" || status=$?
if [ "$quick" = 0 ]; then
    wait "$mxnet" || { [ "$status" != 0 ] || status=1; }
    echo "== MXNet venv (scripts/mxnet_tests.sh) =="
    cat build/mxnet-tests.log
fi
exit "$status"
