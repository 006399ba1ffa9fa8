#!/usr/bin/env bash
# Train on one node: one process per GPU (all visible GPUs, or NGPU; 1 process without GPUs).
#   CONFIG=config/train300M_fsdp.yaml NGPU=4 scripts/fsdp_train.sh --train.max_steps=1000
# Ctrl-C: every process saves a checkpoint after the current step and the script exits 0 (twice: abort).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${CONFIG:-$ROOT/config/train_tiny_fsdp.yaml}"
if [[ -z "${NGPU:-}" ]]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$NGPU" -gt 0 ]] || NGPU=1
fi
# shellcheck source=scripts/_torchrun.sh
source "$ROOT/scripts/_torchrun.sh"
run_torchrun --standalone --nproc_per_node="$NGPU" --max-restarts="${MAX_RESTARTS:-0}" \
  "$ROOT/train_fsdp.py" "$CONFIG" "$@"
