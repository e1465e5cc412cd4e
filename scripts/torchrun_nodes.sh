#!/usr/bin/env bash
# Start NODES torchrun nodes on this host, PER_NODE ranks each, meeting at 127.0.0.1: a stand-in for NODES
# hosts. Each node gets GPUs of its own through CUDA_VISIBLE_DEVICES (node i: GPUs i*PER_NODE onwards of
# those visible), as a host of its own would have; each rank takes the GPU of its LOCAL_RANK.
#   scripts/torchrun_nodes.sh NODES PER_NODE SCRIPT [ARGS...]
# e.g. scripts/torchrun_nodes.sh 2 2 examples/torchrun_generate.py llama-3.1-70b   (TP4 as 2 nodes x 2 GPUs)
# On real hosts run on each one: torchrun --nnodes NODES --node-rank I --nproc-per-node PER_NODE
#   --master-addr FIRST_HOST --master-port PORT SCRIPT [ARGS...]
# PYTHON runs torchrun (default python3); MASTER_PORT (default: a free one). A node that fails stops the others.
set -uo pipefail
if [ $# -lt 3 ]; then sed -n 2,9p "$0"; exit 2; fi
nodes=$1 per_node=$2
shift 2
python=${PYTHON:-python3}
port=${MASTER_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
sliced=1
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && [ -z "$CUDA_VISIBLE_DEVICES" ]; then
  sliced=0  # no GPU is visible: every node runs on the CPU
else
  IFS=, read -ra gpus <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((nodes * per_node - 1)))}"
  if [ "${#gpus[@]}" -lt $((nodes * per_node)) ]; then
    echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES names ${#gpus[@]} GPUs; $nodes nodes of $per_node need $((nodes * per_node))"
    exit 2
  fi
fi
pids=()
for ((node = 0; node < nodes; node++)); do
  if [ "$sliced" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${gpus[*]:node*per_node:per_node}")
  fi
  "$python" -m torch.distributed.run --nnodes "$nodes" --node-rank "$node" --nproc-per-node "$per_node" \
    --master-addr 127.0.0.1 --master-port "$port" "$@" &
  pids+=($!)
done
status=0
while [ "${#pids[@]}" -gt 0 ]; do
  wait -n -p finished "${pids[@]}"
  code=$?
  left=()
  for pid in "${pids[@]}"; do [ "$pid" != "$finished" ] && left+=("$pid"); done
  pids=("${left[@]}")
  if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$code
    [ "${#pids[@]}" -gt 0 ] && kill "${pids[@]}" 2>/dev/null  # torchrun passes it on to its ranks
  fi
done
exit "$status"
