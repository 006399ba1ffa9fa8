#!/usr/bin/env bash
# Train on several nodes: run the same command on every node, changing only NODE_RANK.
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 0 2 --train.max_steps=5000   # node 0
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 1 2 --train.max_steps=5000   # node 1
# Elastic: a node range MIN:MAX as the third argument. The job goes on while at least MIN nodes are up; nodes
# that leave or join restart it at the new size from a checkpoint (docs/running.md, "Elastic runs"). Node
# rank 0 runs on MASTER_ADDR and hosts the rendezvous store, listening on that address only: it must stay up,
# unless RDZV_STORE=HOST:PORT names a store run apart (scripts/rendezvous_store.py on a machine that outlives the
# job): then any node may die. Either store must sit on a network that only the job's machines reach.
#   CONFIG=config/train1B_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 0 2:4 --checkpoint.interval=200
#   RDZV_STORE=storehost:29400 RDZV_ID=$(openssl rand -hex 16) CONFIG=config/train1B_fsdp.yaml \
#     scripts/fsdp_multi_node.sh 10.0.0.1 0 2:4
# Arguments after the third go to train_fsdp.py. NPROC_PER_NODE defaults to the visible GPUs (1 without).
# Elastic runs also read RDZV_ID (the run id, letters, digits, '.', '_', '-'; default: a random one that node
# rank 0 makes and the others read from its store; the same on every node, required with RDZV_STORE),
# MAX_RESTARTS (default 100) and RDZV_CONF (torchrun's --rdzv_conf, e.g. join_timeout=600,last_call_timeout=30).
# A node whose run id or resolved config differs from the job's is refused before it joins.
# Ctrl-C on any node: every process saves a checkpoint after the current step and exits 0.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/_torchrun.sh
source "$ROOT/scripts/_torchrun.sh"
usage_on_help "${BASH_SOURCE[0]}" "$@"
if [[ $# -lt 3 ]]; then
  echo "usage: $0 MASTER_ADDR NODE_RANK NNODES [train_fsdp.py arguments...]   (NNODES: a count, or MIN:MAX)" >&2
  exit 2
fi
MASTER_ADDR="$1"
NODE_RANK="$2"
NNODES="$3"
shift 3
CONFIG="${CONFIG:-$ROOT/config/train_tiny_fsdp.yaml}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1
fi
check_whole NODE_RANK 0 "$((MAX_NODES - 1))"
check_whole MASTER_PORT 1 65535
check_whole NPROC_PER_NODE 1 "$MAX_PROCS_PER_NODE"
[[ -z "${MAX_RESTARTS:-}" ]] || check_whole MAX_RESTARTS 0
if [[ "$NNODES" != *:* ]]; then
  check_whole NNODES 1 "$MAX_NODES"
  if [[ -n "${RDZV_STORE:-}" ]]; then
    echo "error: RDZV_STORE=$RDZV_STORE is for elastic runs (NNODES as a range MIN:MAX); a static run of" \
      "NNODES=$NNODES meets at MASTER_ADDR:MASTER_PORT" >&2
    exit 2
  fi
  run_torchrun -- --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --max-restarts="${MAX_RESTARTS:-0}" \
    "$ROOT/train_fsdp.py" "$CONFIG" "$@"
  exit
fi

if ! is_whole "${NNODES%%:*}" 1 "$MAX_NODES" || ! is_whole "${NNODES#*:}" "${NNODES%%:*}" "$MAX_NODES"; then
  echo "error: NNODES=$NNODES is not a node range MIN:MAX with 1 <= MIN <= MAX <= $MAX_NODES" >&2
  exit 2
fi
check_run_id
ENDPOINT="$MASTER_ADDR:$MASTER_PORT"
# Who hosts the rendezvous store: node rank 0 (scripts/_torchrun.py serves it, listening on MASTER_ADDR only, and
# publishes the run id there), or a store run apart, which every node joins under the RDZV_ID it was given.
STORE="join"
[[ "$NODE_RANK" == 0 ]] && STORE="serve"
if [[ -n "${RDZV_STORE:-}" ]]; then
  if ! [[ "$RDZV_STORE" =~ ^([^:]+|\[[0-9a-fA-F:.]+\]):([1-9][0-9]{0,4})$ ]] || (( BASH_REMATCH[2] > 65535 )); then
    echo "error: RDZV_STORE=$RDZV_STORE is not HOST:PORT (the address of scripts/rendezvous_store.py)" >&2
    exit 2
  fi
  if [[ -z "${RDZV_ID:-}" ]]; then
    # A store run apart may outlive one job and serve several: no run id published there could be trusted as this one's.
    echo "error: RDZV_STORE needs RDZV_ID, the same unguessable run id on every node of this job, for example" \
      "RDZV_ID=\$(openssl rand -hex 16)" >&2
    exit 2
  fi
  ENDPOINT="$RDZV_STORE"
  STORE="apart"
  echo "elastic: $NNODES nodes of $NPROC_PER_NODE processes, rendezvous $RDZV_ID at $ENDPOINT, a store run apart" \
    "from the nodes, which must stay up for the job's life (any node may leave or join); this is node rank $NODE_RANK" >&2
else
  echo "elastic: $NNODES nodes of $NPROC_PER_NODE processes, rendezvous at $ENDPOINT, hosted by node" \
    "rank 0, which must stay up (any other node may leave or join); this is node rank $NODE_RANK" >&2
fi
RDZV_ARGS=()
[[ -n "${RDZV_ID:-}" ]] && RDZV_ARGS=(--rdzv_id="$RDZV_ID")
# torchrun cannot tell a config error from a lost node and would repeat it at every restart: checked once, here.
python3 "$ROOT/train_fsdp.py" "$CONFIG" --check "$@" || exit $?
# FSDP_ELASTIC: the workers take torchrun's SIGTERM for a restart (fsdp_utils/guards/preemption.py).
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the shared store, a node that joins a running job waits forever
# for the new round's MASTER_ADDR, which the agent of rank 0 publishes only at its first rendezvous. With it
# set, the workers' own store is started anew each round on the node of that round's rank 0, so it never
# depends on the node that hosts the rendezvous.
export FSDP_ELASTIC=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
run_torchrun --store="$STORE" -- --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --rdzv_backend=c10d \
  --rdzv_endpoint="$ENDPOINT" "${RDZV_ARGS[@]}" \
  --rdzv_conf="is_host=false${RDZV_CONF:+,$RDZV_CONF}" --max-restarts="${MAX_RESTARTS:-100}" \
  "$ROOT/train_fsdp.py" "$CONFIG" "$@"
