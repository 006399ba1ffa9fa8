"""Process-group setup and teardown. The only place that reads the torchrun environment."""
from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_torchrun_env() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's variables; one process without them."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return rank, local_rank, world_size, local_world_size


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible")
    return torch.device("cuda", local_rank)


def init_distributed(*, device: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Start the process group: NCCL on CUDA, gloo on the CPU; the world is always initialised
    (a single process gets a world of one) so the loop has no special cases."""
    rank, local_rank, world_size, local_world_size = read_torchrun_env()
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # plain `python train_fsdp.py`: a world of one on this host
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistEnv(rank, local_rank, world_size, local_world_size, dev)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier(env: DistEnv) -> None:
    if env.device.type == "cuda":
        dist.barrier(device_ids=[env.device.index])
    else:
        dist.barrier()


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    # destroy_process_group does not stop a gloo group's worker threads while anything still holds the
    # group (FSDP state sits in reference cycles); a worker may then free its last work item during
    # interpreter shutdown, and taking the GIL there aborts the process ("terminate called without an
    # active exception", exit -6, now and then on the CPU). Collect those cycles now: the group is
    # destroyed and its threads joined while Python is still alive.
    gc.collect()
