#!/usr/bin/env bash
# One call on a GPU machine: environment, GPU tests at real shapes, then the layer benchmark.
# Writes logs and the benchmark CSV under $OUT (default ./gpu-out).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
TEST_TIMEOUT=${TEST_TIMEOUT:-330}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout -s KILL "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider tests/ ${PYTEST_ARGS:-} \
    2>&1 | tee "$OUT/pytest.log"
  echo "pytest exit: ${PIPESTATUS[0]}"
fi
timeout -s KILL "$BENCH_TIMEOUT" python3 -m mok bench --csv "$OUT/layer.csv" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench.log"
echo "bench exit: ${PIPESTATUS[0]}"
if [ "${RUN_BREAKDOWN:-0}" = 1 ]; then
  timeout -s KILL 150 python3 -m benchmarks.breakdown ${BREAKDOWN_ARGS:-} 2>&1 | tee "$OUT/breakdown.log"
fi
