#!/usr/bin/env bash
# Train on several nodes: run the same command on every node, changing only NODE_RANK.
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 0 2 --train.max_steps=5000   # node 0
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 1 2 --train.max_steps=5000   # node 1
# Elastic: a node range MIN:MAX as the third argument. The job goes on while at least MIN nodes are up; nodes
# that leave or join restart it at the new size from a checkpoint (docs/running.md, "Elastic runs"). Node
# rank 0 runs on MASTER_ADDR and hosts the rendezvous store: it must stay up, unless RDZV_STORE=HOST:PORT names a
# store run apart (scripts/rendezvous_store.py on a machine that outlives the job): then any node may die.
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 0 2:4 --checkpoint.interval=200
#   RDZV_STORE=storehost:29400 CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 0 2:4
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
  if [[ -n "${RDZV_STORE:-}" ]]; then
    echo "error: RDZV_STORE=$RDZV_STORE is for elastic runs (NNODES as a range MIN:MAX); a static run of" \
      "NNODES=$NNODES meets at MASTER_ADDR:MASTER_PORT" >&2
    exit 2
  fi
  run_torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --max-restarts="${MAX_RESTARTS:-0}" \
    "$ROOT/train_fsdp.py" "$CONFIG" "$@"
  exit
fi

if ! [[ "$NNODES" =~ ^[1-9][0-9]*:[1-9][0-9]*$ ]] || (( ${NNODES%:*} > ${NNODES#*:} )); then
  echo "error: NNODES=$NNODES is not a node range MIN:MAX with 1 <= MIN <= MAX" >&2
  exit 2
fi
ENDPOINT="$MASTER_ADDR:$MASTER_PORT"
if [[ -n "${RDZV_STORE:-}" ]]; then
  if ! [[ "$RDZV_STORE" =~ ^([^:]+|\[[0-9a-fA-F:.]+\]):([1-9][0-9]*)$ ]] || (( BASH_REMATCH[2] > 65535 )); then
    echo "error: RDZV_STORE=$RDZV_STORE is not HOST:PORT (the address of scripts/rendezvous_store.py)" >&2
    exit 2
  fi
  ENDPOINT="$RDZV_STORE"
fi
# The same id on every node, whatever folder each node's checkout lives in.
RDZV_ID="${RDZV_ID:-fsdp-$(printf '%s %s' "$(basename "$CONFIG")" "$ENDPOINT" | cksum | cut -d' ' -f1)}"
# Who hosts the c10d store that the rendezvous lives in is said explicitly: on one host, as in a test, the
# agents could not tell by their address which of them should. A store run apart: none of them (each connects).
IS_HOST=false
if [[ -n "${RDZV_STORE:-}" ]]; then
  echo "elastic: $NNODES nodes of $NPROC_PER_NODE processes, rendezvous $RDZV_ID at $ENDPOINT, a store run apart" \
    "from the nodes, which must stay up for the job's life (any node may leave or join); this is node rank $NODE_RANK" >&2
else
  [[ "$NODE_RANK" == 0 ]] && IS_HOST=true
  echo "elastic: $NNODES nodes of $NPROC_PER_NODE processes, rendezvous $RDZV_ID at $ENDPOINT, hosted by node" \
    "rank 0, which must stay up (any other node may leave or join); this is node rank $NODE_RANK" >&2
fi
# torchrun cannot tell a config error from a lost node and would repeat it at every restart: checked once, here.
python3 "$ROOT/train_fsdp.py" "$CONFIG" --check "$@" || exit $?
# FSDP_ELASTIC: the workers take torchrun's SIGTERM for a restart (fsdp_utils/train/preemption.py).
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the shared store, a node that joins a running job waits forever
# for the new round's MASTER_ADDR, which the agent of rank 0 publishes only at its first rendezvous. With it
# set, the workers' own store is started anew each round on the node of that round's rank 0, so it never
# depends on the node that hosts the rendezvous.
export FSDP_ELASTIC=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
run_torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --rdzv_backend=c10d \
  --rdzv_endpoint="$ENDPOINT" --rdzv_id="$RDZV_ID" \
  --rdzv_conf="is_host=$IS_HOST${RDZV_CONF:+,$RDZV_CONF}" --max-restarts="${MAX_RESTARTS:-100}" \
  "$ROOT/train_fsdp.py" "$CONFIG" "$@"
