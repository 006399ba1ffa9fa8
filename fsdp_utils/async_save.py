"""Asynchronous sharded saves: this rank's state is staged in host memory, then written by
torch.distributed.checkpoint's `async_save` while training goes on. The checkpoint manager commits it
(checksums, meta.json, rename, retention) once every rank's write is done.

What blocks the training loop, per save: the state dict (FSDP1 gathers and re-cuts its flat parameters
here, moving each piece to host memory as it is made), the copy of GPU tensors into host buffers, and
the commit, which is small (the checksums are computed in the background). The write itself, the
largest part by far, runs in a thread of this process or in a process of its own
(`checkpoint.async_writer`).

Host memory. Tensors that may be live training state (anything on the GPU, anything sharing storage
with a parameter or an optimizer state) are copied into one host buffer (the arena) allocated at the
first save and reused by every later one: pinned on GPUs (fast copies from the GPU), in shared memory
for the process writer (handed over without a copy). Tensors that the state dict made for this save on
the host (FSDP1's offloaded pieces) are a private copy already and go to the writer as they are.
`check_host_memory` compares what a save will hold in host memory with what the node can give, at the
start of the run.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import shutil
import socket
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

# ---- what this torch offers (2.11 on the GPU machines, 2.13 on the CPU: both have all of it) ----------

_ASYNC_PARAMS = inspect.signature(dcp.async_save).parameters if hasattr(dcp, "async_save") else {}
try:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
except ImportError:  # before torch 2.7: thread writer only
    AsyncCheckpointerType = None
try:
    from torch.distributed.checkpoint.staging import AsyncStager
except ImportError:
    AsyncStager = object
HAS_ASYNC_SAVE = bool(_ASYNC_PARAMS)
HAS_PROCESS_WRITER = (AsyncCheckpointerType is not None and "async_checkpointer_type" in _ASYNC_PARAMS
                      and hasattr(AsyncCheckpointerType, "PROCESS"))
_HAS_STAGER_PARAM = "async_stager" in _ASYNC_PARAMS

_ALIGN = 4096  # bytes: each staged tensor starts on its own page (and the arena on a page for pinning)


def resolve_async_save(setting: bool | str, *, fmt: str, device: torch.device) -> bool:
    """checkpoint.async_save as a decision: auto is on for sharded checkpoints on GPUs."""
    if fmt != "sharded" or not HAS_ASYNC_SAVE:
        return False
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


# ---- tensors of a state dict -------------------------------------------------------------------------


def storage_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold this rank's data of a state-dict entry, in a fixed order: a
    ShardedTensor's (FSDP1) local shards; for any traceable tensor subclass (DTensor, torchao's FP8
    weights, a DTensor of those) its inner tensors, recursively; else the tensor itself. Only these
    have storage: a subclass's own `untyped_storage()` is an invalid placeholder."""
    if hasattr(t, "local_shards"):
        return [p for shard in t.local_shards() for p in storage_tensors(shard.tensor)]
    if _is_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # names of inner tensors, and of opaque members (a DTensor's mesh)
        inner = [getattr(t, name) for name in names]
        return [p for v in inner if isinstance(v, torch.Tensor) for p in storage_tensors(v)]
    return [t]


