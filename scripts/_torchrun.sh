#!/usr/bin/env bash
# Sourced by the launchers.
#
# run_torchrun [--store=serve|join|apart] -- TORCHRUN_ARGS... runs torchrun through scripts/_torchrun.py (a worker's
# user error ends the command with its one `error:` line and exit status, without torchrun's report; --store: an
# elastic node agrees with the job on its run id and config before it joins) and passes a Ctrl-C (SIGINT),
# SIGTERM or SIGHUP on to the training processes only, then returns torchrun's exit status.
#
# Each training process then saves a checkpoint after the current step and exits 0, and torchrun ends
# normally. Had torchrun itself received the signal (a terminal sends Ctrl-C to the whole foreground
# process group), it would pass it on too, but kill the workers once its --shutdown-timeout expires,
# mid-save for a large model, and end with its own SignalException traceback. A second Ctrl-C aborts at once.
#
# check_whole NAME MIN [MAX]: the variable NAME holds a whole number from MIN (to MAX), else one `error:` line and
# exit 2. Every value from the environment is checked as text before bash arithmetic sees it: (( )), $(( )) and
# [[ -gt ]] evaluate a variable's text as an expression, running any command substitution in an array subscript.
# is_whole VALUE MIN MAX: the same test as a status, for a check with a message of its own.
# MAX_NODES, MAX_PROCS_PER_NODE: the bounds of node and per-node process counts, so that the product of a node
# count, a process count and a batch size stays far inside bash's 64-bit arithmetic.
# check_run_id: RDZV_ID, when set, is a run id torchrun can take, else one `error:` line and exit 2.
# usage_on_help SCRIPT [ARGS...]: with -h or --help first in ARGS, print SCRIPT's opening comment and exit 0.

run_torchrun() {
  set -m  # torchrun in a process group of its own: a Ctrl-C at the terminal reaches this script only
  python3 "$(dirname "${BASH_SOURCE[0]}")/_torchrun.py" "$@" &
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

# shellcheck disable=SC2034  # read by the launchers that source this file
MAX_NODES=100000 MAX_PROCS_PER_NODE=1024

is_whole() {
  # The text first (at most 9 digits, no leading zero, which bash would read as octal), then the range.
  [[ "$1" =~ ^(0|[1-9][0-9]{0,8})$ ]] && (( $1 >= $2 && $1 <= $3 ))
}

check_whole() {
  local name="$1" min="$2" max="${3:-999999999}" value="${!1:-}"
  if ! is_whole "$value" "$min" "$max"; then
    local range="of at least $min"
    [[ -n "${3:-}" ]] && range="from $min to $max"
    echo "error: $name=$value is not a whole number $range" >&2
    exit 2
  fi
}

check_run_id() {
  if [[ -n "${RDZV_ID:-}" ]] && ! [[ "$RDZV_ID" =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$ ]]; then
    echo "error: RDZV_ID=$RDZV_ID is not a run id (up to 128 letters, digits, '.', '_' and '-')" >&2
    exit 2
  fi
}

usage_on_help() {
  [[ "${2:-}" == -h || "${2:-}" == --help ]] || return 0
  awk 'NR == 1 { next } /^#( |$)/ { sub(/^# ?/, ""); print; next } { exit }' "$1"
  exit 0
}

# Run rather than sourced: say what it is.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  usage_on_help "$0" --help
fi
