#!/usr/bin/env bash
# Nsight Compute counters of layer stages, one launch each, on a GPU machine (Firecracker runtime:
# ncu reads the counters there; the clocks are left alone). Runs benchmarks.breakdown at NCU_SHAPE
# (default qwen3-30b-a3b) for NCU_STAGES (breakdown stage names; default the three largest row
# GEMMs), each stage's one timed call between cudaProfilerStart and Stop, so the warmup and the
# setup's launches are not profiled. Writes $OUT/ncu.csv (ncu --csv --page details, its messages
# included), $OUT/ncu_metrics.csv (a second pass, --page raw:
# stall reasons and pipe shares),
# $OUT/ncu_summary.txt (benchmarks.ncu_summary) and $OUT/ncu_run.log; NCU_TIMEOUT
# seconds (default 300), NCU_ARGS extra ncu arguments. NCU_COMMAND profiles another command
# instead (a string, e.g. "python3 -m benchmarks.deepgemm --repeats 1"), every launch from the
# start: pick the launches with NCU_ARGS (e.g. "-k regex:fp8_rows -c 4").
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stages=${NCU_STAGES:-gate_up_swiglu down_bwd_dswiglu down_bwd_saved}
ncu --version > "$OUT/ncu_run.log" 2>&1
if [ -n "${NCU_COMMAND:-}" ]; then
  read -r -a command <<< "$NCU_COMMAND"
  range=(--profile-from-start on)
else
  command=(python3 -m benchmarks.breakdown --shapes "${NCU_SHAPE:-qwen3-30b-a3b}" --stages $stages
           --repeats 1 --warmup 1 --profiler-range)
  range=(--profile-from-start off)
fi
timeout -s KILL "${NCU_TIMEOUT:-300}" ncu --clock-control none "${range[@]}" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section WarpStateStats \
  --csv --page details --log-file "$OUT/ncu.csv" ${NCU_ARGS:-} \
  "${command[@]}" >> "$OUT/ncu_run.log" 2>&1
echo "ncu exit: $?" >> "$OUT/ncu_run.log"
# Second pass, every metric the warp-state and compute sections gather (--page raw: one row per
# launch): the warp stall reasons and the pipes' shares of active cycles.
timeout -s KILL "${NCU_TIMEOUT:-300}" ncu --clock-control none "${range[@]}" \
  --section WarpStateStats --section ComputeWorkloadAnalysis \
  --csv --page raw --log-file "$OUT/ncu_metrics.csv" ${NCU_ARGS:-} \
  "${command[@]}" >> "$OUT/ncu_run.log" 2>&1
echo "ncu metrics pass exit: $?" >> "$OUT/ncu_run.log"
python3 -m benchmarks.ncu_summary "$OUT/ncu.csv" "$OUT/ncu_metrics.csv" \
  > "$OUT/ncu_summary.txt" 2>&1
cat "$OUT/ncu_run.log" "$OUT/ncu_summary.txt"
