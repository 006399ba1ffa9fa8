"""torchrun as the shell launchers run it (scripts/_torchrun.sh, scripts/slurm_submit.sh):

    python3 scripts/_torchrun.py [--store=serve|join|apart] -- TORCHRUN_ARGUMENTS...

A worker's user error (its `error:` line, exit 1 or 2) ends the command with that status, without torchrun's report.
--store (elastic runs): before joining the rendezvous the node agrees with the job on the run id (`serve`: node rank
0 hosts the c10d store and publishes it; `join`: reads it there; `apart`: scripts/rendezvous_store.py's, the id given)
and on its resolved config; a node that differs gets one `error:` line and exit status 2 (docs/running.md)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import socket
import sys
import time
from datetime import timedelta

from config.numbers import integer_in
from scripts.rendezvous_store import StoreAddressError, serve_store

RUN_ID_KEY = "fsdp-lm/run_id"
USER_ERROR_CODES = (1, 2)  # train_fsdp.py's exit status after its `error:` line
JOIN_TIMEOUT_S = 600.0  # torchrun's default join_timeout
# The --rdzv_conf settings that torchrun reads as whole numbers (seconds, or attempts).
RDZV_NUMBERS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "read_timeout",
                "keep_alive_interval", "keep_alive_max_attempt")


class Refused(Exception):
    """This node does not join the job: the message is one line saying why."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """This script's options (before `--`) and torchrun's, parsed by torchrun's own parser."""
    from torch.distributed.run import parse_args as torchrun_args

    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", choices=["serve", "join", "apart"], default=None,
                        help="an elastic run's rendezvous store: hosted here (node rank 0), by node rank 0, or apart")
    return parser.parse_args(argv[:split]), torchrun_args(argv[split + 1:])


def rdzv_numbers(rdzv_conf: str) -> dict[str, int]:
    """The whole-number settings of --rdzv_conf (key=value,...); Refused naming one that is not a whole number in
    the digits 0-9 (torchrun's int() would read other scripts' digits, or end in a traceback)."""
    numbers = {}
    for item in rdzv_conf.split(","):
        key, _, value = (part.strip() for part in item.partition("="))
        if key in RDZV_NUMBERS:
            if (number := integer_in(value, 0)) is None:
                raise Refused(f"--rdzv_conf (RDZV_CONF): {key}={value} is not a whole number of at least 0")
            numbers[key] = number
    return numbers


def join_timeout_s(rdzv_conf: str) -> float:
    """torchrun's join_timeout from --rdzv_conf (key=value,...), or its default; Refused if it is not a number."""
    return float(rdzv_numbers(rdzv_conf).get("join_timeout", JOIN_TIMEOUT_S))


