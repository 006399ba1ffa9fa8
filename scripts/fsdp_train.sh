#!/usr/bin/env bash
# Train on one node: one process per GPU (all visible GPUs, or NGPU; 1 process without GPUs).
#   CONFIG=config/train300M_fsdp.yaml NGPU=4 scripts/fsdp_train.sh --train.max_steps=1000
# Ctrl-C: every process saves a checkpoint after the current step and the script exits 0 (twice: abort).
# A user error (config, checkpoint, ...) ends with its `error:` line and the training processes' exit status.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${CONFIG:-$ROOT/config/train_tiny_fsdp.yaml}"
# shellcheck source=scripts/_torchrun.sh
source "$ROOT/scripts/_torchrun.sh"
usage_on_help "${BASH_SOURCE[0]}" "$@"
if [[ -z "${NGPU:-}" ]]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$NGPU" -gt 0 ]] || NGPU=1
fi
MAX_RESTARTS="${MAX_RESTARTS:-0}"
check_whole NGPU 1 "$MAX_PROCS_PER_NODE"
check_whole MAX_RESTARTS 0
run_torchrun -- --standalone --nproc_per_node="$NGPU" --max-restarts="$MAX_RESTARTS" \
  "$ROOT/train_fsdp.py" "$CONFIG" "$@"
