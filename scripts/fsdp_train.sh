#!/usr/bin/env bash
# Train on one node: one process per GPU (all visible GPUs, or NGPU; 1 process without GPUs).
#   CONFIG=config/train300M_fsdp.yaml NGPU=4 scripts/fsdp_train.sh --train.max_steps=1000
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${CONFIG:-$ROOT/config/train_tiny_fsdp.yaml}"
if [[ -z "${NGPU:-}" ]]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$NGPU" -gt 0 ]] || NGPU=1
fi
# Since torch 2.5 the workers share torchrun's rendezvous TCPStore, and it outlives a --max-restarts restart:
# the restarted workers can read the previous attempt's keys and fail in init_process_group (measured with
# torch 2.13: 4 restarts in 6; pytorch/pytorch#135712). Opting out gives every attempt a fresh store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
exec torchrun --standalone --nproc_per_node="$NGPU" --max-restarts="${MAX_RESTARTS:-0}" \
  "$ROOT/train_fsdp.py" "$CONFIG" "$@"
