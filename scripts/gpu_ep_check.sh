#!/usr/bin/env bash
# One call on a machine with several GPUs: the expert-parallel tests (functional, nn, Hugging
# Face, example), then the EP benchmark with mok's per-kernel times.
# Writes under $OUT (default ./gpu-out). EP_SIZE (default 2) ranks; EP_TESTS=0 / EP_BENCH=0 skip
# a step; *_TIMEOUT seconds; EP_TESTS_K the tests' pytest -k expression; EP_BENCH_ARGS extra
# benchmark arguments. NVLink multicast stays off.
# With 4 or 8 GPUs the tests' main cases run with 4 and 8 ranks too: give EP_TESTS_TIMEOUT room
# (with 2 GPUs on a fresh machine, compiling included, they took over 300 s).
# EP_SHARE_GPU=1 (a machine with one GPU): the tests' ranks share it (MOK_RANKS_SHARE_GPU, gloo
# between them; a check of the code, slow) and the benchmark is skipped unless EP_BENCH=1 (then
# its ranks share the GPU too, without the NCCL baseline: mok's variants against each other).
# There the tests' 4- and 8-rank cases run too, every rank on the one GPU: EP_TESTS_K='4]' or '8]'
# selects them (on one H200 about 6 min for each set).
# EP_HOST=1: also the host's time per EP call (python -m benchmarks.host --ep, EP_HOST_SHAPES,
# default qwen3-30b-a3b and kimi-ep64-slice; with EP_SHARE_GPU the ranks share the GPU).
# The tests also leave $OUT/gpu-tests/<date>_<commit>_ep.log (benchmarks.gpu_test_log: commit,
# date, GPU, versions, the pytest command, its failures and counts). It is meant to be committed
# under benchmarks/results/gpu-tests/, the record of which commit passed on GPUs. The commit is
# that of the tree holding the mok that ran (mok.provenance): in a copy of the tree without .git,
# set MOK_COMMIT to the commit it was copied from.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EP_SIZE=${EP_SIZE:-2}
if [ "${EP_SHARE_GPU:-0}" = 1 ]; then
  export MOK_RANKS_SHARE_GPU=1 EP_BENCH=${EP_BENCH:-0}
fi
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv
nvidia-smi topo -m | head -n $((EP_SIZE + 2))
# Output goes to files only (no pipes): a killed run must not leave children holding a pipe.
if [ "${EP_TESTS:-1}" = 1 ]; then
  echo "== ep tests (limit ${EP_TESTS_TIMEOUT:-420}s)"
  # -rfE: every failure and error listed at the end, where the test log picks them up.
  cmd=(timeout -s KILL "${EP_TESTS_TIMEOUT:-420}" python3 -m pytest -q -rfE -p no:cacheprovider
       tests/exchange/test_expert_parallel.py tests/exchange/test_ring.py
       tests/integrations/test_examples.py tests/integrations/test_nn.py
       tests/integrations/test_huggingface.py
       -k "${EP_TESTS_K:-expert_parallel or test_ep_ or test_ring_}"
       ${EP_TESTS_ARGS:-})
  printf -v command '%q ' "${cmd[@]}"
  "${cmd[@]}" > "$OUT/ep_tests.log" 2>&1
  status=$?
  echo "== ep tests exit: $status"; tail -n 40 "$OUT/ep_tests.log"
  python3 -m benchmarks.gpu_test_log --out-dir "$OUT/gpu-tests" --suite ep \
    --group "$OUT/ep_tests.log" "$status" "${command% }"
fi
if [ "${EP_BENCH:-1}" = 1 ]; then
  # EP_BENCH_VARIANTS: '|'-separated extra arguments, one benchmark run each (rows of all of
  # them in $OUT/ep.csv), e.g. "|--recompute-gate-up|--gluon-pull --minibatch 16".
  IFS='|' read -r -a variants <<< "${EP_BENCH_VARIANTS:-}"
  [ ${#variants[@]} -eq 0 ] && variants=("")
  for i in "${!variants[@]}"; do
    echo "== ep bench ${variants[$i]} (limit ${EP_BENCH_TIMEOUT:-300}s)"
    timeout -s KILL "${EP_BENCH_TIMEOUT:-300}" python3 -m mok bench --ep "$EP_SIZE" --profile \
      --csv "$OUT/ep.csv" ${EP_BENCH_ARGS:-} ${variants[$i]} > "$OUT/ep_bench.$i.log" 2>&1
    echo "== ep bench exit: $?"; tail -n 60 "$OUT/ep_bench.$i.log"
  done
fi
if [ "${EP_HOST:-0}" = 1 ]; then
  echo "== host time per EP call (limit ${EP_HOST_TIMEOUT:-300}s)"
  timeout -s KILL "${EP_HOST_TIMEOUT:-300}" python3 -m benchmarks.host --ep "$EP_SIZE" \
    --shapes ${EP_HOST_SHAPES:-qwen3-30b-a3b kimi-ep64-slice} --repeats 10 --top 30 \
    > "$OUT/ep_host.log" 2>&1
  echo "== host time exit: $?"; grep -A12 "^==" "$OUT/ep_host.log"
fi