def _is_wrapper_subclass(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else 0


def live_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """Storages of the training state (parameters, buffers, optimizer states): a state-dict tensor in
    one of them changes at the next step, so it must be copied before training goes on."""
    tensors = [*model.parameters(), *model.buffers()]
    for per_param in optimizer.state.values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return {_storage(p) for t in tensors for p in storage_tensors(t) if p.numel()}


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's share of the model and optimizer state, as a sharded checkpoint holds it.
    Before the first optimizer step (no state yet) AdamW's two moments are counted as fp32 copies of
    every parameter."""
    params = sum(p.numel() * p.element_size() for t in model.parameters() for p in storage_tensors(t))
    if optimizer.state:
        moments = sum(p.numel() * p.element_size() for per_param in optimizer.state.values()
                      for v in per_param.values() if isinstance(v, torch.Tensor) for p in storage_tensors(v))
    else:
        moments = 2 * sum(p.numel() * 4 for t in model.parameters() for p in storage_tensors(t))
    return params + moments


# ---- host memory ------------------------------------------------------------------------------------


@dataclasses.dataclass
class HostMemory:
    available: int  # bytes new allocations may take
    limit: int
    in_use: int
    source: str  # where the limit comes from, for the messages
    exact: bool  # False where the memory may grow beyond the limit seen (hot-plugged memory)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 says "max" for no limit


def _meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo's fields in bytes."""
    fields = {}
    for line in text.splitlines():
        if m := re.match(r"^(\w+):\s+(\d+)\s*kB", line):
            fields[m.group(1)] = int(m.group(2)) * 1024
    return fields


def _cgroup_limit(proc_cgroup: str, root: Path) -> tuple[int, int] | None:
    """(limit, unreclaimable usage) of this process's memory cgroup, if it has a limit (v2 or v1)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2
            folder = root / path.lstrip("/")
            limit, usage = _read_int(folder / "memory.max"), _read_int(folder / "memory.current")
            stat_name, reclaim_key = "memory.stat", "inactive_file"
        elif "memory" in controllers.split(","):  # v1
            folder = root / "memory" / path.lstrip("/")
            limit, usage = _read_int(folder / "memory.limit_in_bytes"), _read_int(folder / "memory.usage_in_bytes")
            stat_name, reclaim_key = "memory.stat", "total_inactive_file"
        else:
            continue
        if limit is None or usage is None or limit >= 1 << 60:  # no limit ("max", or v1's huge number)
            continue
        try:
            stat = dict(line.split() for line in (folder / stat_name).read_text().splitlines() if len(line.split()) == 2)
            reclaimable = int(stat.get(reclaim_key, 0))
        except (OSError, ValueError):
            reclaimable = 0
        return limit, max(0, usage - reclaimable)
    return None


def host_memory(*, proc: Path = Path("/proc"), sys_root: Path = Path("/sys")) -> HostMemory:
    """What this node's processes may still allocate, for the check at the start of a run.

    MemAvailable alone misleads in a VM whose memory grows as it is used (a balloon: MemTotal starts at
    a fraction of the VM's memory and rises as programs allocate). The kernel's memory blocks
    (/sys/devices/system/memory) still cover all of the VM's RAM, so the limit is the larger of those
    and MemTotal, less what is in use now (MemTotal - MemAvailable: page cache counts as free). A memory
    cgroup limit (a container, a Slurm job) wins where it is lower. Memory hot-plugged on demand
    (virtio-mem) shows no ceiling at all: then the result is marked inexact.
    """
    info = _meminfo((proc / "meminfo").read_text())
    total, available = info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    in_use = max(0, total - available)
    blocks = sys_root / "devices/system/memory"
    ram, source = total, "MemTotal"
    block_size = None
    try:
        block_size = int((blocks / "block_size_bytes").read_text().strip(), 16)
    except (OSError, ValueError):
        pass
    if block_size:
        online = 0
        for block in blocks.glob("memory[0-9]*"):
            try:
                online += (block / "state").read_text().strip() == "online"
            except OSError:
                continue
        if online * block_size > total:
            ram, source = online * block_size, "the RAM the kernel sees (memory blocks)"
    limit, used, exact = ram, in_use, True
    try:
        cgroup = _cgroup_limit((proc / "self/cgroup").read_text(), sys_root / "fs/cgroup")
    except OSError:
        cgroup = None
    if cgroup is not None and cgroup[0] - cgroup[1] < ram - in_use:
        limit, used, source = cgroup[0], cgroup[1], "the memory cgroup's limit"
    elif (sys_root / "bus/virtio/drivers/virtio_mem").is_dir() and any(
            p.name.startswith("virtio") for p in (sys_root / "bus/virtio/drivers/virtio_mem").iterdir()):
        exact = False
    return HostMemory(available=max(0, limit - used), limit=limit, in_use=used, source=source, exact=exact)


def check_host_memory(per_rank: int, env, *, what: str, advice: str = "set checkpoint.async_save=false",
                      shm_per_rank: int = 0) -> str:
    """Every rank: the host memory the ranks of each node will hold for a save (`per_rank` bytes each)
    against what that node can give, and the free space of /dev/shm against `shm_per_rank` (the process
    writer's arena). A CheckpointError (on every rank) where it cannot: at the start of the run, not an
    out-of-memory kill (or a SIGBUS in /dev/shm) at the first save. Returns the line to log."""
    from .checkpoint_format import CheckpointError

    here = socket.gethostname()
    try:
        mem = host_memory()
    except (OSError, KeyError, ValueError) as err:  # no /proc/meminfo (not Linux): nothing to compare with
        mem = None
        log.warning("cannot read this host's memory (%s): the checkpoint staging is not checked", err)
    shm_free = None
    if shm_per_rank and os.path.isdir("/dev/shm"):
        shm_free = shutil.disk_usage("/dev/shm").free
    rows = [None] * env.world_size
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
                    f"free ({host_mem.limit / 2**30:,.1f} GiB from {host_mem.source}, {host_mem.in_use / 2**30:,.1f} GiB "
                    f"in use)")
            if host_mem.exact:
                problem = f"{text}; {advice}, run fewer ranks per node, or use a node with more memory"
            elif host == here:
                log.warning("%s; this machine adds memory as it is used (virtio-mem), so going on", text)
    if problem is not None:
        raise CheckpointError(problem)
    first = rows[0]
    free = f"{format_size(first[2].available)} free" if first[2] else "host memory unknown"
    return f"{format_size(needed[first[0]])} on {first[0]} ({free})"


def format_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


# ---- staging -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StageStats:
    seconds: float = 0.0  # wall time of stage(), copies included
    copied: int = 0  # bytes copied into the arena
    passed: int = 0  # bytes the state dict had already put in host memory for this save (used as they are)
    allocated: int = 0  # arena bytes allocated during this call (the first save, or a changed layout)
    alloc_seconds: float = 0.0


class HostStaging:
    """Copies of a rank's state-dict tensors in one host arena that is allocated once and reused.

    `stage(state_dict, live=...)` returns a state dict of the same structure whose tensors DCP can
    write while training changes the originals: those that may be live (on the GPU, or sharing storage
    with the training state) are copied into the arena; host tensors made for this save pass as they
    are, except for the process writer (`share`), which gets every tensor through the one shared arena
    (each tensor shared on its own would cost a file descriptor and a copy into /dev/shm at every save);
    everything else (param_groups) is passed by value.
    """

    def __init__(self, *, pin: bool, share: bool):
        self.pin, self.share = pin, share
        self._raw: torch.Tensor | None = None  # the arena's memory, page-aligned
        self._registered: int | None = None  # pointer passed to cudaHostRegister
        self._layout: list | None = None
        self._wrappers: dict[tuple, torch.Tensor] = {}
        self.last = StageStats()

    @property
    def nbytes(self) -> int:
        return 0 if self._raw is None else self._raw.numel()

    def reserve(self, nbytes: int) -> float:
        """Allocate (and pin, or share) the arena now, at the start of the run: the first save then
        pays nothing for it, and a host that cannot give it fails here. Returns the seconds it took."""
        start = time.perf_counter()
        self._reserve(nbytes)
        return time.perf_counter() - start

    def _reserve(self, nbytes: int) -> None:
        self.close()
        raw = torch.empty(max(nbytes, 1) + _ALIGN, dtype=torch.uint8)
        if self.share:
            raw.share_memory_()  # one segment, mapped once by the writer process
        shift = (-raw.data_ptr()) % _ALIGN
        self._raw = raw[shift:shift + max(nbytes, 1)]
        if self.pin and nbytes:
            ptr = self._raw.data_ptr()
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
            if code == 0:
                self._registered = ptr
            else:
                log.warning("cannot pin the %.1f GiB checkpoint staging buffer (cudaHostRegister error %d): "
                            "copies from the GPU will be slower", nbytes / 2**30, code)

    @torch.no_grad()
    def stage(self, state_dict: dict, *, live: set[int]) -> dict:
        start = time.perf_counter()
        self.last = StageStats()
        leaves: list[tuple[tuple, torch.Tensor]] = []
        skeleton = self._split(state_dict, (), live, leaves)
        layout = [(path, type(t).__name__, [(p.shape, p.dtype) for p in storage_tensors(t)]) for path, t in leaves]
        if layout != self._layout:
            self._allocate(leaves)
            self._layout = layout
        on_gpu = False
        for path, t in leaves:
            for dst, src in zip(storage_tensors(self._wrappers[path]), storage_tensors(t)):
                dst.copy_(src, non_blocking=src.is_cuda)  # GPU -> pinned: queued on the current stream
                on_gpu |= src.is_cuda
                self.last.copied += src.numel() * src.element_size()
        if on_gpu:
            torch.cuda.current_stream().synchronize()  # the writer reads these bytes next
        staged = _fill(skeleton, self._wrappers)
        self.last.seconds = time.perf_counter() - start
        return staged

    def _split(self, obj: Any, path: tuple, live: set[int], leaves: list) -> Any:
        """The state dict with every tensor to copy replaced by its path (collected in `leaves`)."""
        if isinstance(obj, dict):
            return {k: self._split(v, (*path, k), live, leaves) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._split(v, (*path, i), live, leaves) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, torch.Tensor):
            parts = storage_tensors(obj)
            if not self.share and all(p.device.type == "cpu" and _storage(p) not in live for p in parts):
                self.last.passed += sum(p.numel() * p.element_size() for p in parts)
                return obj  # made for this save (FSDP1's offloaded pieces): already a private copy
            leaves.append((path, obj))
            return _Slot(path)
        return obj  # int, float, str, None: immutable

    def _allocate(self, leaves: list) -> None:
        """Lay the tensors out in the arena (reserved at the start, or grown here if it is too small)."""
        start = time.perf_counter()
        total = sum(_padded(p.numel() * p.element_size()) for _, t in leaves for p in storage_tensors(t))
        if self._raw is None or self._raw.numel() < total:
            if self._raw is not None:
                log.warning("checkpoint staging: the state needs %.2f GiB of host memory, %.2f GiB were reserved; "
                            "allocating it anew", total / 2**30, self._raw.numel() / 2**30)
            self._reserve(total)
            self.last.allocated = total
        arena, offset = self._raw, 0

        def place(like: torch.Tensor) -> torch.Tensor:
            nonlocal offset
            nbytes = like.numel() * like.element_size()
            view = arena[offset:offset + nbytes].view(like.dtype).view(like.shape)
            offset += _padded(nbytes)
            # A tensor of its own on the arena's storage, not a view of it: the process writer receives
            # it through shared memory, and views of the arena crash that transfer.
            return torch.empty(0, dtype=like.dtype).set_(view.untyped_storage(), view.storage_offset(), view.shape,
                                                          view.stride())

        self._wrappers = {path: _host_twin(t, place) for path, t in leaves}
        self.last.alloc_seconds = time.perf_counter() - start

    def close(self) -> None:
        """Unpin and release the arena (DCP must be done with it)."""
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self._raw, self._wrappers, self._layout = None, {}, None


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def arena_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The arena for a copy of this rank's whole state: state_bytes plus a page per tensor for alignment
    (AdamW: the parameter, two moments and a step per parameter)."""
    return state_bytes(model, optimizer) + 4 * _ALIGN * sum(1 for _ in model.parameters())


@dataclasses.dataclass(frozen=True)
class _Slot:
    path: tuple


def _fill(skeleton: Any, wrappers: dict) -> Any:
    if isinstance(skeleton, _Slot):
        return wrappers[skeleton.path]
    if isinstance(skeleton, dict):
        return {k: _fill(v, wrappers) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fill(v, wrappers) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_fill(v, wrappers) for v in skeleton)
    return skeleton


def _host_twin(t: torch.Tensor, place: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A tensor of t's kind and shape whose plain tensors (storage_tensors, same order) are arena memory
    from `place`. Tensor subclasses are rebuilt from twins of their inner tensors through the subclass's
    own flatten/unflatten protocol, so a DTensor stays a DTensor (its local part on the host, its mesh
    kept) and any wrapper inside it (FP8 weights, say) stays that wrapper: DCP then writes the staged
    state exactly as it would the original."""
    if hasattr(t, "local_shards"):  # FSDP1's ShardedTensor: no unflatten; a host copy, re-pointed at the arena
        host = t.to("cpu", copy=True)
        for shard, src in zip(host.local_shards(), t.local_shards()):
            mine = place(src.tensor)
            shard.tensor.set_(mine.untyped_storage(), mine.storage_offset(), mine.shape, mine.stride())
        return host
    if isinstance(t, DTensor) and not _is_wrapper_subclass(t.to_local()):
        # The common case, built as DTensor's own empty_like builds it: a DTensor rebuilt through unflatten
        # crashes the process writer's transfer to its process.
        host = torch.empty_like(t, device="cpu")
        mine = place(t.to_local())
        host.to_local().set_(mine.untyped_storage(), mine.storage_offset(), mine.shape, mine.stride())
        return host
    if _is_wrapper_subclass(t):
        names, context = t.__tensor_flatten__()
        inner = {name: getattr(t, name) for name in names}
        inner = {name: _host_twin(v, place) if isinstance(v, torch.Tensor) else v for name, v in inner.items()}
        twin = type(t).__tensor_unflatten__(inner, context, t.size(), t.stride())
        return twin.detach() if twin.requires_grad else twin  # a parameter's flags come along; a copy needs none
    return place(t)


# ---- the background write ----------------------------------------------------------------------------


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
    (NCCL, or gloo on the CPU) then never interleave with the writer's, whichever thread issues them.
    """

    def __init__(self, *, writer: str, timeout_s: float):
        if writer == "process" and not HAS_PROCESS_WRITER:
            log.warning("checkpoint.async_writer=process: this torch has no process writer; using a thread")
            writer = "thread"
        self.writer = writer
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
