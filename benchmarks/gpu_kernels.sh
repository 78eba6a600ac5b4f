#!/usr/bin/env bash
# The Monarch kernels on a GPU machine, in one go, most important first: correctness against
# the float64 reference (tests/test_monarch_gpu.py), the benchmark table (monarch_kernels.bench),
# where the time goes by stage and on the host (benchmarks/gpu_stage_probe.py) and every
# kernel config timed (monarch_kernels.tune).
# Logs go to $OUT (default /tmp/monarch-gpu).
# Needs torch, triton, pytest and pytest-xdist. Environment: TEST_WORKERS; PROBE_CASES and
# TUNE_CASES (n:blocks:batch, space-separated; empty skips); BENCH_ARGS; TEST_, PROBE_, BENCH_
# and TUNE_TIMEOUT in seconds; BUDGET, seconds for the whole script: a step gets
# at most what is left, and is skipped with under 20 seconds left.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/monarch-gpu}
export OUT
mkdir -p "$OUT"
export PYTHONPATH=$PWD/kernels:$PWD/tests PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-900}

# timeout for a step: its own limit or what is left of the budget, whichever is less
limit() {
  local left=$((BUDGET - SECONDS))
  ((left < 20)) && return 1
  echo $(($1 < left ? $1 : left))
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  2>&1 | tee "$OUT/smi.txt" || rocm-smi 2>&1 | tee "$OUT/smi.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if t=$(limit "${TEST_TIMEOUT:-300}"); then
  timeout "$t" $PY -m pytest -q -p no:cacheprovider -n ${TEST_WORKERS:-8} \
    tests/test_monarch_gpu.py >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests exit $? after ${SECONDS}s"
  grep -E "passed|failed|error|Error" "$OUT/gpu_tests.log" | grep -v -i warn | tail -15
fi
if t=$(limit "${BENCH_TIMEOUT:-240}"); then
  timeout "$t" $PY -m monarch_kernels.bench ${BENCH_ARGS:-} 2>&1 \
    | grep -v -i warn | tee "$OUT/bench.log"
  echo "bench done after ${SECONDS}s"
fi
for case in ${PROBE_CASES-4096:64:16384}; do
  t=$(limit "${PROBE_TIMEOUT:-150}") || break
  timeout "$t" $PY benchmarks/gpu_stage_probe.py --case "$case" 2>&1 \
    | grep -v -i warn | tee -a "$OUT/probe.log" | grep -E "^\||failed"
  echo "probe $case done after ${SECONDS}s"
done
for case in ${TUNE_CASES-4096:64:16384}; do
  t=$(limit "${TUNE_TIMEOUT:-150}") || break
  timeout "$t" $PY -m monarch_kernels.tune --case "$case" 2>&1 \
    | grep -v -i warn >>"$OUT/tune.log"
  echo "tune $case done after ${SECONDS}s"
done
