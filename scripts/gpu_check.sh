#!/usr/bin/env bash
# One call on the lent GPU machine: install every distribution (no network there), run the GPU tests,
# then the benchmarks when asked (BENCH=1). Results and logs go to $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for pkg in core plugins/nanovllm_qwen3 plugins/nanovllm_llama; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "$pkg" >/dev/null 2>&1 || { echo "install of $pkg failed"; exit 1; }
done
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -m gpu ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
exit "$status"
