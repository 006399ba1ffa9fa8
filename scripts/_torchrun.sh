#!/usr/bin/env bash
# Sourced by the launchers. run_torchrun ARGS... runs `torchrun ARGS...` and passes a Ctrl-C (SIGINT),
# SIGTERM or SIGHUP on to the training processes only, then returns torchrun's exit status.
#
# Each training process then saves a checkpoint after the current step and exits 0, and torchrun ends
# normally. Had torchrun itself received the signal (a terminal sends Ctrl-C to the whole foreground
# process group), it would pass it on too, but kill the workers once its --shutdown-timeout expires,
# mid-save for a large model, and end with its own SignalException traceback. A second Ctrl-C aborts at once.

run_torchrun() {
  set -m  # torchrun in a process group of its own: a Ctrl-C at the terminal reaches this script only
  torchrun "$@" &
  TORCHRUN_PID=$!
  set +m
  trap 'forward_signal INT' INT
  trap 'forward_signal TERM' TERM HUP
  local status
  while true; do
    # `wait` also returns when a trapped signal arrives: wait again until torchrun has really ended.
    wait "$TORCHRUN_PID" && status=0 || status=$?
    if ! kill -0 "$TORCHRUN_PID" 2>/dev/null; then
      return "$status"
    fi
  done
}

forward_signal() {
  local sig="$1"
  # In an elastic job (FSDP_ELASTIC=1) the training processes take a SIGTERM for torchrun's own, sent to
  # restart them at a new world size; the user's stop reaches them as SIGINT and ends the job.
  [[ "${FSDP_ELASTIC:-}" == 1 ]] && sig=INT
  echo "SIG$1: the training processes save a checkpoint after this step and stop (again: abort without saving)" >&2
  pkill "-$sig" -P "$TORCHRUN_PID" || true  # torchrun's children are the training processes
}
