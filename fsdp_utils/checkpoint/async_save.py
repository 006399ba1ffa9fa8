"""Asynchronous sharded saves (checkpoint.async_save): stage the state in host memory (staging.py), start the
background write (`BackgroundWriter`), commit it once every rank's write is done, and write the same step again
synchronously from its staged copy when a background write fails.

The commit's collectives run on the default group in step with the loop's, but each rank's write ends at its own
moment: `poll`, called by every rank at the same point of every step, all-reduces "my write is done" (MIN), and every
rank commits at the first step where it is done everywhere (`start` and `finish`, called at the same step on every
rank, wait for their own write first). At most one save is in flight."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import logging
import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..distributed import agree, barrier
from ..host_memory import HostMemory, format_size, host_memory
from .base import write_cause
from .checksums import hash_own_files
from .contents import Contents, Snapshot, quiet_state_dict_warnings
from .errors import CheckpointError, first_line
from .retention import remove
from .sharded import ShardedCheckpoint
from .staging import HostStaging, StageStats, arena_bytes, live_storages

log = logging.getLogger(__name__)


class AsyncSaveFailed(CheckpointError):
    """An asynchronous save could not stage or start its write: the same step is saved synchronously."""


@dataclasses.dataclass
class _InFlight:
    """An asynchronous save whose background write has started and that is not committed yet."""

    tmp: Path
    final: Path
    snapshot: Snapshot  # taken when the save started: the loop goes on changing its state
    start: float
    job: concurrent.futures.Future  # (this rank's checksum records, seconds) once the write is done
    staged: StageStats
    staged_state: dict  # the host copy being written: a failed write is redone from it, synchronously
    blocked: float = 0.0  # seconds the training loop spent in this save so far (staging, polls, waits, commit)


# ---- the background writer -----------------------------------------------------------------------
# DCP's `async_save` of a state dict already staged in host memory, in a thread of the training process or a
# process of its own (checkpoint.async_writer), followed by this rank's checksums.

_ASYNC_PARAMS = inspect.signature(dcp.async_save).parameters if hasattr(dcp, "async_save") else {}
try:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
except ImportError:  # before torch 2.7: thread writer only
    AsyncCheckpointerType = None  # type: ignore[assignment,misc]  # a stand-in on torch releases without it
try:
    from torch.distributed.checkpoint.staging import AsyncStager
except ImportError:
    AsyncStager = object  # type: ignore[assignment,misc]  # a stand-in on torch releases without it
HAS_ASYNC_SAVE = bool(_ASYNC_PARAMS)
HAS_PROCESS_WRITER = (AsyncCheckpointerType is not None and "async_checkpointer_type" in _ASYNC_PARAMS
                      and hasattr(AsyncCheckpointerType, "PROCESS"))
_HAS_STAGER_PARAM = "async_stager" in _ASYNC_PARAMS


def resolve_async_save(setting: bool | str, *, fmt: str, device: torch.device) -> bool:
    """checkpoint.async_save as a decision: auto is on for sharded checkpoints on GPUs."""
    if fmt != "sharded" or not HAS_ASYNC_SAVE:
        return False
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


class _AlreadyStaged(AsyncStager):
    """Hands DCP the state dict as it is: HostStaging has made it safe to write while training goes on
    (DCP's default stager would copy it once more)."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class BackgroundWriter:
    """Starts DCP's asynchronous save of a staged state dict, then runs `after_write` (this rank's
    checksums) in a thread of its own; the job's future holds its result.

    DCP's save is a collective (plans gathered to rank 0, metadata written by rank 0 last). Run in the
    background, it uses a gloo group of its own: the training loop's collectives on the default group
    (NCCL, or gloo on the CPU) then never interleave with the writer's, whichever thread issues them."""

    def __init__(self, *, writer: str, timeout_s: float):
        if writer == "process" and not HAS_PROCESS_WRITER:
            log.warning("checkpoint.async_writer=process: this torch has no process writer; using a thread")
            writer = "thread"
        self.writer = writer
        if writer == "process":
            # The writer processes meet through the job's store (MASTER_ADDR:MASTER_PORT, see
            # fsdp_utils/distributed.py) under a prefix. Otherwise rank 0 picks a free port and its writer
            # process binds it seconds later, when another process on the host may have taken it: the
            # writer then never starts and the save waits for it.
            os.environ.setdefault("DCP_USE_PREFIX_STORE", "1")
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # every rank
        self._jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")

    def start(self, staged: dict, tmp: Path, *, after_write: Callable[[], Any]) -> Future:
        kwargs: dict[str, Any] = {"checkpoint_id": str(tmp), "process_group": self.group}
        if _HAS_STAGER_PARAM:
            kwargs["async_stager"] = _AlreadyStaged()
        if AsyncCheckpointerType is not None and "async_checkpointer_type" in _ASYNC_PARAMS:
            kwargs["async_checkpointer_type"] = (AsyncCheckpointerType.PROCESS if self.writer == "process"
                                                 else AsyncCheckpointerType.THREAD)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*experimental.*")
            response = dcp.async_save(staged, **kwargs)
        write = getattr(response, "upload_completion", response)  # an AsyncSaveResponse where staging is async

        def job():
            write.result()  # raises what the write raised (dcp.CheckpointException names the ranks)
            return after_write()

        return self._jobs.submit(job)

    def close(self) -> None:
        self._jobs.shutdown(wait=False)


class AsyncSaver:
    """Asynchronous saves of one run (sharded format only). `enabled` turns off for good when this run's
    state cannot be staged; `failed` records that an asynchronous save of this run has failed."""

    def __init__(self, sharded: ShardedCheckpoint, *, enabled: bool, writer: str, on_error: str, timeout_s: float):
        self.sharded = sharded
        self.context, self.env = sharded.context, sharded.env
        self.enabled = enabled
        self.writer_kind = writer
        self.on_error = on_error
        self.timeout_s = timeout_s
        self.failed = False
        self._writer: BackgroundWriter | None = None
        self._staging: HostStaging | None = None
        self._in_flight: _InFlight | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    # ---- the start of the run ------------------------------------------------------------------
    def prepare(self, contents: Contents) -> None:
        """Collective, once before the first save: start the writer, check that the node's host memory (and
        /dev/shm for the process writer) holds what sharded saves stage there, reserve the staging arena and
        stage this very state dict once (a state the staging cannot copy turns asynchronous saves off, with
        a warning: synchronous saves still work)."""
        if self.enabled:
            self._writer = BackgroundWriter(writer=self.writer_kind, timeout_s=self.timeout_s)
            self._staging = HostStaging(pin=self.env.device.type == "cuda", share=self._writer.writer == "process")
        model, optimizer = contents.model, contents.optimizer
        offload = contents.fsdp.offloads_sharded_state_dict()
        if self.context.fmt != "sharded" or not (self.enabled or offload):
            return
        share = self._staging is not None and self._staging.share
        advice = "set checkpoint.async_save=false" if self.enabled else "use fsdp.version=2 (its saves copy nothing)"
        # FSDP1 on GPUs with the process writer: FSDP1's offloaded pieces and their copy in the shared arena.
        copies = 2 if share and offload else 1
        where = check_host_memory(copies * arena_bytes(model, optimizer), self.env, advice=advice,
                                  shm_per_rank=arena_bytes(model, optimizer) if share else 0,
                                  what="its share of the weights and optimizer state"
                                  + (", twice" if copies == 2 else ""))
        how = f"written in the background ({self._writer.writer} writer)" if self._writer else "written synchronously"
        if self.env.is_main:
            log.info("sharded checkpoints %s, staged in host memory: %s", how, where)
        # The arena holds copies of whatever may be live training state. FSDP1 on GPUs makes its pieces
        # on the host for each save (offloads_sharded_state_dict), so there only the process writer needs it.
        if self.enabled:
            self._try_staging(contents, reserve=arena_bytes(model, optimizer) if share or not offload else None)

    def _reserve(self, staging: HostStaging, nbytes: int) -> AsyncSaveFailed | None:
        """Allocate the staging arena; the failure of a host that cannot give it (/dev/shm full, a file size
        limit on its shared segment) as an AsyncSaveFailed."""
        try:
            seconds = staging.reserve(nbytes)
        except (RuntimeError, OSError) as err:
            return AsyncSaveFailed(first_line(err))
        if self.env.is_main:
            log.info("checkpoint staging: reserved %s of %shost memory per rank in %.1f s, reused by every save",
                     format_size(staging.nbytes), "pinned " if staging.pin else "shared " if staging.share else "",
                     seconds)
        return None

    def _try_staging(self, contents: Contents, *, reserve: int | None) -> None:
        """Reserve the arena (`reserve` bytes, None: none) and stage this run's state dict once, as a save will (before
        the first optimizer step with a stand-in for the optimizer's state: contents.OptimizerPart.take), so that a
        tensor kind the staging cannot copy shows now. Any failure turns asynchronous saves off, on every rank."""
        staging = self._staging
        assert staging is not None, "prepare() makes the staging of asynchronous saves"
        error = self._reserve(staging, reserve) if reserve is not None else None
        tensors = self.sharded.tensors(contents, trial=True)
        try:
            if error is None:  # the state dict above is a collective: every rank takes it either way
                staging.stage(tensors, live=live_storages(contents.model, contents.optimizer))
        except Exception as err:
            error = AsyncSaveFailed(first_line(err))
        del tensors
        try:
            agree(self.env, error)
        except AsyncSaveFailed as err:
            self.enabled, self.failed = False, True
            if self.env.is_main:
                log.warning("checkpoint.async_save: this run's state cannot be staged in host memory (%s); every save "
                            "of this run is synchronous", err)
            staging.close()
            return
        if self.env.is_main:
            log.info("checkpoint staging tried on this run's state: %.2f s for %s", staging.last.seconds,
                     format_size(staging.last.copied))

    # ---- saving --------------------------------------------------------------------------------
    def start(self, contents: Contents) -> Path:
        """Collective: stage the checkpoint of contents.state.step in host memory and start its background write;
        AsyncSaveFailed (every rank) if it cannot be staged or started."""
        staging, writer = self._staging, self._writer
        assert staging is not None and writer is not None, "prepare() makes them when asynchronous saves are on"
        self.settle()  # the previous save, before this one starts (at most one in flight)
        start = time.perf_counter()
        snapshot = contents.snapshot(self.env)
        self.context.begin_save()
        final = self.sharded.path_of(snapshot.step)
        tmp = self.sharded.make_tmp(final)
        error, staged = None, {}
        with quiet_state_dict_warnings():
            tensors = self.sharded.tensors(contents)
            self.context.check_space(final, tensors)
            try:
                staged = staging.stage(tensors, live=live_storages(contents.model, contents.optimizer))
            except Exception as err:  # host memory could not be had, a tensor this staging cannot copy, ...
                error = AsyncSaveFailed(f"{final}: cannot stage the checkpoint in host memory ({first_line(err)})")
        del tensors
        if error is not None and self.env.is_main:
            remove(self.context.journal, tmp)
        agree(self.env, error)
        stage = staging.last
        try:
            job = writer.start(staged, tmp,
                                     after_write=lambda: hash_own_files(tmp, self.env.rank, self.env.world_size))
        except (Exception, dcp.CheckpointException) as err:
            error = AsyncSaveFailed(f"{final}: cannot start the background write ({first_line(err)})")
        if error is not None and self.env.is_main:
            remove(self.context.journal, tmp)
        agree(self.env, error)
        self._in_flight = _InFlight(tmp, final, snapshot, start, job, stage, staged,
                                    blocked=time.perf_counter() - start)
        if self.env.is_main:
            log.info("checkpoint %s: staged in host memory in %.2f s (%s copied, %s made for it by the state dict), "
                     "writing it in the background", final.name, stage.seconds, format_size(stage.copied),
                     format_size(stage.passed))
        return final

    def poll(self) -> None:
        """Collective, at the same point of every step: commit the save in flight once every rank's
        background write is done; a failed write is reported here, naming the checkpoint."""
        if self._in_flight is None:  # the same on every rank: saves start at the same step everywhere
            return
        begin = time.perf_counter()
        flag = torch.tensor([int(self._in_flight.job.done())], device=self.env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        done = bool(flag.item())
        self._in_flight.blocked += time.perf_counter() - begin
        if done:
            self._complete(last=False)

    def settle(self) -> None:
        """Collective: wait for the save in flight, if any, and commit it."""
        self._wait()
        if self._in_flight is not None:
            self._complete(last=False)

    def finish(self) -> None:
        """Collective, at the end of a run: wait for the save in flight and commit it. A failure is raised
        whatever checkpoint.on_async_error says."""
        if self._in_flight is not None:
            self._wait()
            self._complete(last=True)

    def close(self) -> None:
        """Release the writer and the staging memory. A save still in flight here (an error ended the run)
        is not committed: it stays a `.tmp-` folder, which the next save removes."""
        if self._in_flight is not None and self.env.is_main:
            log.warning("%s was still being written when the run ended: not committed", self._in_flight.final.name)
        if self._writer is not None:
            self._writer.close()
        if self._staging is not None and self._in_flight is None:
            self._staging.close()

    def _wait(self) -> None:
        """Block until this rank's background write is done (logged when it is not done yet)."""
        flight = self._in_flight
        if flight is None:
            return
        begin = time.perf_counter()
        if not flight.job.done():
            if self.env.is_main:
                log.info("waiting for the save of %s, still being written (started %.1f s ago): one save at a time",
                         flight.final.name, begin - flight.start)
            concurrent.futures.wait([flight.job])
            if self.env.is_main:
                log.info("waited %.2f s for the save of %s", time.perf_counter() - begin, flight.final.name)
        flight.blocked += time.perf_counter() - begin

    def _complete(self, *, last: bool) -> None:
        """Collective, once every rank's write is done: commit the save in flight, or report its failure
        (then stop, or go on per checkpoint.on_async_error unless `last`)."""
        flight, self._in_flight = self._in_flight, None
        assert flight is not None, "called with a save in flight"
        begin = time.perf_counter()
        hashed, error = None, None
        try:
            hashed = flight.job.result()
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
            error = CheckpointError(f"{flight.final}: the background write failed ({write_cause(err)}); the previous "
                                    f"checkpoints are as they were")
        try:
            agree(self.env, error)
        except CheckpointError as err:
            self._recover(flight, str(err), last=last)
            return
        self.sharded.commit(flight.final, flight.snapshot, start=flight.start, hashed=hashed, mode=None)
        now = time.perf_counter()
        flight.blocked += now - begin
        row = {"name": flight.final.name, "mode": "async", "blocked_s": flight.blocked, "total_s": now - flight.start,
               "staging_s": flight.staged.seconds, "alloc_s": flight.staged.alloc_seconds,
               "copied_bytes": flight.staged.copied, "passed_bytes": flight.staged.passed}
        self.context.stats.append(row)
        if self.env.is_main:
            log.info("checkpoint %s: written in the background in %.1f s; it held up training for %.2f s in all "
                     "(staging %.2f s, commit %.2f s)", flight.final.name, row["total_s"], flight.blocked,
                     flight.staged.seconds, now - begin)

    def _recover(self, flight: _InFlight, error: str, *, last: bool) -> None:
        """Collective, after a failed background write: write the same step again synchronously from its
        staged copy; if that fails too, stop (CheckpointError) or go on per checkpoint.on_async_error."""
        barrier(self.env)  # every rank is done with the folder before it is removed
        if self.env.is_main:
            remove(self.context.journal, flight.tmp)
        self.failed = True
        if self.env.is_main:
            log.warning("%s; writing it again synchronously from its copy in host memory", error)
        writer = self._writer
        assert writer is not None, "a save was in flight: prepare() made the writer"
        try:
            start = time.perf_counter()
            self.sharded.write(flight.staged_state, flight.final, process_group=writer.group)
            self.sharded.commit(flight.final, flight.snapshot, start=start, mode="sync-retry")
            return
        except CheckpointError as err:
            error = f"{error}; the synchronous retry failed too ({err})"
        if self.on_error == "continue" and not last:
            if self.env.is_main:
                log.error("%s; training goes on (checkpoint.on_async_error=continue), the next save tries again", error)
            return
        if not last:
            error += "; stopping (checkpoint.on_async_error=stop). Resume with --resume_from latest"
        raise CheckpointError(error)


def check_host_memory(per_rank: int, env, *, what: str, advice: str = "set checkpoint.async_save=false",
                      shm_per_rank: int = 0) -> str:
    """Every rank: the host memory the ranks of each node will hold for a save (`per_rank` bytes each)
    against what that node can give, and the free space of /dev/shm against `shm_per_rank` (the process
    writer's arena). A CheckpointError (on every rank) where it cannot: at the start of the run, not an
    out-of-memory kill (or a SIGBUS in /dev/shm) at the first save. Returns the line to log."""
    here = socket.gethostname()
    try:
        mem = host_memory()
    except (OSError, KeyError, ValueError) as err:  # no /proc/meminfo (not Linux): nothing to compare with
        mem = None
        log.warning("cannot read this host's memory (%s): the checkpoint staging is not checked", err)
    shm_free = None
    if shm_per_rank and os.path.isdir("/dev/shm"):
        shm_free = shutil.disk_usage("/dev/shm").free
    # One row per rank: (host name, bytes per rank, its host's memory or None, free /dev/shm bytes or None).
    rows: list[tuple[str, int, HostMemory | None, int | None]] = [("", 0, None, None)] * env.world_size
    dist.all_gather_object(rows, (here, per_rank, mem, shm_free))
    needed: dict[str, int] = {}
    for host, nbytes, _, _ in rows:
        needed[host] = needed.get(host, 0) + nbytes
    problem = None
    for host, nbytes, host_mem, free_shm in rows:
        ranks = sum(1 for h, *_ in rows if h == host)
        if problem is None and free_shm is not None and ranks * shm_per_rank > free_shm:
            problem = (f"checkpoint.async_writer=process hands the staged state to its writer through /dev/shm: "
                       f"{ranks * shm_per_rank / 2**30:,.1f} GiB needed on {host} ({ranks} rank(s)), "
                       f"{free_shm / 2**30:,.1f} GiB free there; use checkpoint.async_writer=thread, or make /dev/shm "
                       f"larger (mount -o remount,size=... /dev/shm)")
        if host_mem is None or problem is not None:
            continue
        if needed[host] > host_mem.available:
            text = (f"checkpoint staging needs {needed[host] / 2**30:,.1f} GiB of host memory on {host} ({ranks} "
                    f"rank(s) x {nbytes / 2**30:,.1f} GiB: {what}) but only {host_mem.available / 2**30:,.1f} GiB is "
                    f"free ({host_mem.limit / 2**30:,.1f} GiB from {host_mem.source}, "
                    f"{host_mem.in_use / 2**30:,.1f} GiB in use)")
            if host_mem.exact:
                problem = f"{text}; {advice}, run fewer ranks per node, or use a node with more memory"
            elif host == here:
                log.warning("%s; this machine adds memory as it is used (virtio-mem), so going on", text)
    if problem is not None:
        raise CheckpointError(problem)
    first = rows[0]
    free = f"{format_size(first[2].available)} free" if first[2] else "host memory unknown"
    return f"{format_size(needed[first[0]])} on {first[0]} ({free})"
