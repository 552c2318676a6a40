#!/usr/bin/env bash
# One call on a GPU machine, in priority order: tests, training comparison, tile sweep, layer
# benchmark (with the tiles just measured), host time per launcher, per-stage breakdown, the
# expert-parallel launches' pulls and scatters on one GPU. Each step has its own time limit and
# writes under $OUT (default ./gpu-out). Steps: RUN_TESTS RUN_TRAIN RUN_STEP (a training step
# by kernel kind and step mode) RUN_TRAIN_BENCH (end to end) RUN_TUNE RUN_BENCH RUN_HOST
# RUN_BREAKDOWN RUN_EP_LOCAL RUN_FP8 (the FP8 kernels beside bf16, benchmarks.fp8) RUN_DEEPGEMM
# (benchmarks.deepgemm; DEEPGEMM_SRC a DeepGEMM source tree, built first where deep_gemm does
# not import) RUN_COMPARE
# (benchmarks.compare; COMPARE_ARGS names the base: on a copy of the tree without its git
# history, --base REV --base-dir DIR with REV's mok extracted in DIR beforehand) (1 runs
# it); *_TIMEOUT seconds; *_ARGS extra arguments; TESTS_JOBS groups of tests side by side,
# TESTS_BY_ID=1 dealt by test rather than by file, TESTS_SHARD=K/N every N-th test from the K-th.
# The tests leave $OUT/tests.log (every group's tests and log) and
# $OUT/gpu-tests/<date>_<commit>.log (benchmarks.gpu_test_log: commit, date,
# GPU, versions, the pytest commands, each group's failures and counts). It is meant to be
# committed under benchmarks/results/gpu-tests/, the record of which commit passed on a GPU. The
# commit is that of the tree holding the mok that ran (mok.provenance): in a copy of the tree
# without .git, set MOK_COMMIT to the commit it was copied from.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step() {  # step NAME TIMEOUT LOG command...
  local name=$1 limit=$2 log=$3; shift 3
  echo "== $name (limit ${limit}s)"
  timeout -s KILL "$limit" "$@" 2>&1 | tee "$OUT/$log"
  echo "== $name exit: ${PIPESTATUS[0]}"
}
if [ "${RUN_TESTS:-1}" = 1 ]; then
  # The test files in TESTS_JOBS groups run side by side (compiling is most of their time);
  # one log per group, each group under the same time limit. TESTS_BY_ID=1 deals the tests
  # themselves (node ids, TESTS_ARGS applied when collecting) instead of whole files, so that
  # one long file is spread over the groups too; each group's ids go to $OUT/pytest.J.ids.
  # TESTS_SHARD=K/N (by id) runs every N-th test from the K-th: the suite over N calls, each
  # call's log named shardKofN.
  shopt -s nullglob
  jobs=${TESTS_JOBS:-5} files=(tests/test_*.py tests/*/test_*.py) pids=() commands=() summary=()
  shopt -u nullglob
  log_args=()
  [ -n "${TESTS_SHARD:-}" ] && TESTS_BY_ID=1
  if [ "${TESTS_BY_ID:-0}" = 1 ]; then
    mapfile -t files < <(python3 -m pytest --collect-only -q -p no:cacheprovider \
                         ${TESTS_ARGS:-} 2>/dev/null | grep '::')
  fi
  if [ -n "${TESTS_SHARD:-}" ]; then
    shard=${TESTS_SHARD%/*} shards=${TESTS_SHARD#*/} kept=()
    for ((i = shard - 1; i < ${#files[@]}; i += shards)); do kept+=("${files[$i]}"); done
    files=("${kept[@]}")
    log_args=(--suite "shard${shard}of${shards}")
    echo "== shard $TESTS_SHARD: ${#files[@]} tests"
  fi
  # no more groups than tests (an empty group would run pytest on everything)
  if [ "${#files[@]}" -lt "$jobs" ]; then jobs=${#files[@]}; fi
  echo "== tests in $jobs groups (limit ${TESTS_TIMEOUT:-330}s each)"
  for ((j = 0; j < jobs; j++)); do
    group=()
    for ((i = j; i < ${#files[@]}; i += jobs)); do group+=("${files[$i]}"); done
    # -rfE: every failure and error listed at the end, where the test log picks them up.
    cmd=(timeout -s KILL "${TESTS_TIMEOUT:-330}" python3 -m pytest -q -rfE -p no:cacheprovider)
    if [ "${TESTS_BY_ID:-0}" = 1 ]; then
      printf '%s\n' "${group[@]}" > "$OUT/pytest.$j.ids"
      printf -v "commands[$j]" '%q ' "${cmd[@]}"
      commands[$j]+="<the ${#group[@]} tests of pytest.$j.ids>"
      cmd+=("${group[@]}")
    else
      cmd+=("${group[@]}" ${TESTS_ARGS:-})
      printf -v "commands[$j]" '%q ' "${cmd[@]}"
    fi
    "${cmd[@]}" > "$OUT/pytest.$j.log" 2>&1 &
    pids[$j]=$!
  done
  for ((j = 0; j < jobs; j++)); do
    wait "${pids[$j]}"
    summary+=(--group "$OUT/pytest.$j.log" "$?" "${commands[$j]% }")
  done
  for ((j = 0; j < jobs; j++)); do echo "-- group $j"; tail -n 25 "$OUT/pytest.$j.log"; done
  python3 -m benchmarks.gpu_test_log --out-dir "$OUT/gpu-tests" "${log_args[@]}" "${summary[@]}"
  # The groups' logs and test ids in one file: a call brings back a few files only.
  for ((j = 0; j < jobs; j++)); do
    echo "== group $j"
    if [ -f "$OUT/pytest.$j.ids" ]; then echo "-- its tests"; cat "$OUT/pytest.$j.ids"; fi
    echo "-- its log"
    cat "$OUT/pytest.$j.log"
  done > "$OUT/tests.log"
  rm -f "$OUT"/pytest.*.log "$OUT"/pytest.*.ids
fi
if [ "${RUN_TRAIN:-0}" = 1 ]; then
  step train "${TRAIN_TIMEOUT:-150}" train.log python3 -m mok train --out "$OUT/train" \
    ${TRAIN_ARGS:-}
fi
if [ "${RUN_STEP:-0}" = 1 ]; then
  step step "${STEP_TIMEOUT:-300}" step.log python3 -m benchmarks.step --csv "$OUT/step.csv" \
    ${STEP_ARGS:-}
fi
if [ "${RUN_TRAIN_BENCH:-0}" = 1 ]; then
  step train_bench "${TRAIN_BENCH_TIMEOUT:-240}" train_bench.log python3 -m benchmarks.train \
    --no-progress --out "$OUT/train_bench" --csv "$OUT/train.csv" ${TRAIN_BENCH_ARGS:-}
fi
if [ "${RUN_TUNE:-0}" = 1 ]; then
  step tune "${TUNE_TIMEOUT:-200}" tune.log python3 -m benchmarks.tune \
    --out "$OUT/tuned_tiles.json" ${TUNE_ARGS:-}
  [ -s "$OUT/tuned_tiles.json" ] && export MOK_TILES_FILE="$OUT/tuned_tiles.json"
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  step bench "${BENCH_TIMEOUT:-240}" bench.log python3 -m mok bench --csv "$OUT/layer.csv" \
    ${BENCH_ARGS:-}
fi
# Liger's autotuning results (benchmarks/liger_tuning, read back by later runs) in one file:
# unpack it in the repository's root and commit it.
if [ -n "$(ls -A benchmarks/liger_tuning 2>/dev/null)" ]; then
  tar -cf "$OUT/liger_tuning.tar" benchmarks/liger_tuning
fi
if [ "${RUN_HOST:-0}" = 1 ]; then
  step host "${HOST_TIMEOUT:-120}" host.log python3 -m benchmarks.host ${HOST_ARGS:-}
fi
if [ "${RUN_BREAKDOWN:-0}" = 1 ]; then
  step breakdown "${BREAKDOWN_TIMEOUT:-150}" breakdown.log python3 -m benchmarks.breakdown \
    ${BREAKDOWN_ARGS:-}
fi
if [ "${RUN_FP8:-0}" = 1 ]; then
  step fp8 "${FP8_TIMEOUT:-200}" fp8.log python3 -m benchmarks.fp8 --csv "$OUT/fp8.csv" \
    ${FP8_ARGS:-}
fi
if [ "${RUN_DEEPGEMM:-0}" = 1 ]; then
  export PYTHONPATH=$(realpath "${DEEPGEMM_SRC:?DEEPGEMM_SRC names a DeepGEMM source tree}"):$PYTHONPATH
  if ! python3 -c "import deep_gemm" 2>/dev/null; then
    step deepgemm_build "${DEEPGEMM_BUILD_TIMEOUT:-200}" deepgemm_build.log \
      bash scripts/build_deepgemm.sh "$DEEPGEMM_SRC"
  fi
  step deepgemm "${DEEPGEMM_TIMEOUT:-300}" deepgemm.log python3 -m benchmarks.deepgemm \
    --csv "$OUT/fp8.csv" ${DEEPGEMM_ARGS:-}
fi
if [ "${RUN_COMPARE:-0}" = 1 ]; then
  step compare "${COMPARE_TIMEOUT:-300}" compare.log python3 -m benchmarks.compare \
    --csv "$OUT/compare.csv" ${COMPARE_ARGS:-}
fi
if [ "${RUN_EP_LOCAL:-0}" = 1 ]; then
  step ep_local "${EP_LOCAL_TIMEOUT:-200}" ep_local.log python3 -m benchmarks.ep_local \
    --csv "$OUT/ep_local.csv" ${EP_LOCAL_ARGS:-}
fi
