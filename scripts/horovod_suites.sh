#!/usr/bin/env bash
# Run Horovod's own test suites and examples against ronde, unchanged, through the
# opt-in alias (python -m ronde.compat: `import horovod.X` gives ronde.X).
#
#   bash scripts/horovod_suites.sh /path/to/horovod-checkout [NP]
#
# Needs a Horovod source checkout (its test/ and examples/ folders; Horovod itself is
# not installed or imported) and the venvs that scripts/test.sh and scripts/mxnet_tests.sh
# build. Writes one log per file to build/horovod-suites/ and prints pytest's summary
# line of each. Not part of CI: CI has no Horovod checkout (see docs/compat.md for the
# counts of the last run).
set -uo pipefail
HVD="${1:?usage: horovod_suites.sh HOROVOD_DIR [NP]}"
NP="${2:-2}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/build/horovod-suites"
mkdir -p "$OUT"
MAIN="$ROOT/.venv/bin"
MX="$ROOT/build/venv-mxnet/bin"
"$MAIN/pip" install -q mock cloudpickle packaging parameterized
[ -x "$MX/pip" ] && "$MX/pip" install -q mock cloudpickle packaging
cd "$HVD/test/parallel"
run() {  # venv-bin file
    local bin="$1" file="$2" log="$OUT/$2.np$NP.log" start
    start=$(date +%s)
    PYTHONUNBUFFERED=1 timeout 1200 "$bin/ronderun" -np "$NP" "$bin/python" -m ronde.compat \
        -m pytest -q -p no:cacheprovider --timeout 120 -rfE "$file" > "$log" 2>&1
    echo "$file np=$NP $(( $(date +%s) - start ))s: $(grep '^\[0\]' "$log" | tail -1 | sed 's/^\[0\]<stdout>://')"
}
for f in test_torch.py test_tensorflow.py test_tensorflow_process_sets.py \
         test_tensorflow2_keras.py test_tensorflow_keras.py test_keras.py; do
    run "$MAIN" "$f"
done
if [ -x "$MX/python" ]; then
    for f in test_mxnet1.py test_mxnet2.py; do run "$MX" "$f"; done
    # the MXNet example, its MNIST download pointed at local data (scikit-learn's digits)
    work="$(mktemp -d)"
    cp "$HVD/examples/mxnet/mxnet_mnist.py" "$work/"
    for r in $(seq 0 $((NP - 1))); do
        mkdir -p "$work/data-$r" && "$MX/python" "$ROOT/scripts/mnist_from_digits.py" "$work/data-$r/mnist.zip"
    done
    (cd "$work" && timeout 600 "$MX/ronderun" -np "$NP" "$MX/python" -m ronde.compat mxnet_mnist.py \
        > "$OUT/mxnet_mnist.np$NP.log" 2>&1)
    echo "examples/mxnet/mxnet_mnist.py np=$NP rc=$?: $(grep -i 'validation' "$OUT/mxnet_mnist.np$NP.log" | tail -1)"
fi
