"""The GPU's memory figures that the micro-batch search and the out-of-memory guard read, the same on every rank."""
from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..distributed import DistEnv

GiB = 2**30


def gib(num_bytes: float) -> str:
    """Bytes as the log lines write them, in GiB."""
    return f"{num_bytes / GiB:.2f}"


class MemoryProbe:
    """This GPU's memory figures, from torch.cuda. `begin(micro_batch)` starts a phase run at that
    micro-batch (a trial step, or training): cached blocks are released and the peaks reset."""

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def capacity(self) -> int:
        """What this process can use: the free memory plus what its allocator holds already (other
        processes, the CUDA context and NCCL's buffers are outside both)."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device)

    def begin(self, micro_batch: int, checkpointing: str | None = None) -> None:
        """(`checkpointing`: the activation checkpointing policy of the phase, for the tests' probe.)"""
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def time(self, step: Callable[[], None], repeats: int = 2) -> float:
        """Seconds per call of `step`, on this GPU's clock (after the work queued before it)."""
        torch.cuda.synchronize(self.device)
        begin = time.perf_counter()
        for _ in range(repeats):
            step()
        torch.cuda.synchronize(self.device)
        return (time.perf_counter() - begin) / repeats

    def peak_reserved(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)


def memory_probe(device: torch.device, rank: int) -> MemoryProbe | None:
    """The GPU's figures; None on the CPU. (`rank`: for the tests' probe, which reads per-rank figures.)"""
    return MemoryProbe(device) if device.type == "cuda" else None


def max_over_ranks(value: float, env: DistEnv) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()

