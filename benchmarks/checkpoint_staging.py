"""Asynchronous checkpoint staging: ours (fsdp_utils/checkpoint: one host arena, reserved at the start of the run
and reused by every save) against torch.distributed.checkpoint's own stager (`DefaultStager`), on the run that
training builds.

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint_staging.py config/train1B_fsdp.yaml \
        --fsdp.version=2 --variants ours_thread,ours_process,dcp_thread,dcp_process,dcp_sync \
        --out /tmp/staging --json staging.jsonl
    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint_staging.py config/train_tiny_fsdp.yaml \
        --device cpu --out /tmp/staging

The run is built as training builds it (`build_run`), set for a quick measurement (no compile, micro-batch 1, full
activation checkpointing: the state saved is the same), and one step gives the optimizer its state. Then each variant
(VARIANTS) in turn is set up, saves `--saves` times, training going on until each save is complete (so a stager that
lets training change what is written shows in the check), and is released. Per save (the slowest rank's): the stall,
the whole save, the staging, host memory (sampled: the node's, the ranks' and their writers' RSS; the staged bytes),
the GPU peak, the size on disk; every checkpoint is read back (`--check_tensors` of its tensors) and compared with
checksums taken as the save began. A variant that fails (DCP's stager may not copy FSDP1's ShardedTensors) is recorded
with its error line and the others still run. Prints a table and appends one JSON row per save to --json."""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import ctypes
import dataclasses
import gc
import json
import math
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from benchmarks.benchmark import EOS_ID, random_batches, reset_peak
from config import CheckpointConfig, ConfigError, check_batch_split, load_config
from config.numbers import (
    integer,
    number as parse_number,
)
from fsdp_utils.checkpoint import CheckpointManager, Contents
from fsdp_utils.checkpoint.async_save import check_host_memory
from fsdp_utils.checkpoint.base import CheckpointContext
from fsdp_utils.checkpoint.contents import quiet_state_dict_warnings
from fsdp_utils.checkpoint.errors import first_line
from fsdp_utils.checkpoint.names import size_of
from fsdp_utils.checkpoint.sharded import ShardedCheckpoint
from fsdp_utils.checkpoint.staging import arena_bytes, state_bytes, storage_tensors
from fsdp_utils.distributed import (
    DistEnv,
    barrier,
    broadcast_decision,
    destroy_distributed,
    init_distributed,
    prefer_expandable_segments,
    read_torchrun_env,
)
from fsdp_utils.host_memory import meminfo
from fsdp_utils.parallel.build import describe_model
from fsdp_utils.parallel.float8 import float8_problems
from fsdp_utils.train.build_run import build_run
from fsdp_utils.train.step import train_step
from safe_io import nofollow

ROOT = Path(__file__).resolve().parents[1]

try:  # DCP's own stager (torch 2.9 and later)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
except ImportError:
    DefaultStager = StagingOptions = None  # type: ignore[assignment,misc]  # stand-ins: those variants fail, said
try:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
except ImportError:
    AsyncCheckpointerType = None  # type: ignore[assignment,misc]

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Spec:
    kind: str  # ours or dcp
    form: str  # thread, process or sync
    async_staging: bool = True  # dcp: staging in DefaultStager's own thread, waited for before the next step


# ours_*: our CheckpointManager (OursVariant); dcp_*: dcp.async_save with DCP's DefaultStager (DcpVariant), staging in
# its thread, waited for before the next optimizer step, or inside the call (_blocking); dcp_sync: dcp.save.
VARIANTS = {
    "ours_thread": Spec("ours", "thread"), "ours_process": Spec("ours", "process"), "ours_sync": Spec("ours", "sync"),
    "dcp_thread": Spec("dcp", "thread"), "dcp_process": Spec("dcp", "process"),
    "dcp_thread_blocking": Spec("dcp", "thread", async_staging=False),
    "dcp_process_blocking": Spec("dcp", "process", async_staging=False),
    "dcp_sync": Spec("dcp", "sync"),
}
DEFAULT_VARIANTS = "ours_thread,ours_process,dcp_thread,dcp_process,dcp_sync"


# ---- host memory, from /proc ---------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    """A process's resident memory (0 once it has ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the process writers of a rank)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def trim_host_heap() -> None:
    """Give the C allocator's freed memory back to the system (glibc keeps freed blocks of up to tens of MB for
    reuse): else what a variant freed still counts as in use, and the next variant, allocating into it, would
    seem to need less. Nothing where the C library has no malloc_trim."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def node_in_use() -> int:
    """The node's memory in use: MemTotal - MemAvailable (page cache counts as free; shared memory does not)."""
    fields = meminfo(Path("/proc/meminfo").read_text())
    return fields["MemTotal"] - fields.get("MemAvailable", fields.get("MemFree", 0))


