#!/usr/bin/env bash
# Train on several nodes: run the same command on every node, changing only NODE_RANK.
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 0 2 --train.max_steps=5000   # node 0
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 1 2 --train.max_steps=5000   # node 1
# Arguments after the third go to train_fsdp.py. NPROC_PER_NODE defaults to the visible GPUs (1 without).
# Ctrl-C on any node: every process saves a checkpoint after the current step and exits 0.
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 MASTER_ADDR NODE_RANK NNODES [train_fsdp.py arguments...]" >&2
  exit 2
fi
MASTER_ADDR="$1"
NODE_RANK="$2"
NNODES="$3"
shift 3
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${CONFIG:-$ROOT/config/train_tiny_fsdp.yaml}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1
fi
# shellcheck source=scripts/_torchrun.sh
source "$ROOT/scripts/_torchrun.sh"
run_torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --max-restarts="${MAX_RESTARTS:-0}" \
  "$ROOT/train_fsdp.py" "$CONFIG" "$@"
