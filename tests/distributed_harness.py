"""Several gloo ranks inside a test: `run_ranks(fn, world_size=2, **kwargs)` spawns one process per rank,
starts the process group (a FileStore in a temporary folder: no port to pick), runs
`fn(rank, world_size, **kwargs)` in each and returns every rank's return value, in rank order. A rank's
exception is raised in the test as RankFailed with that rank's traceback.

`fn`, its arguments and its return value cross process boundaries: `fn` must be a module-level function
and everything passed or returned picklable. The ranks are forked from the test launcher's fork server
(tests/launcher.py), which has torch and the project imported already; FSDP_TEST_LAUNCH=process spawns
fresh interpreters instead."""
from __future__ import annotations

import multiprocessing
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests import launcher


class RankFailed(AssertionError):
    """A rank raised, crashed or did not finish in time."""


def cpu_env(rank: int, world_size: int):
    """The DistEnv of a rank that run_ranks started (one host, CPU)."""
    import torch

    from fsdp_utils.distributed import DistEnv

    return DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
                   device=torch.device("cpu"))


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, store_file: str, kwargs: dict,
               results: multiprocessing.Queue) -> None:
    launcher.frozen_heap()
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
        # gloo's init can return on one rank while another is still connecting to it: a rank whose fn returns at
        # once would then close its side under the other ("Connection closed by peer"). Past the barrier, every
        # rank's connections are complete.
        dist.barrier()
        try:
            value = fn(rank, world_size, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # everything reaches the test, with the rank's own traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *, timeout_s: float = 120, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` spawned gloo ranks; their return values by rank.
    RankFailed (with the traceback) if any rank raised, died or outlasted `timeout_s`."""
    context = launcher.context() if launcher.enabled() else multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        store_file = str(Path(tmp) / "store")
        procs = [context.Process(target=_rank_main, args=(fn, rank, world_size, store_file, kwargs, results),
                                 daemon=True)
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        try:
            outcomes = _collect(results, procs, timeout_s)
        finally:
            for proc in procs:  # ours, started just above: a rank stuck in a collective is stopped here
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)
    failed = [(rank, text) for rank, (ok, text) in sorted(outcomes.items()) if not ok]
    if failed:
        rank, text = failed[0]
        raise RankFailed(f"rank {rank} of {world_size} raised:\n{text}")
    return [outcomes[rank][1] for rank in range(world_size)]


def _collect(results: multiprocessing.Queue, procs: list, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    """Every rank's (ok, value or traceback). A rank that raised is reported at once: the others may be
    waiting for it in a collective."""
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcomes) < len(procs):
        try:
            rank, ok, value = results.get(timeout=0.5)
            outcomes[rank] = (ok, value)
            if not ok:
                return outcomes
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
            if dead:
                time.sleep(0.5)  # a result put just before exiting may still be in the pipe
                while not results.empty():
                    rank, ok, value = results.get()
                    outcomes[rank] = (ok, value)
                if any(r not in outcomes for r in dead):
                    r = next(r for r in dead if r not in outcomes)
                    raise RankFailed(f"rank {r} exited with code {procs[r].exitcode} without a result") from None
            if time.monotonic() > deadline:
                missing = [r for r in range(len(procs)) if r not in outcomes]
                raise RankFailed(f"ranks {missing} did not finish within {timeout_s:.0f} s") from None
    return outcomes