class HostSampler:
    """Samples in a thread, every `interval_s`: this rank's RSS, the summed RSS of its child processes (the process
    writers) and, on the node's first rank, the node's memory in use; `peaks()` since the last `restart()`."""

    def __init__(self, *, node: bool, interval_s: float = 0.05):
        self.node, self.interval_s = node, interval_s
        self.available = os.path.exists("/proc/meminfo")
        self._children: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._peak = self.read()
        self._thread = threading.Thread(target=self._run, name="host-memory-sampler", daemon=True)
        if self.available:
            self._thread.start()

    def read(self) -> dict[str, int]:
        if not self.available:
            return {"rank": 0, "writers": 0, "node": 0}
        return {"rank": rss_bytes(os.getpid()), "writers": sum(rss_bytes(p) for p in self._children),
                "node": node_in_use() if self.node else 0}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            sample = self.read()
            with self._lock:
                self._peak = {k: max(v, sample[k]) for k, v in self._peak.items()}

    def restart(self) -> dict[str, int]:
        """Start a new window (the child processes looked up afresh); returns the sample it starts from."""
        self._children = child_pids(os.getpid()) if self.available else []
        sample = self.read()
        with self._lock:
            self._peak = sample
        return sample

    def peaks(self) -> dict[str, int]:
        sample = self.read()
        with self._lock:
            return {k: max(v, sample[k]) for k, v in self._peak.items()}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# ---- what a staged copy holds --------------------------------------------------------------------------------
def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
    elif isinstance(obj, torch.Tensor):
        yield obj


def staged_memory(state: Any) -> dict[str, int]:
    """Bytes of the distinct host storages under a staged state dict's tensors: in all, pinned and shared."""
    storages: dict[int, tuple[int, bool, bool]] = {}
    for t in tensors_in(state):
        for part in storage_tensors(t):
            if part.device.type != "cpu" or not part.numel():
                continue
            storage = part.untyped_storage()
            storages.setdefault(storage.data_ptr(), (storage.nbytes(), part.is_pinned(), part.is_shared()))
    return {"staged": sum(n for n, _, _ in storages.values()),
            "pinned": sum(n for n, pinned, _ in storages.values() if pinned),
            "shared": sum(n for n, _, shared in storages.values() if shared)}


