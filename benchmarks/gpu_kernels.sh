#!/usr/bin/env bash
# The Monarch kernels on a GPU machine, in one go: correctness against the float64 reference
# (tests/test_monarch_gpu.py), where the time goes by stage (benchmarks/gpu_stage_probe.py),
# every kernel config timed (monarch_kernels.tune) and the benchmark table
# (monarch_kernels.bench). Logs go to $OUT (default /tmp/monarch-gpu). Needs torch, triton,
# pytest and pytest-xdist. Environment: PROBE_CASES and TUNE_CASES (n:blocks:batch, space-
# separated; empty skips), BENCH_ARGS, and TEST_/PROBE_/TUNE_/BENCH_TIMEOUT in seconds.
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
echo "gpu tests exit $?"
grep -E "passed|failed|error|Error" "$OUT/gpu_tests.log" | grep -v -i warn | tail -15
for case in ${PROBE_CASES-4096:64:16384}; do
  timeout "${PROBE_TIMEOUT:-90}" $PY benchmarks/gpu_stage_probe.py --case "$case" 2>&1 \
    | grep -v -i warn | tee -a "$OUT/probe.log" | grep "^|"
done
for case in ${TUNE_CASES-4096:64:16384}; do
  timeout "${TUNE_TIMEOUT:-150}" $PY -m monarch_kernels.tune --case "$case" 2>&1 \
    | grep -v -i warn | tee -a "$OUT/tune.log"
done
timeout "${BENCH_TIMEOUT:-240}" $PY -m monarch_kernels.bench ${BENCH_ARGS:-} 2>&1 \
  | grep -v -i warn | tee "$OUT/bench.log"