def connect_store(host: str, port: int, *, timeout_s: float):
    """A client of the store at host:port, once it answers (within timeout_s). The port is probed first: a
    TCPStore client that finds no server logs each failed attempt with a C++ stack."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=10).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise Refused(f"no rendezvous store answers at {host}:{port} after {timeout_s:.0f} s (join_timeout): "
                              "start node rank 0 first, or check the address") from None
            time.sleep(1)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))


def agreed_run_id(store, given: str | None, *, role: str, endpoint: str) -> str:
    """The job's run id: published here (serve), read from node rank 0's store (join), or the one given (apart)."""
    if role == "serve":
        store.set(RUN_ID_KEY, given or secrets.token_hex(16))
    if role == "apart":
        assert given, "the launcher asks for RDZV_ID with a store run apart"
        return given
    deadline = time.monotonic() + 60  # node rank 0 publishes it as soon as its store serves
    while not store.check([RUN_ID_KEY]):  # polled: a timed-out store.wait logs C++ warnings
        if time.monotonic() > deadline:
            raise Refused(f"the rendezvous store at {endpoint} holds no run id: is node rank 0 there started by "
                          "scripts/fsdp_multi_node.sh?")
        time.sleep(0.5)
    published = store.get(RUN_ID_KEY).decode()
    if given and given != published:
        raise Refused(f"RDZV_ID={given} is not the run id of the job at {endpoint} (node rank 0 runs it as "
                      f"{published}): give every node the same RDZV_ID, or none")
    return published


def _flat(values: dict, prefix: str = "") -> dict:
    flat: dict = {}
    for key, value in values.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def differences(job: dict, here: dict, *, limit: int = 3) -> str:
    """The fields whose values differ, `field=here's value, job's value in the job`, the first `limit` named."""
    a, b = _flat(job), _flat(here)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    named = ", ".join(f"{k}={json.dumps(b.get(k))} here, {json.dumps(a.get(k))} in the job" for k in keys[:limit])
    return named + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_config(store, run_id: str, script_args: list[str], *, endpoint: str) -> None:
    """Record this node's resolved config under the run id if it is the first, else compare it with the record:
    Refused when they differ. The record holds what config.yaml holds (URL credentials stripped)."""
    from config import ConfigError, load_config
    from train_fsdp import parse_args as train_args  # the entry point's own command line

    args, overrides = train_args(script_args)
    try:
        here = json.loads(json.dumps(load_config(args.config, overrides).to_dict(), sort_keys=True))
    except ConfigError as err:  # the launcher's --check has reported it already
        raise Refused("; ".join(err.problems)) from None
    mine = json.dumps(here, sort_keys=True)
    recorded = store.compare_set(f"fsdp-lm/{run_id}/config", "", mine).decode()  # set if absent, atomically
    if recorded != mine:
        raise Refused(f"this node's config differs from the job's (run {run_id} at {endpoint}): "
                      f"{differences(json.loads(recorded), here)}; it does not join")


def agree_on_run(args: argparse.Namespace, role: str):
    """Agree with the job on its run id and config (see the module's docstring); set args.rdzv_id. Returns the
    store, which a serving node must keep referenced: the store lives as long as the object."""
    endpoint = args.rdzv_endpoint
    host, _, port_text = endpoint.rpartition(":")
    host = host.strip("[]")  # an IPv6 address in brackets
    if (port := integer_in(port_text, 1, 65535)) is None:
        raise Refused(f"--rdzv_endpoint={endpoint} is not HOST:PORT, a port from 1 to 65535")
    if role == "serve":
        store = serve_store(host, port, name="MASTER_ADDR")
    else:
        store = connect_store(host, port, timeout_s=join_timeout_s(args.rdzv_conf))
    given = None if args.rdzv_id == "none" else args.rdzv_id  # torchrun's default when --rdzv_id is not given
    args.rdzv_id = agreed_run_id(store, given, role=role, endpoint=endpoint)
    check_config(store, args.rdzv_id, args.training_script_args, endpoint=endpoint)
    print(f"elastic: run id {args.rdzv_id}; this node's config is the job's", file=sys.stderr, flush=True)
    return store


class _RoutineRecords(logging.Filter):
    """torchrun's lines about a worker group it ends: SIGTERM to the workers still running (routine: torchrun
    stops the whole group whenever one worker ends), and the exit status of a worker that ended on a user error
    (it said why in its `error:` line). Any other failure keeps its line, and torchrun's report follows it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Sending process %s closing signal %s":
            return False
        return not (record.msg == "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
                    and isinstance(record.args, tuple) and record.args[0] in USER_ERROR_CODES)


def failure_status(err) -> int:
    """The exit status for torchrun's ChildFailedError `err`: the first failed worker's. Its report is printed
    unless that worker ended on a user error and none left a traceback in torchrun's error file."""
    _, first = err.get_first_failure()
    tracebacks = any(os.path.isfile(f.error_file) for f in err.failures.values())
    if first.exitcode in USER_ERROR_CODES and not tracebacks:
        return first.exitcode
    print(err, file=sys.stderr, flush=True)
    return first.exitcode if first.exitcode > 0 else 128 - first.exitcode  # a signal's, as a shell says it


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    own, args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rdzv_numbers(args.rdzv_conf)  # torchrun's own reading of them would end in a traceback
        store = agree_on_run(args, own.store) if own.store else None  # noqa: F841 (kept alive while torchrun runs)
    except (Refused, StoreAddressError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_RoutineRecords())
    try:
        run(args)
    except ChildFailedError as err:
        return failure_status(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
