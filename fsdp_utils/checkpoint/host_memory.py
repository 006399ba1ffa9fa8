"""What this node's processes may still allocate in host memory, and the check at the start of a run
that the checkpoint staging (asynchronous saves, FSDP1's offloaded sharded state dicts) fits there, so a
node too small stops with one line instead of an out-of-memory kill (or a SIGBUS in /dev/shm) at the first
save. Reads /proc and /sys (cgroups v1 and v2, memory blocks)."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import socket
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger(__name__)


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
            rows = [line.split() for line in (folder / stat_name).read_text().splitlines()]
            stat = dict(row for row in rows if len(row) == 2)
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
    from .format import CheckpointError

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


def format_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


