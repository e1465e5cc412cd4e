#!/usr/bin/env bash
# The flash_attn backend on the lent GPU machine, which has no network: install FlashAttention-4 from its
# wheels, the repo's distributions, run the plugin's GPU tests and the peer table (FA4 vs our Triton
# backend vs SDPA/cuDNN: nanovllm bench kernels). Results and logs go to $OUT (or ./gpu_out).
#   FA4_PARTS=DIR      holds part00, part01, part02: the pieces of .whl/fa4 (below), each carried to the
#                      machine by a call of its own that copies it to DIR while the machine stays warm
#   TESTS=0            skip the GPU tests; PYTEST_ARGS="..." extra pytest arguments
#   BENCH=0            skip the peer table; BENCH_NAME=name its file under $OUT (default kernel_peers)
#   FA4_CACHE=0        do not keep FA4's compiled kernels in /tmp between the processes of this machine
#   NANOVLLM_COMMIT=$(git rev-parse --short HEAD), set in the command sent: the peer table records it
# The parts are made on a machine with network, in .whl/fa4 (git-ignored):
#   pip download --no-deps -d w --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 --only-binary=:all: flash-attn-4==4.0.0b36 nvidia-cutlass-dsl \
#     nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi \
#     torch-c-dlpack-ext quack-kernels
#   pip download (same flags) -d extra einops protobuf 'cuda-bindings>=13,<14' cuda-pathfinder
#   tar cf fa4.tar w extra && split -b 51000000 -d fa4.tar part && rm fa4.tar
# The wheels go to /tmp/fa4site with pip --target, which reads no .pth file: the CuTe DSL's
# nvidia_cutlass_dsl/dsl_packages goes on PYTHONPATH by hand. The extra wheels (FA4's dependencies that a
# PyTorch install may lack) are installed only where this Python cannot import them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
: "${FA4_PARTS:?set FA4_PARTS to the folder holding part00, part01 and part02}"
SITE=/tmp/fa4site
python3 -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || { echo "the FA4 wheels are for CPython 3.12; download them for this machine's Python"; exit 1; }
if [ ! -d "$SITE/flash_attn/cute" ]; then  # a warm machine keeps the install of an earlier call
  cat "$FA4_PARTS"/part0[0-2] >"$FA4_PARTS/fa4.tar" && tar xf "$FA4_PARTS/fa4.tar" -C "$FA4_PARTS" \
    || { echo "the FA4 parts in $FA4_PARTS are incomplete"; exit 1; }
  missing=()
  python3 -c 'import einops' 2>/dev/null || missing+=("$FA4_PARTS"/extra/einops-*.whl)
  python3 -c 'import google.protobuf' 2>/dev/null || missing+=("$FA4_PARTS"/extra/protobuf-*.whl)
  python3 -c 'import cuda.bindings' 2>/dev/null || missing+=("$FA4_PARTS"/extra/cuda_bindings-*.whl \
    "$FA4_PARTS"/extra/cuda_pathfinder-*.whl)
  echo "extra wheels installed: ${missing[*]:-none}"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$FA4_PARTS"/w/*.whl "${missing[@]}" \
    || { echo "installing the FA4 wheels failed"; exit 1; }
fi
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
if [ "${FA4_CACHE:-1}" != 0 ]; then
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
fi
for pkg in core plugins/nanovllm_qwen3 plugins/nanovllm_llama plugins/nanovllm_mistral plugins/nanovllm_flash_attn; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "$pkg" >/dev/null 2>&1 || { echo "install of $pkg failed"; exit 1; }
done
python3 -c "import torch, triton, cutlass, flash_attn.cute, importlib.metadata as md; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'flash-attn-4', md.version('flash-attn-4'), 'cutlass-dsl', \
md.version('nvidia-cutlass-dsl'), torch.cuda.get_device_name())" || { echo "FA4 does not import"; exit 1; }
python3 -m nanovllm.cli plugins | grep -A3 '^flash_attn' | tee "$OUT/fa4_plugins.txt"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  # the whole log lands in $OUT as it runs, so a call cut short by its time limit still returns it
  python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 plugins/nanovllm_flash_attn/tests ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/fa4_tests.log" | tail -60
  status=${PIPESTATUS[0]}
fi
if [ "${BENCH:-1}" != 0 ]; then
  python3 -m nanovllm.cli bench kernels --out "$OUT" --name "${BENCH_NAME:-kernel_peers}" 2>"$OUT/fa4_bench_stderr.log" \
    || status=1
  tail -c 3000 "$OUT/fa4_bench_stderr.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -15
fi
exit "$status"
