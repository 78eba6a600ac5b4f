#!/usr/bin/env bash
# The Monarch kernels on a GPU machine, in one go: correctness against the float64 reference
# (tests/test_monarch_gpu.py), every kernel config timed on the issue's two cases
# (monarch_kernels.tune), and the benchmark table (monarch_kernels.bench). Logs go to $OUT
# (default /tmp/monarch-gpu); needs torch, triton, pytest (+ pytest-xdist for -n).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/monarch-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/kernels:$PWD/tests PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  2>&1 | tee "$OUT/smi.txt" || rocm-smi 2>&1 | tee "$OUT/smi.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider --noconftest -n 8 \
  tests/test_monarch_gpu.py >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; tail -25 "$OUT/gpu_tests.log"
timeout "${TUNE_TIMEOUT:-150}" $PY -m monarch_kernels.tune --case 4096:64:16384 2>&1 | tee "$OUT/tune_64.log"
timeout "${TUNE_TIMEOUT:-150}" $PY -m monarch_kernels.tune --case 4096:4:16384 --kinds group,stage \
  2>&1 | tee "$OUT/tune_4.log"
timeout "${BENCH_TIMEOUT:-240}" $PY -m monarch_kernels.bench ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
tar czf "$OUT/triton_cache.tgz" -C "$HOME" .triton 2>/dev/null || true