# ---- the check of a written checkpoint -----------------------------------------------------------------------
def tensor_leaves(obj: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    """(path, tensor) of every tensor under string keys of nested dicts: what DCP saves under a flat key."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str):
                yield from tensor_leaves(value, (*path, key))
    elif isinstance(obj, torch.Tensor):
        yield path, obj


def kind_of(t: torch.Tensor) -> tuple[str, ...]:
    """The classes a state-dict tensor nests (DTensor, torchao's FP8 weight, ShardedTensor, Tensor): the kinds a
    stager may copy differently."""
    kinds = [type(t).__name__]
    inner = t.to_local() if isinstance(t, DTensor) else None
    while isinstance(inner, torch.Tensor):
        kinds.append(type(inner).__name__)
        names = inner.__tensor_flatten__()[0] if type(inner) is not torch.Tensor and hasattr(
            inner, "__tensor_flatten__") else []
        inner = getattr(inner, names[0]) if names else None
    return tuple(kinds)


def sample_paths(state: dict, num: int) -> list[tuple[str, ...]]:
    """Up to `num` tensor paths: one of each kind of tensor of each top-level part (model, optimizer), then more
    evenly spread over the sorted paths. The same on every rank: the keys and kinds are."""
    leaves = sorted(tensor_leaves(state), key=lambda leaf: leaf[0])
    if num <= 0 or not leaves:
        return []
    firsts: dict[tuple, tuple[str, ...]] = {}
    for path, t in leaves:
        firsts.setdefault((path[0], kind_of(t)), path)
    chosen = list(firsts.values())[:num]
    step = (len(leaves) - 1) / max(num - 1, 1)
    spread = [leaves[round(i * step)][0] for i in range(num)]
    chosen += [path for path in spread if path not in chosen]
    return sorted(chosen[:num])


def at(state: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        state = state[key]
    return state


def local_values(t: torch.Tensor) -> list[torch.Tensor]:
    """This rank's values of a state-dict tensor as DCP writes them: a ShardedTensor's local shards, a DTensor's
    local tensor (a tensor subclass inside it, such as torchao's FP8 weights, computes through its own dispatch),
    else the tensor."""
    if hasattr(t, "local_shards"):
        return [shard.tensor for shard in t.local_shards()]
    if isinstance(t, DTensor):
        return [t.to_local()]
    return [t]


@torch.no_grad()
def checksums(t: torch.Tensor) -> list[tuple[float, float]]:
    """(sum, L2 norm) in float64 of each of this rank's pieces: the same bits give the same figures on the same
    device, and a copy taken at another moment of training does not."""
    sums = []
    for value in local_values(t):
        value = value if value.is_floating_point() else value.double()
        sums.append((torch.sum(value, dtype=torch.float64).item(),
                     torch.linalg.vector_norm(value, dtype=torch.float64).item()))
    return sums


def _blank(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(math.nan) if t.is_floating_point() else t.zero_()


def blank_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor that DCP can load `t`'s checkpointed values into (same layout across ranks, plain values),
    filled with NaN so that a value not loaded shows."""
    if hasattr(t, "local_shards"):  # FSDP1's ShardedTensor: a copy of it, for its layout
        twin = copy.deepcopy(t)
        for shard in twin.local_shards():
            _blank(shard.tensor)
        return twin
    if isinstance(t, DTensor):
        local = torch.empty(t.to_local().shape, dtype=t.dtype, device=t.device)
        return DTensor.from_local(_blank(local), t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return _blank(torch.empty(t.shape, dtype=t.dtype, device=t.device))


@dataclasses.dataclass
class Expected:
    """What a checkpoint must hold: checksums of sampled tensors as the save began, and blank tensors to read into."""

    sums: dict[tuple[str, ...], list[tuple[float, float]]]
    blanks: dict


def expect(state: dict, paths: list[tuple[str, ...]]) -> Expected:
    sums: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    blanks: dict = {}
    for path in paths:
        t = at(state, path)
        sums[path] = checksums(t)
        node = blanks
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = blank_like(t)
    return Expected(sums, blanks)


def check_checkpoint(path: Path, expected: Expected, *, group: Any) -> tuple[str, str]:
    """Collective: read the sampled tensors of the checkpoint at `path` back; ("equal", "") or ("different", the
    first differing key) or ("error", its line). Same figures up to 1e-12 relative: the sums of identical bits."""
    try:
        with quiet_state_dict_warnings(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(expected.blanks, checkpoint_id=str(path), process_group=group)
        for key, want in expected.sums.items():
            got = checksums(at(expected.blanks, key))
            same = len(got) == len(want) and all(math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
                                                  for pair_got, pair_want in zip(got, want, strict=True)
                                                  for a, b in zip(pair_got, pair_want, strict=True))
            if not same:
                return "different", ".".join(key)
    except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
        return "error", first_line(err)
    return "equal", ""


# ---- the variants -------------------------------------------------------------------------------------------
def staging_options(*, pinned: bool, shared: bool, async_staging: bool, non_blocking: bool) -> Any:
    """StagingOptions across torch releases: the non-blocking copy is `use_cuda_non_blocking_copy` in the first
    releases that have it, `use_non_blocking_copy` in later ones."""
    names = {f.name for f in dataclasses.fields(StagingOptions)}
    values = {"use_pinned_memory": pinned, "use_shared_memory": shared, "use_async_staging": async_staging,
              "use_non_blocking_copy": non_blocking, "use_cuda_non_blocking_copy": non_blocking}
    return StagingOptions(**{name: value for name, value in values.items() if name in names})


@contextlib.contextmanager
def dcp_quiet() -> Iterator[None]:
    """DCP's warnings at every asynchronous save (its API is marked experimental; `synchronize_staging` is
    deprecated in favour of the staging future, which DCP itself still calls): nothing to act on here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*experimental.*")
        warnings.filterwarnings("ignore", message=".*synchronize_staging.*")
        yield


if DefaultStager is not None:
    class RecordingStager(DefaultStager):
        """DCP's DefaultStager, unchanged, keeping what each staging made (`staged`, until `measured`) and noting
        when it was done."""

        def __init__(self, options: Any):
            super().__init__(options)
            self.staged: Any = None
            self.done_at: float | None = None

        def stage(self, state_dict: Any, **kwargs: Any) -> Any:
            result = super().stage(state_dict, **kwargs)
            if isinstance(result, concurrent.futures.Future):
                result.add_done_callback(lambda f: self._note(f.result()) if f.exception() is None else None)
            else:
                self._note(result)
            return result

        def _note(self, staged: Any) -> None:
            self.done_at, self.staged = time.perf_counter(), staged

        def measured(self) -> dict[str, int]:
            """The last staged copy's bytes (staged_memory), read off the training's clock, then let go."""
            memory = staged_memory(self.staged) if self.staged is not None else {}
            self.staged = None
            return memory


@dataclasses.dataclass
class Bench:
    """The run being measured and what every variant shares."""

    cfg: Any
    env: DistEnv
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    contents: Contents  # what a checkpoint of the run holds, its state dicts taken as the run's FSDP adapter says
    step: Callable[[], float]  # one training step; its seconds
    sharded: ShardedCheckpoint  # the state dicts a sharded save writes, taken as ours takes them
    group: Any  # a gloo group: DCP's asynchronous saves need a CPU backend
    root: Path  # this invocation's folder (made by it, removed at the end)
    sampler: HostSampler
    args: argparse.Namespace
    deadline: float
    normal_step_s: float = 0.0
    train_gpu_peak_gib: float = 0.0
    longest_save_s: float = 0.0  # the longest save so far, its check and removal included (for --budget_s)
    longest_setup_s: float = 0.0
    touches: int = 0
    writer_stuck: str | None = None  # a process variant whose failed save DCP's writer process still waits in
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)  # the state dict's tensors by kind (kind_of)


class OursVariant:
    """Our CheckpointManager, configured as a run with checkpoint.async_save and that writer (or without, for
    ours_sync) saves; its arena is reserved by prepare_saving, reported as the setup."""

    def __init__(self, name: str, spec: Spec, bench: Bench):
        if spec.form == "process" and bench.writer_stuck:  # ours writes through the same DCP writer process
            raise VariantFailed(f"DCP's writer process still waits in the failed save of {bench.writer_stuck}")
        self.bench, self.form = bench, spec.form
        is_async = spec.form != "sync"
        section = CheckpointConfig(format="sharded", keep_last_n=0, async_save=is_async,
                                   async_writer="process" if spec.form == "process" else "thread")
        self.manager = CheckpointManager(section, bench.root / name, env=bench.env, contents=bench.contents,
                                         model_config={}, timeout_s=bench.cfg.run.timeout_s)
        self.memory: dict[str, int] = {}
        self.written_at: float | None = None
        self.start_at = 0.0

    def setup(self) -> None:
        self.manager.prepare_saving()

    def start(self, index: int) -> Path:
        self.start_at, self.written_at, self.memory = time.perf_counter(), None, {}
        self.manager.contents.state.step = index
        path = self.manager.save()
        flight = getattr(self.manager.background, "_in_flight", None)  # read for the measurement only
        if flight is not None:
            self.memory = staged_memory(flight.staged_state)
            flight.job.add_done_callback(lambda _: setattr(self, "written_at", time.perf_counter()))
        return path

    @property
    def in_flight(self) -> bool:
        return self.manager.in_flight

    def poll(self) -> None:
        self.manager.poll()

    def finish(self) -> dict:
        self.manager.finish()
        stats = self.manager.stats[-1]
        written = self.written_at - self.start_at if self.written_at is not None else None
        intended = "sync" if self.form == "sync" else "async"  # else the manager fell back (its log says why)
        mode = self.form if stats["mode"] == intended else f"{stats['mode']} instead"
        return {"mode": mode, "stall_s": stats["blocked_s"], "whole_s": stats["total_s"],
                "staging_s": stats.get("staging_s"), "written_s": written, **self.memory}

    def close(self) -> None:
        self.manager.close()


class VariantFailed(RuntimeError):
    """A variant's failure, agreed by every rank; its message is the row's error."""


class DcpVariant:
    """torch.distributed.checkpoint's own asynchronous save (or dcp.save, for dcp_sync) of the state dicts ours
    writes, staged by DCP's DefaultStager.

    DCP stages and writes in one pipeline: where the staging fails on one rank only, the other ranks' writes
    wait in DCP's collectives until their group's timeout. So each variant's writes get a gloo group of their
    own (a write left waiting holds only that one), the ranks agree after each step whether every write is done
    or any save failed, and a failure is raised on every rank, the waiting writes abandoned."""

    def __init__(self, name: str, spec: Spec, bench: Bench):
        self.bench, self.spec, self.dir = bench, spec, bench.root / name
        self.stager: Any = None
        if spec.form != "sync":
            if DefaultStager is None or AsyncCheckpointerType is None:
                raise VariantFailed(f"torch {torch.__version__} has no DefaultStager (torch 2.9 and later)")
            if spec.form == "process" and bench.writer_stuck:
                raise VariantFailed(f"DCP's writer process still waits in the failed save of {bench.writer_stuck}")
            cuda = bench.env.device.type == "cuda"
            self.stager = RecordingStager(staging_options(pinned=cuda, shared=spec.form == "process",
                                                          async_staging=spec.async_staging, non_blocking=cuda))
        self.name = name
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=bench.cfg.run.timeout_s))
        self.hook = bench.optimizer.register_step_pre_hook(self._wait_for_staging)
        self.upload: concurrent.futures.Future | None = None
        self.staging: concurrent.futures.Future | None = None
        self.in_flight = False
        self.start_at = self.call_s = self.waited_s = self.polled_s = 0.0
        self.written_at: float | None = None
        self.staging_error: BaseException | None = None

    def setup(self) -> None:
        """Collective: the node's host memory (and /dev/shm for the process form) must hold the staged copy, as
        ours checks at the start of a run; a full /dev/shm would end the rank with SIGBUS."""
        if self.stager is None:
            return
        b = self.bench
        nbytes = arena_bytes(b.model, b.optimizer)
        shm = nbytes if self.spec.form == "process" else 0
        check_host_memory(nbytes, b.env, what="its share of the weights and optimizer state, staged by DCP",
                          advice="measure the other variants", shm_per_rank=shm)

    def _wait_for_staging(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Before an optimizer step: the staging must be done before the weights and moments change."""
        if self.staging is not None:
            begin = time.perf_counter()
            try:
                self.staging.result()
            except BaseException as err:  # raised by finish(), on every rank: raised here alone it would hang them
                self.staging_error = err
            self.waited_s += time.perf_counter() - begin
            self.staging = None

    def start(self, index: int) -> Path:
        path = self.dir / f"save{index}"
        self.start_at, self.waited_s, self.polled_s, self.written_at = time.perf_counter(), 0.0, 0.0, None
        state = self.bench.sharded.tensors(self.bench.contents)
        if self.stager is not None:
            self.stager.staged, self.stager.done_at = None, None
        self.upload = None
        if self.spec.form == "sync":
            dcp.save(state, checkpoint_id=str(path))
        else:
            self._start_async(state, path)
        self.call_s = time.perf_counter() - self.start_at
        return path

    def _start_async(self, state: dict, path: Path) -> None:
        """Collective: dcp.async_save, agreed: a staging inside the call that fails on one rank fails everywhere."""
        kind = AsyncCheckpointerType.PROCESS if self.spec.form == "process" else AsyncCheckpointerType.THREAD
        error = None
        try:
            with dcp_quiet():
                response: Any = dcp.async_save(state, checkpoint_id=str(path), process_group=self.group,
                                               async_checkpointer_type=kind, async_stager=self.stager)
            self.upload = getattr(response, "upload_completion", response)
            self.staging = getattr(response, "staging_completion", None)  # an AsyncSaveResponse: staging is async
            self.upload.add_done_callback(lambda _: setattr(self, "written_at", time.perf_counter()))
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
            error = err
        self._agree(error)
        self.in_flight = True

    def _local_error(self) -> BaseException | None:
        if self.staging_error is not None:
            return self.staging_error
        if self.upload is not None and self.upload.done():
            return self.upload.exception()
        return None

    def _settled(self) -> bool:
        """Collective: every rank's write is done, or some rank's save failed (the same answer on every rank)."""
        pending = int(self.upload is not None and not self.upload.done())
        flags = torch.tensor([pending, int(self._local_error() is not None)], device=self.bench.env.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags[0].item() == 0 or flags[1].item() == 1

    def poll(self) -> None:
        """Collective, after a step (as ours' poll): the save is over once it has settled."""
        begin = time.perf_counter()
        self.in_flight = not self._settled()
        self.polled_s += time.perf_counter() - begin

    def finish(self) -> dict:
        """Collective: wait for the staging and for the save to settle; VariantFailed on every rank if it failed
        on any."""
        if self.upload is None:  # dcp.save: done when it returned (its ranks agreed on any error themselves)
            return {"mode": "sync", "stall_s": self.call_s, "whole_s": self.call_s, "staging_s": None,
                    "written_s": self.call_s}
        begin = time.perf_counter()
        self._wait_for_staging(None, None, None)
        while not self._settled():  # the same answers everywhere: every rank loops as often
            time.sleep(0.05)
        self.in_flight = False
        self._agree()
        stall = self.call_s + self.waited_s + self.polled_s + time.perf_counter() - begin
        end = self.written_at if self.written_at is not None else time.perf_counter()
        staged_at = self.stager.done_at if self.stager is not None else None
        memory = self.stager.measured() if self.stager is not None else {}
        return {"mode": self.spec.form, "stall_s": stall, "whole_s": end - self.start_at,
                "staging_s": staged_at - self.start_at if staged_at is not None else None,
                "written_s": end - self.start_at, "staging_wait_s": self.waited_s, **memory}

    def _agree(self, error: BaseException | None = None) -> None:
        """Collective: raise the first rank's failure (`error`, else the staging's own error before the write's,
        which only says that the staging failed) on every rank; a write still waiting is abandoned."""
        error = error or self._local_error()
        stuck = self.upload is not None and not self.upload.done()
        every: list = [None] * self.bench.env.world_size
        dist.all_gather_object(every, (error_line(error) if error is not None else None, stuck))
        failures = [f"rank {rank}: {line}" for rank, (line, _) in enumerate(every) if line is not None]
        if not failures:
            return
        self.upload = self.staging = None
        self.staging_error = None
        if self.spec.form == "process" and any(waiting for _, waiting in every):
            self.bench.writer_stuck = self.name
        raise VariantFailed(failures[0])

    def close(self) -> None:
        self.hook.remove()
        self.upload = self.staging = None
        if self.stager is not None:
            self.stager.close()  # its cached host copies go with it
            self.stager = None


def touch_process_writer(bench: Bench) -> None:
    """Collective: a tiny save through DCP's writer process. The first starts it (once per rank for the whole
    invocation: both process forms use it); a later one makes it let go of the previous variant's state."""
    bench.touches += 1
    path = bench.root / f"writer-touch-{bench.touches}"
    with dcp_quiet():
        response: Any = dcp.async_save({"touch": torch.zeros(1)}, checkpoint_id=str(path),
                                       process_group=bench.group, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    getattr(response, "upload_completion", response).result()
    barrier(bench.env)
    if bench.env.is_main:
        nofollow.remove(path, folder_ok=True)


# ---- measuring ----------------------------------------------------------------------------------------------
SUMMED = ("staged", "pinned", "shared")  # bytes per rank, summed over the ranks; the rest: the largest rank's


def over_ranks(env: DistEnv, values: dict) -> dict:
    """Every rank's figures combined: bytes of staged copies summed, everything else the largest (None: absent)."""
    every: list = [None] * env.world_size
    dist.all_gather_object(every, values)
    combined = {}
    for key, value in values.items():
        seen = [v[key] for v in every if v.get(key) is not None]
        if isinstance(value, str) or not seen:
            combined[key] = value
        else:
            combined[key] = sum(seen) if key in SUMMED else max(seen)
    return combined


def gpu_peak_gib(env: DistEnv) -> float:
    return torch.cuda.max_memory_allocated(env.device) / GIB if env.device.type == "cuda" else 0.0


def budget_allows(bench: Bench, seconds: float) -> bool:
    """Rank 0 decides whether `seconds` more fit before --budget_s runs out; every rank follows."""
    fits = time.perf_counter() + seconds <= bench.deadline
    return bool(broadcast_decision(bench.env, fits if bench.env.is_main else None))


def measure_save(bench: Bench, variant: Any, index: int, *, baseline: int) -> dict:
    """One save of a variant, the training steps while it is in flight, its check and its removal: its row."""
    b, env = bench, bench.env
    begin = time.perf_counter()
    state = b.sharded.tensors(b.contents)
    expected = expect(state, sample_paths(state, b.args.check_tensors))
    del state
    barrier(env)
    b.sampler.restart()
    reset_peak(env)
    path = variant.start(index)
    save_gpu = gpu_peak_gib(env)
    steps: list[float] = []
    while variant.in_flight and len(steps) < b.args.max_overlap_steps:
        steps.append(b.step())
        variant.poll()
    timing = variant.finish()
    host, held = b.sampler.peaks(), b.sampler.read()["node"]
    size = size_of(path) if env.is_main else 0
    check, detail = check_checkpoint(path, expected, group=b.group)
    barrier(env)
    if env.is_main:
        nofollow.remove(path, folder_ok=True)
    node = env.local_rank == 0 and b.sampler.available
    row = {**timing, "steps_during_save": len(steps), "first_step_s": steps[0] if steps else None,
           "overlap_step_s": statistics.median(steps) if steps else None,
           "host_peak_gib": (host["node"] - baseline) / GIB if node else None,
           "host_held_gib": (held - baseline) / GIB if node else None,
           "rank_rss_peak_gib": host["rank"] / GIB, "writer_rss_peak_gib": host["writers"] / GIB,
           "save_gpu_peak_gib": save_gpu, "size_gib": size / GIB, "checked_tensors": len(expected.sums)}
    row = over_ranks(env, row)
    for key in SUMMED:
        row[f"{key}_gib"] = (row.pop(key, None) or 0) / GIB
    row.update(worst_check(env, check, detail))
    b.longest_save_s = max(b.longest_save_s, time.perf_counter() - begin)
    return row


def worst_check(env: DistEnv, check: str, detail: str) -> dict:
    """Collective: the check over every rank: equal only where every rank read back what it saved."""
    every: list = [None] * env.world_size
    dist.all_gather_object(every, (env.rank, check, detail))
    bad = [(rank, c, d) for rank, c, d in every if c != "equal"]
    if not bad:
        return {"check": "equal", "check_detail": ""}
    rank, c, d = bad[0]
    return {"check": c, "check_detail": f"rank {rank}: {d}"}


def error_line(err: BaseException) -> str:
    """first_line, without the repr of the arguments that torch's __torch_function__ refusals print whole."""
    text = str(err)
    if ", with args: (" in text and not isinstance(err, dcp.CheckpointException):
        text = re.sub(r", with args: \(.*\) and kwargs: \S+", "", text, flags=re.S)
        line = f"{type(err).__name__}: {text.strip().splitlines()[0]}"
        return line if len(line) <= 200 else line[:197] + "..."
    return first_line(err)


def skipped(name: str, index: int) -> dict:
    return {"variant": name, "save": index, "status": "skipped", "error": "--budget_s would run out first"}


def make_variant(name: str, bench: Bench) -> Any:
    spec = VARIANTS[name]
    return (OursVariant if spec.kind == "ours" else DcpVariant)(name, spec, bench)


def run_variant(bench: Bench, name: str) -> list[dict]:
    """Collective: set one variant up, make its saves, release it. Its rows; a failure ends the variant with a
    row holding the error's line (the first rank's), and the next variant runs."""
    b, env = bench, bench.env
    if not budget_allows(b, b.longest_setup_s + b.longest_save_s):
        return [skipped(name, i) for i in range(1, b.args.saves + 1)]
    gc.collect()
    trim_host_heap()
    baseline = b.sampler.restart()["node"]
    rows: list[dict] = []
    variant, error = None, None
    try:
        begin = time.perf_counter()
        if env.is_main:  # every rank's writes go there (a run's output folder exists before its first save too)
            (b.root / name).mkdir()
        barrier(env)
        variant = make_variant(name, b)
        variant.setup()
        setup_s = over_ranks(env, {"s": time.perf_counter() - begin})["s"]
        b.longest_setup_s = max(b.longest_setup_s, setup_s)
        for index in range(1, b.args.saves + 1):
            if not budget_allows(b, b.longest_save_s):
                rows.append(skipped(name, index))
                continue
            row = {"variant": name, "save": index, "status": "ok", "setup_s": setup_s,
                   **measure_save(b, variant, index, baseline=baseline)}
            rows.append(row)
            if env.is_main:
                print(f"{name} save {index}: stall {row['stall_s']:.2f} s, whole {row['whole_s']:.2f} s, "
                      f"check {row['check']}", flush=True)
    except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
        error = str(err) if isinstance(err, VariantFailed) else error_line(err)
    errors: list = [None] * env.world_size
    dist.all_gather_object(errors, error)
    if first := next((e for e in errors if e is not None), None):
        rows.append({"variant": name, "save": len(rows) + 1, "status": "failed", "error": first})
        if env.is_main:
            print(f"{name}: failed: {first}", flush=True)
    release(b, name, variant)
    left = (b.sampler.read()["node"] - baseline) / GIB if env.local_rank == 0 and b.sampler.available else None
    return [{**row, "left_after_gib": left} for row in rows]


def release(bench: Bench, name: str, variant: Any) -> None:
    """Collective: the variant's buffers, writer state and folder go, before the next variant."""
    b, env = bench, bench.env
    if variant is not None:
        with contextlib.suppress(Exception, dcp.CheckpointException):
            if variant.in_flight:  # a failure in the middle of a save: its write ends first
                variant.finish()
        variant.close()
    b.optimizer.zero_grad(set_to_none=True)  # a step that a failed staging stopped left its gradients
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    trim_host_heap()
    if VARIANTS[name].form == "process" and not b.writer_stuck:
        with contextlib.suppress(Exception, dcp.CheckpointException):
            touch_process_writer(b)
    barrier(env)
    if env.is_main:
        nofollow.remove(b.root / name, folder_ok=True)


# ---- the run ------------------------------------------------------------------------------------------------
# Only the speed of training depends on these: the state saved (weights, FP8 subclasses, optimizer) is the same.
MEASUREMENT = ("--train.compile=false", "--train.micro_batch_size=1", "--fsdp.activation_checkpointing=full")


def load_run_config(args: argparse.Namespace, overrides: list[str], *, world_size: int, local_rank: int) -> Any:
    """The config with the measurement's settings under the command line's; ConfigError with every problem."""
    mine = [*MEASUREMENT, f"--train.global_batch_size={world_size}"]
    if args.device != "auto":
        mine.append(f"--run.device={args.device}")
    cfg = load_config(args.config, [*mine, *overrides])
    if cfg.model.vocab_size == 0:  # no tokenizer here: random tokens over the configured vocabulary
        cfg.model.vocab_size = cfg.data.vocab_size
    if problems := float8_problems(cfg.train.float8, run_device=cfg.run.device, local_rank=local_rank):
        raise ConfigError(problems)
    check_batch_split(cfg.train, world_size)
    return cfg


def make_root(env: DistEnv, out: str) -> Path:
    """Collective: this invocation's own folder under --out (rank 0 makes it: nothing else there is touched)."""
    name = None
    if env.is_main:
        root = nofollow.make_dir(out) / f"checkpoint-staging-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        root.mkdir()
        name = str(root)
    return Path(str(broadcast_decision(env, name)))


def build_bench(cfg: Any, env: DistEnv, args: argparse.Namespace, *, root: Path, deadline: float) -> Bench:
    """The run as training builds it, one step taken (AdamW's moments exist from here), the normal step timed."""
    vocab_size, signature, _ = describe_model(cfg, cfg.data.vocab_size)
    run = build_run(cfg, env, vocab_size=vocab_size, model_signature=signature, eos_id=EOS_ID,
                    use_cache=False)
    batches = random_batches(vocab_size, micro_batch=run.split.micro_batch_size, seq_len=cfg.data.seq_len,
                             device=env.device, seed=env.rank)

    def step() -> float:
        begin = time.perf_counter()
        train_step(run.model, run.optimizer, batches, fsdp=run.fsdp, grad_accum=run.split.grad_accum,
                   grad_clip=cfg.train.grad_clip, world_size=env.world_size, scaler=run.scaler)
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        return time.perf_counter() - begin

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.run.timeout_s))
    sharded = ShardedCheckpoint(CheckpointContext(root, env, "sharded", 0, {}))
    bench = Bench(cfg, env, run.model, run.optimizer, Contents(run.model, run.optimizer, fsdp=run.fsdp), step, sharded,
                  group, root, HostSampler(node=env.local_rank == 0), args, deadline)
    reset_peak(env)
    step()
    times = [step() for _ in range(max(args.steps, 1))]
    measured = over_ranks(env, {"step_s": statistics.median(times), "gpu": gpu_peak_gib(env)})
    bench.normal_step_s, bench.train_gpu_peak_gib = measured["step_s"], measured["gpu"]
    for path, t in tensor_leaves(sharded.tensors(bench.contents)):
        kind = f"{path[0]}: {'/'.join(kind_of(t))}"
        bench.kinds[kind] = bench.kinds.get(kind, 0) + 1
    return bench


def disk_problem(bench: Bench) -> str | None:
    """Collective: one checkpoint of this run must fit on --out's disk (each is deleted once measured)."""
    b = bench
    total = torch.tensor([state_bytes(b.model, b.optimizer)], dtype=torch.int64, device=b.env.device)
    dist.all_reduce(total)
    problem = None
    if b.env.is_main:
        need, free = int(total.item() * 1.02), shutil.disk_usage(b.root).free
        if need > free:
            problem = (f"--out {b.args.out}: {free / GIB:,.1f} GiB free, one checkpoint of this run takes "
                       f"{need / GIB:,.1f} GiB; choose a folder on a larger disk")
    return broadcast_decision(b.env, problem)


def describe_run(bench: Bench) -> dict:
    """What every JSON row repeats: the machine, the software, the commit, the command and the run."""
    b, env, cfg = bench, bench.env, bench.cfg
    cuda = env.device.type == "cuda"
    total = torch.tensor([state_bytes(b.model, b.optimizer)], dtype=torch.int64, device=env.device)
    dist.all_reduce(total)
    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None

    def git(*words: str) -> str:
        done = subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else "unknown"

    shm = shutil.disk_usage("/dev/shm").free / GIB if os.path.isdir("/dev/shm") else None
    return {"host": socket.gethostname(), "device": torch.cuda.get_device_name(env.device) if cuda else "cpu",
            "world_size": env.world_size, "cpus": os.cpu_count(), "host_memory_gib": node_total_gib(),
            "shm_free_gib": shm, "torch": torch.__version__, "torchao": torchao_version,
            "python": platform.python_version(), "commit": git("rev-parse", "HEAD"),
            "dirty": git("status", "--porcelain", "--untracked-files=no") not in ("", "unknown"),
            "command": " ".join(["torchrun", f"--nproc_per_node={env.local_world_size}", *sys.argv]),
            "config": b.args.config, "fsdp_version": cfg.fsdp.version, "float8": cfg.train.float8,
            "params": cfg.model.num_params(),
            "state_gib": total.item() / GIB, "tensor_kinds": b.kinds, "normal_step_s": b.normal_step_s,
            "train_gpu_peak_gib": b.train_gpu_peak_gib}


def node_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        return None


# ---- the report ---------------------------------------------------------------------------------------------
def number(value: Any, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def print_table(rows: list[dict], run: dict, *, writer_start_s: float | None) -> None:
    """The compact table: one line per save (host+: the node's memory in use above its level before the variant;
    rank, writer: the largest peak RSS of a rank process, of a rank's writer processes; staged, pinned, shm: the
    staged copy's bytes, in all, pinned and shared, summed over the ranks)."""
    print(f"\n{run['config']}: {run['params'] / 1e9:.2f}B params, FSDP{run['fsdp_version']}, float8 {run['float8']}, "
          f"{run['world_size']} x {run['device']}, torch {run['torch']}, state {run['state_gib']:.1f} GiB over the "
          f"ranks, step {run['normal_step_s']:.2f} s"
          + (f", DCP's writer process started in {writer_start_s:.1f} s" if writer_start_s is not None else ""))
    print("state dict tensors: " + ", ".join(f"{kind} x {n}" for kind, n in run["tensor_kinds"].items()))
    print(f"{'variant':<21}{'save':>5}{'stall s':>9}{'whole s':>9}{'staging s':>10}{'setup s':>8}{'host+ GiB':>10}"
          f"{'rank GiB':>9}{'writer GiB':>11}{'staged GiB':>11}{'pinned GiB':>11}{'shm GiB':>8}{'size GiB':>9}  check")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['variant']:<21}{r['save']:>5}  {r['status']}: {r['error']}")
            continue
        writer = r["writer_rss_peak_gib"] if VARIANTS[r["variant"]].form == "process" else None
        check = r["check"] + (f" ({r['check_detail']})" if r["check_detail"] else "")
        print(f"{r['variant']:<21}{r['save']:>5}{number(r['stall_s'], 9)}{number(r['whole_s'], 9)}"
              f"{number(r['staging_s'], 10)}{number(r['setup_s'], 8, 1)}{number(r['host_peak_gib'], 10)}"
              f"{number(r['rank_rss_peak_gib'], 9)}{number(writer, 11)}{number(r['staged_gib'], 11)}"
              f"{number(r['pinned_gib'], 11)}"
              f"{number(r['shared_gib'], 8)}{number(r['size_gib'], 9)}  {check}")
    for r in rows:
        if r["status"] == "ok" and r["save_gpu_peak_gib"] > run["train_gpu_peak_gib"]:
            print(f"{r['variant']} save {r['save']}: the save call raised the GPU memory peak above training's "
                  f"({r['save_gpu_peak_gib']:.2f} > {run['train_gpu_peak_gib']:.2f} GiB)")


def append_json(path: str, rows: list[dict], run: dict, *, writer_start_s: float | None) -> None:
    with nofollow.open_append(path) as f:
        for row in rows:
            f.write(json.dumps({**run, "writer_start_s": writer_start_s, **row}) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a training config (YAML); --section.key=value overrides follow")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated, measured in this order; any of {', '.join(VARIANTS)}")
    parser.add_argument("--saves", type=integer, default=2,
                        help="saves per variant (the first allocates DCP's staging buffers; the second is steady)")
    parser.add_argument("--out", required=True,
                        help="folder for the checkpoints (a subfolder of this invocation's own, removed at the end); "
                             "needs one checkpoint's space")
    parser.add_argument("--json", default=None, help="append one JSON row per save to this file")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="run.device")
    parser.add_argument("--steps", type=integer, default=2,
                        help="timed training steps before the saves (the normal step)")
    parser.add_argument("--max_overlap_steps", type=integer, default=1000,
                        help="at most this many training steps while a save is in flight; then it is waited for")
    parser.add_argument("--check_tensors", type=integer, default=24,
                        help="tensors of each checkpoint read back and compared (0: none)")
    parser.add_argument("--budget_s", type=parse_number, default=None,
                        help="skip the saves (and variants) that would end later than this many seconds after the "
                             "start, judged by the longest so far")
    return parser


def main() -> int:
    started = time.perf_counter()
    parser = build_parser()
    args, overrides = parser.parse_known_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        print(f"error: --variants: {', '.join(unknown) or 'none given'}: each must be one of {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    if args.saves < 1 or args.steps < 0 or args.check_tensors < 0 or args.max_overlap_steps < 1:
        print("error: --saves and --max_overlap_steps must be at least 1, --steps and --check_tensors at least 0",
              file=sys.stderr)
        return 2
    prefer_expandable_segments()  # as training does, before anything touches the GPU
    launch = read_torchrun_env()
    try:
        cfg = load_run_config(args, overrides, world_size=launch.world_size, local_rank=launch.local_rank)
    except ConfigError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    env = init_distributed(device=cfg.run.device, timeout_s=cfg.run.timeout_s)
    root = None
    try:
        root = make_root(env, args.out)
        deadline = started + args.budget_s if args.budget_s else math.inf
        bench = build_bench(cfg, env, args, root=root, deadline=deadline)
        if problem := disk_problem(bench):
            if env.is_main:
                print(f"error: {problem}", file=sys.stderr)
            return 2
        return measure_all(bench, names)
    finally:
        if root is not None and env.is_main:
            nofollow.remove(root, folder_ok=True)
        destroy_distributed()


def measure_all(bench: Bench, names: list[str]) -> int:
    """Every variant in turn (its JSON rows appended as it ends), then the table."""
    env = bench.env
    writer_start_s = None
    if any(VARIANTS[name].form == "process" for name in names) and AsyncCheckpointerType is not None:
        # The prefix store, as our process writer sets it (fsdp_utils/checkpoint/async_save.py), for both forms alike.
        os.environ.setdefault("DCP_USE_PREFIX_STORE", "1")
        begin = time.perf_counter()
        try:  # where it cannot start, each process variant fails with its own line
            touch_process_writer(bench)
            writer_start_s = over_ranks(env, {"s": time.perf_counter() - begin})["s"]
        except (Exception, dcp.CheckpointException) as err:
            if env.is_main:
                print(f"DCP's writer process did not start: {first_line(err)}", flush=True)
    run = describe_run(bench)
    rows = []
    for name in names:
        measured = run_variant(bench, name)
        rows += measured
        if env.is_main and bench.args.json:  # each variant's rows at once: a job stopped later keeps them
            append_json(bench.args.json, measured, run, writer_start_s=writer_start_s)
    bench.sampler.close()
    if env.is_main:
        print_table(rows, run, writer_start_s=writer_start_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
