#!/usr/bin/env bash
# Tensor parallelism on a machine of several GPUs (nvidia-h200-x2, nvidia-h200-x4): install, then the stages
# named (default: all of them, in this order), at TPn = every GPU of the machine (TP_SIZE to choose):
#   tests       the tensor-parallel GPU tests at TPn (at 4 also two torchrun nodes of two GPUs), then the check
#               for leftover processes and /dev/shm segments
#   latency     batch-1 decode of $PRESETS at TP1 and at TPn              (benchmarks/tp_bench.py)
#   large       $LARGE (llama-3.1-70b) at TPn: batch-1 decode, B1, TTFT at 32K; only with 4 or more GPUs
#   throughput  B1 of $PRESETS at TP1 and at TPn                           (benchmarks/tp_bench.py)
#   quest       Quest next to full, 8 x 32K tokens, under TPn               (benchmarks/quest_decode.py)
#   allreduce   the all-reduces of a decode step at TPn                     (benchmarks/allreduce.py)
# A device call may run 600 s: the call has TP_BUDGET seconds (default 540, install included) and each stage
# its own time box; a stage that would not fit in what is left is not started, and the summary names it, to be
# run in a second call (bash scripts/tp_check.sh STAGE ...). A stage that outlives its box has every process
# of it dump its stacks (SIGABRT, PYTHONFAULTHANDLER), so a hang in NCCL or a graph capture shows where each
# rank waits. After every stage, the processes it left (those this script started, by a variable in their
# environment) and /dev/shm entries new since the last check are reported (leftovers.txt); the processes ended.
# Everything goes to $TP_WORK (default /tmp/tp_check); to $OUT (default gpu_out) go tp_summary_TAG.md and
# .json (benchmarks/tp_summary.py: TPn against TP1 and the targets) and tp_TAG.tar.gz of every result and log.
#   PRESETS="qwen3-8b llama-3.1-8b"   LARGE=llama-3.1-70b   NANOVLLM_COMMIT=<commit sent> (recorded in results)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
WORK=${TP_WORK:-/tmp/tp_check}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
deadline=$((SECONDS + ${TP_BUDGET:-540}))
TESTS=0 bash scripts/gpu_check.sh >"$WORK/install.log" 2>&1 || { cat "$WORK/install.log"; echo "install failed"; exit 1; }
tail -n 1 "$WORK/install.log"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
tp=${TP_SIZE:-$gpus}
if [ "$tp" -lt 2 ]; then echo "TPn=$tp: tensor parallelism needs 2 GPUs or more"; exit 2; fi
presets=${PRESETS:-qwen3-8b llama-3.1-8b}
large=${LARGE:-llama-3.1-70b}
stages=("$@")
if [ ${#stages[@]} -eq 0 ]; then
  stages=(tests latency throughput quest allreduce)
  [ "$tp" -ge 4 ] && stages=(tests latency large throughput quest allreduce)
fi
tag="h200x${gpus}_tp${tp}_$(IFS=-; echo "${stages[*]}")"
nvidia-smi topo -m >"$WORK/topology.txt" 2>&1
echo "TPn=$tp on $gpus GPUs; stages: ${stages[*]}" | tee "$WORK/stages.txt"

descendants() {  # every process below PID, deepest first
  local child
  for child in $(ps -o pid= --ppid "$1"); do
    descendants "$child"
    echo "$child"
  done
}

# Every process this script starts carries TP_CHECK_RUN in its environment: the leftover check finds and
# ends only those, whoever else runs on the machine.
export TP_CHECK_RUN="tp_check_$$_$RANDOM"
our_processes() { grep -lsz "^TP_CHECK_RUN=$TP_CHECK_RUN\$" /proc/[0-9]*/environ | cut -d/ -f3; }
baseline_shm=$(ls -A /dev/shm | sort)

check_leftovers() {  # STAGE: report, then end, the processes and /dev/shm entries the stage left
  local stage=$1 pid new_shm left=()
  for pid in $(our_processes); do
    # still there, and not this script or a command of this check (its children)
    if [ "$pid" != "$$" ] && kill -0 "$pid" 2>/dev/null && [ "$(ps -o ppid= -p "$pid" | tr -d ' ')" != "$$" ]; then
      left+=("$pid")
    fi
  done
  new_shm=$(comm -13 <(echo "$baseline_shm") <(ls -A /dev/shm | sort))
  if [ ${#left[@]} -eq 0 ] && [ -z "$new_shm" ]; then
    echo "$stage: no leftover process, no new /dev/shm entry" | tee -a "$WORK/leftovers.txt"
    return
  fi
  {
    echo "$stage: LEFTOVERS"
    [ ${#left[@]} -gt 0 ] && ps -o pid=,ppid=,etimes=,args= -p "$(IFS=,; echo "${left[*]}")"
    [ -n "$new_shm" ] && echo "/dev/shm: $new_shm"
  } | tee -a "$WORK/leftovers.txt"
  [ ${#left[@]} -gt 0 ] && kill -9 "${left[@]}" 2>/dev/null
  baseline_shm=$(ls -A /dev/shm | sort)  # each entry reported once
}

bounded() {  # STAGE LIMIT COMMAND...: the command's output to $WORK/STAGE.log, at most LIMIT seconds
  local stage=$1 limit=$2 waited=0 pid status
  shift 2
  "$@" >"$WORK/$stage.log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    echo "== still running after ${limit}s: the stacks of every process follow" >>"$WORK/$stage.log"
    local tree
    tree=$(descendants "$pid")
    kill -ABRT $tree "$pid" 2>/dev/null
    sleep 5
    kill -9 $(descendants "$pid") "$pid" 2>/dev/null
  fi
  wait "$pid"
  status=$?
  echo "== $stage: exit status $status after ${waited}s" >>"$WORK/$stage.log"
  tail -n 25 "$WORK/$stage.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -n 12
  check_leftovers "$stage"
}

stage() {  # STAGE LIMIT COMMAND...: bounded, if at least a minute of the budget is left
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  if [ "$left" -lt 60 ]; then
    echo "$name: not started, ${left}s of the call's budget left; run it in another call" | tee -a "$WORK/not_run.txt"
    return
  fi
  echo "== $name (at most $((left < limit ? left : limit))s)"
  bounded "$name" $((left < limit ? left : limit)) "$@"
}

for name in "${stages[@]}"; do
  case $name in
    tests)
      stage tests 330 env NANOVLLM_TEST_TP="$tp" python3 -m pytest -q -m gpu -p no:cacheprovider \
        core/tests/test_tensor_parallel_gpu.py ;;
    latency)
      stage latency 300 python3 benchmarks/tp_bench.py --only latency --tensor-parallel-size "$tp" --presets $presets \
        --out "$WORK" --name "latency_tp$tp" ;;
    throughput)
      stage throughput 420 python3 benchmarks/tp_bench.py --only throughput --tensor-parallel-size "$tp" \
        --presets $presets --out "$WORK" --name "throughput_tp$tp" ;;
    large)
      if [ "$tp" -lt 4 ]; then echo "large: needs TPn of 4 or more, this is $tp" | tee -a "$WORK/not_run.txt"; continue; fi
      stage large 420 python3 benchmarks/tp_bench.py --only large --tensor-parallel-size "$tp" --large-preset "$large" \
        --out "$WORK" --name "large_tp$tp" ;;
    quest)
      stage quest 300 python3 benchmarks/quest_decode.py --only decode --contexts 32768 --batches 8 \
        --tensor-parallel-size "$tp" --out "$WORK" --name "quest_tp$tp" ;;
    allreduce)
      ar_presets=qwen3-8b
      [ "$tp" -ge 4 ] && ar_presets="qwen3-8b $large"
      stage allreduce 180 python3 benchmarks/allreduce.py --presets $ar_presets --tensor-parallel-size "$tp" \
        --out "$WORK" --name "allreduce_tp$tp" ;;
    *) echo "unknown stage: $name (tests, latency, large, throughput, quest, allreduce)"; exit 2 ;;
  esac
done

python3 benchmarks/tp_summary.py "$WORK" --name tp_summary >/dev/null 2>"$WORK/tp_summary.log"
{
  cat "$WORK/tp_summary.md" 2>/dev/null || echo "no summary: see tp_summary.log"
  echo
  echo "Leftovers:"; cat "$WORK/leftovers.txt" 2>/dev/null
  [ -f "$WORK/not_run.txt" ] && { echo; echo "Not run:"; cat "$WORK/not_run.txt"; }
} | tee "$OUT/tp_summary_$tag.md"
cp "$WORK/tp_summary.json" "$OUT/tp_summary_$tag.json" 2>/dev/null
tar czf "$OUT/tp_$tag.tar.gz" -C "$WORK" .
