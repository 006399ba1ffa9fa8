#!/usr/bin/env bash
# Train on several nodes: run the same command on every node, changing only NODE_RANK.
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 0 2 --train.max_steps=5000   # node 0
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 1 2 --train.max_steps=5000   # node 1
# Elastic: a node range MIN:MAX as the third argument. The job goes on while at least MIN nodes are up; nodes
# that leave or join restart it at the new size from a checkpoint (docs/running.md, "Elastic runs"). Node
# rank 0 runs on MASTER_ADDR and hosts the rendezvous store: it must stay up.
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 0 2:4 --checkpoint.interval=200
# Arguments after the third go to train_fsdp.py. NPROC_PER_NODE defaults to the visible GPUs (1 without).
# Elastic runs also read RDZV_ID (the same on every node; default: from the config's name and the address),
# MAX_RESTARTS (default 100) and RDZV_CONF (torchrun's --rdzv_conf, e.g. join_timeout=600,last_call_timeout=30).
# Ctrl-C on any node: every process saves a checkpoint after the current step and exits 0.
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 MASTER_ADDR NODE_RANK NNODES [train_fsdp.py arguments...]   (NNODES: a count, or MIN:MAX)" >&2
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
if [[ "$NNODES" != *:* ]]; then
  run_torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --max-restarts="${MAX_RESTARTS:-0}" \
    "$ROOT/train_fsdp.py" "$CONFIG" "$@"
  exit
fi

if ! [[ "$NNODES" =~ ^[1-9][0-9]*:[1-9][0-9]*$ ]] || (( ${NNODES%:*} > ${NNODES#*:} )); then
  echo "error: NNODES=$NNODES is not a node range MIN:MAX with 1 <= MIN <= MAX" >&2
  exit 2
fi
# The same id on every node, whatever folder each node's checkout lives in.
RDZV_ID="${RDZV_ID:-fsdp-$(printf '%s %s:%s' "$(basename "$CONFIG")" "$MASTER_ADDR" "$MASTER_PORT" | cksum | cut -d' ' -f1)}"
# Node rank 0 hosts the c10d store that the rendezvous lives in (said explicitly: on one host, as in a test,
# the agents could not tell by their address which of them should).
IS_HOST=false
[[ "$NODE_RANK" == 0 ]] && IS_HOST=true
echo "elastic: $NNODES nodes of $NPROC_PER_NODE processes, rendezvous $RDZV_ID at $MASTER_ADDR:$MASTER_PORT, hosted" \
  "by node rank 0, which must stay up (any other node may leave or join); this is node rank $NODE_RANK" >&2
# FSDP_ELASTIC: the workers take torchrun's SIGTERM for a restart (fsdp_utils/train/preemption.py).
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the shared store, a node that joins a running job waits forever
# for the new round's MASTER_ADDR, which the agent of rank 0 publishes only at its first rendezvous.
export FSDP_ELASTIC=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
run_torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --rdzv_backend=c10d \
  --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$RDZV_ID" \
  --rdzv_conf="is_host=$IS_HOST${RDZV_CONF:+,$RDZV_CONF}" --max-restarts="${MAX_RESTARTS:-100}" \
  "$ROOT/train_fsdp.py" "$CONFIG" "$@"
