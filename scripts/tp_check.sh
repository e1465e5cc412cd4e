#!/usr/bin/env bash
# One call on the 2-GPU machine (nvidia-h200-x2): install, the tensor-parallel GPU tests, then B6 (the
# all-reduces of a decode step, eager and in a CUDA graph; batch-1 decode and B1 throughput at TP1 and TP2),
# and the B6 summary (`b6.md`: TP2 over TP1 from this run). A run that outlives
# its limit has every Python process of it dump its stacks (SIGABRT with PYTHONFAULTHANDLER), so a hang in
# NCCL or in graph capture shows where each rank waits. Logs and results go to $OUT (or ./gpu_out). All of it
# takes longer than one call: TP_JOBS="allreduce tests", then TP_JOBS="latency throughput".
#   TP_JOBS="tests allreduce latency throughput"   which parts to run, in this order (default: all)
#   TP_LIMIT=420   seconds for the tests      B6_LIMIT=300   seconds for each benchmark command
#   B6_PRESETS="qwen3-8b llama-3.1-8b"   presets of the latency job
#   THROUGHPUT_TP="1 2"   tensor-parallel sizes of the B1 throughput job (TP1 in the same run, for the summary)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
TESTS=0 bash scripts/gpu_check.sh >/dev/null || { echo "install failed"; exit 1; }

bounded() {  # bounded SECONDS LOG COMMAND...
  local limit=$1 log=$2
  shift 2
  "$@" >"$log" 2>&1 &
  local pid=$! waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    echo "== still running after ${limit}s: the stacks of every rank follow" >>"$log"
    pkill -ABRT -f "multiprocessing.spawn"  # the tensor-parallel workers
    pkill -ABRT -P "$pid"                  # a benchmark's job process (rank 0)
    kill -ABRT "$pid"
    sleep 5
    kill -9 "$pid" 2>/dev/null
  fi
  wait "$pid"
  echo "== exit status $?" >>"$log"
  tail -n 40 "$log"
}

for job in ${TP_JOBS:-tests allreduce latency throughput}; do  # in the order given
  case $job in
    tests)
      bounded "${TP_LIMIT:-420}" "$OUT/tp_tests.log" python3 -m pytest -q -m gpu core/tests/test_tensor_parallel_gpu.py ;;
    allreduce)
      bounded "${B6_LIMIT:-300}" "$OUT/b6_allreduce_tp2.log" python3 benchmarks/allreduce.py \
        --presets qwen3-8b --tensor-parallel-size 2 --out "$OUT" --name b6_allreduce_tp2 ;;
    latency)
      for tp in 1 2; do
        bounded "${B6_LIMIT:-300}" "$OUT/b6_latency_tp$tp.log" python3 -m nanovllm.cli bench latency \
          --presets ${B6_PRESETS:-qwen3-8b llama-3.1-8b} --tensor-parallel-size "$tp" --out "$OUT" --name "b6_latency_tp$tp"
      done ;;
    throughput)
      for tp in ${THROUGHPUT_TP:-1 2}; do
        bounded "${B6_LIMIT:-300}" "$OUT/b6_throughput_tp$tp.log" python3 -m nanovllm.cli bench throughput \
          --presets qwen3-8b --tensor-parallel-size "$tp" --out "$OUT" --name "b6_throughput_tp$tp"
      done ;;
    *) echo "unknown TP_JOBS entry: $job (tests, allreduce, latency, throughput)"; exit 2 ;;
  esac
done
if compgen -G "$OUT/b6_latency_tp*.json" >/dev/null || compgen -G "$OUT/b6_throughput_tp*.json" >/dev/null; then
  python3 benchmarks/tp_summary.py "$OUT" --name b6
fi
