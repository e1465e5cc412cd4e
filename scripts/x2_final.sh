set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NANOVLLM_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo 356363b)
t0=$(date +%s); el() { echo $(( $(date +%s)-t0 )); }
TESTS=0 bash scripts/gpu_check.sh >/dev/null 2>&1 || echo install failed
echo "install $(el)s"
source <(sed -n '/^bounded()/,/^}/p' scripts/tp_check.sh)
bounded 210 $OUT/tp_tests.log python3 -m pytest -q -m gpu core/tests/test_tensor_parallel_gpu.py --durations=8 | tail -14
echo "tests $(el)s"
bounded 60 $OUT/b6_allreduce.log python3 -m nanovllm.cli bench allreduce --presets qwen3-8b --tensor-parallel-size 2 --out $OUT --name h200x2_b6_allreduce | tail -12
echo "allreduce $(el)s"
bounded 100 $OUT/b6_lat2.log python3 -m nanovllm.cli bench latency --presets qwen3-8b --tensor-parallel-size 2 --out $OUT --name h200x2_b6_latency_tp2 | tail -6
echo "latency $(el)s"
bounded 120 $OUT/b6_thr2.log python3 -m nanovllm.cli bench throughput --presets qwen3-8b --tensor-parallel-size 2 --out $OUT --name h200x2_b6_throughput_tp2 | tail -6
echo "thr2 $(el)s"
if [ $(el) -lt 430 ]; then
bounded $((540 - $(el))) $OUT/b6_thr1.log python3 -m nanovllm.cli bench throughput --presets qwen3-8b --tensor-parallel-size 1 --out $OUT --name h200x2_b6_throughput_tp1 | tail -6
fi
echo "done $(el)s"
ls $OUT
