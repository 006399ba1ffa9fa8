"""What this node's processes may still allocate in host memory: read from /proc and /sys (cgroups v1 and v2,
memory blocks). The checkpoint staging's check (checkpoint/async_save.py) and the model's size check before it is
built read it."""
from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

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


def meminfo(text: str) -> dict[str, int]:
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
    info = meminfo((proc / "meminfo").read_text())
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


def format_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


