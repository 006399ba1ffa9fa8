#!/usr/bin/env bash
# Slurm: one torchrun per node (srun), the head node as rendezvous endpoint.
#   CONFIG=config/train1B_fsdp.yaml GLOBAL_BATCH=512 MICRO_BATCH=4 sbatch scripts/slurm_submit.sh --train.max_steps=20000
#   CONFIG=config/train1B_fsdp.yaml GLOBAL_BATCH=512 MICRO_BATCH=auto sbatch scripts/slurm_submit.sh   # measured at startup
# Five minutes before the time limit Slurm sends SIGUSR1 to this script, which forwards it to every
# training process: they save a complete checkpoint and exit 0. Resubmit the same command to continue
# (checkpoint.auto_resume picks up the newest complete checkpoint).
# Elastic: ELASTIC_MIN_NODES=N keeps the job going on at least N of its nodes when others fail; submit with
# `sbatch --no-kill` so that Slurm keeps the job when a node fails. A Slurm job cannot gain nodes, so it only
# shrinks; the first node hosts the rendezvous and must stay up (docs/running.md, "Elastic runs"). RDZV_STORE is
# not read: this script and its srun run on the first node, which must stay up whoever hosts the store.
# The rendezvous's run id is RDZV_ID, or a random one made here for the job; its store must sit on a network that
# only the job's machines reach. Every value read from the environment is checked before it is used.
#SBATCH --job-name=fsdp-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%j.out
set -euo pipefail

# sbatch runs a copy of this script from its spool folder: the checkout is where the job was submitted.
ROOT="${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
CONFIG="${CONFIG:-$ROOT/config/train1B_fsdp.yaml}"
# shellcheck source=scripts/_torchrun.sh
source "$ROOT/scripts/_torchrun.sh"
usage_on_help "${BASH_SOURCE[0]}" "$@"
if [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then
  echo "error: SLURM_JOB_NODELIST is not set: submit this script with sbatch (scripts/slurm_submit.sh --help)" >&2
  exit 2
fi
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
MICRO_BATCH="${MICRO_BATCH:-2}"
PORT="${MASTER_PORT:-29500}"
[[ -z "${SLURM_NNODES:-}" ]] || check_whole SLURM_NNODES 1 "$MAX_NODES"
check_whole GPUS_PER_NODE 1 "$MAX_PROCS_PER_NODE"
[[ "$MICRO_BATCH" == auto ]] || check_whole MICRO_BATCH 1
[[ -z "${GLOBAL_BATCH:-}" ]] || check_whole GLOBAL_BATCH 1
[[ -z "${MASTER_PORT:-}" ]] || check_whole MASTER_PORT 1 65535
[[ -z "${MAX_RESTARTS:-}" ]] || check_whole MAX_RESTARTS 0
check_run_id
RDZV_ID="${RDZV_ID:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"  # unguessable: another job cannot join by accident
NNODES="${SLURM_NNODES:-1}"
WORLD=$((NNODES * GPUS_PER_NODE))
if [[ -n "${ELASTIC_MIN_NODES:-}" ]] && ! is_whole "$ELASTIC_MIN_NODES" 1 "$NNODES"; then
  echo "error: ELASTIC_MIN_NODES=$ELASTIC_MIN_NODES is not a node count from 1 to the job's $NNODES nodes" >&2
  exit 2
fi
if [[ "$MICRO_BATCH" == auto ]]; then
  # The largest micro-batch that fits is measured by the training job itself (train.micro_batch_size: auto).
  if [[ -z "${GLOBAL_BATCH:-}" ]]; then
    echo "error: MICRO_BATCH=auto needs GLOBAL_BATCH (sequences per optimizer step)" >&2
    exit 2
  fi
  if (( GLOBAL_BATCH % WORLD != 0 )); then
    echo "error: GLOBAL_BATCH=$GLOBAL_BATCH is not a multiple of the GPU count $WORLD" >&2
    exit 2
  fi
  echo "world $WORLD GPUs, global batch $GLOBAL_BATCH, micro-batch auto (measured by the job), $((GLOBAL_BATCH / WORLD)) sequences per GPU and step"
else
  GLOBAL_BATCH="${GLOBAL_BATCH:-$((WORLD * MICRO_BATCH))}"
  if (( GLOBAL_BATCH % (WORLD * MICRO_BATCH) != 0 )); then
    echo "error: GLOBAL_BATCH=$GLOBAL_BATCH is not a multiple of MICRO_BATCH * GPUs = $MICRO_BATCH * $WORLD" >&2
    exit 2
  fi
  echo "world $WORLD GPUs, global batch $GLOBAL_BATCH, micro-batch $MICRO_BATCH, gradient accumulation $((GLOBAL_BATCH / (WORLD * MICRO_BATCH)))"
fi
# sed, not head: head exits after one line, and under pipefail a long node list that scontrol is still
# writing would then end the script with SIGPIPE (status 141).
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)

# Forward Slurm's pre-termination signal to the training processes (not to torchrun, whose default
# action on SIGUSR1 would be to die): torchrun starts them as "python -u .../train_fsdp.py".
forward_signal() {
  echo "pre-termination signal: asking the training processes to checkpoint and stop"
  srun --overlap --ntasks-per-node=1 pkill -USR1 -f -- '-u .*train_fsdp\.py' || true
}
trap forward_signal USR1 TERM

NODES="$NNODES"
SRUN_KILL=(--kill-on-bad-exit=1)
RESTARTS="${MAX_RESTARTS:-1}"
if [[ -n "${ELASTIC_MIN_NODES:-}" ]]; then
  NODES="$ELASTIC_MIN_NODES:$NNODES"
  SRUN_KILL=(--no-kill --kill-on-bad-exit=0)  # a lost node ends its own task, not the job step
  RESTARTS="${MAX_RESTARTS:-100}"  # every node that leaves is a failure to torchrun, and uses one up
  # What fsdp_multi_node.sh sets for an elastic run: the workers take torchrun's SIGTERM for a restart, and the
  # rendezvous store is not shared with the workers (with it, torch's rendezvous hangs when nodes change).
  export FSDP_ELASTIC=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  echo "elastic: $NODES nodes; the rendezvous lives on $HEAD_NODE, which must stay up"
  # torchrun cannot tell a config error from a lost node and would repeat it at every restart: checked once, here.
  python3 "$ROOT/train_fsdp.py" "$CONFIG" --check \
    --train.global_batch_size="$GLOBAL_BATCH" --train.micro_batch_size="$MICRO_BATCH" "$@" || exit $?
fi

# torchrun through scripts/_torchrun.py: a user error ends with its `error:` line, without torchrun's report.
srun "${SRUN_KILL[@]}" python3 "$ROOT/scripts/_torchrun.py" -- \
  --nnodes="$NODES" --nproc_per_node="$GPUS_PER_NODE" \
  --rdzv_id="$RDZV_ID" --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:$PORT" \
  --max-restarts="$RESTARTS" \
  "$ROOT/train_fsdp.py" "$CONFIG" \
  --train.global_batch_size="$GLOBAL_BATCH" --train.micro_batch_size="$MICRO_BATCH" "$@" &
TRAIN_PID=$!
# `wait` returns early when a trapped signal arrives; keep waiting until the job step really ends.
while true; do
  set +e
  wait "$TRAIN_PID"
  status=$?
  set -e
  if ! kill -0 "$TRAIN_PID" 2>/dev/null; then
    exit "$status"
  fi
done
