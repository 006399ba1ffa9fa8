"""Process-group setup and teardown. The only place that reads the torchrun environment."""
from __future__ import annotations

import datetime
import gc
import os
import time
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from config.numbers import integer_in


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


@dataclass(frozen=True)
class Launch:
    """How this process was started: its place in the world, and what torchrun provides."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    under_torchrun: bool  # torchrun's agent watches this process (and stops it when another rank fails)
    agent_store: tuple[str, int] | None  # torchrun's own TCPStore, which it shares with the workers
    # An elastic job (FSDP_ELASTIC=1, set by scripts/fsdp_multi_node.sh with a MIN:MAX node range): torchrun
    # restarts the workers at another world size when nodes leave or join (fsdp_utils/guards/elastic.py).
    elastic: bool = False


def _env_int(name: str, default: int, *, low: int = 0, high: int = 2**31 - 1) -> int:
    """A whole number from the environment (torchrun's, or set by hand); ValueError in one line naming it."""
    text = os.environ.get(name)
    if text is None:
        return default
    if (value := integer_in(text, low, high)) is None:
        raise ValueError(f"{name}={text} is not a whole number from {low} to {high} (torchrun sets it; unset it to "
                         "run one process)")
    return value


def read_torchrun_env() -> Launch:
    """This process's place from torchrun's variables; one process without them. ValueError naming a variable
    that is not a whole number."""
    world_size = _env_int("WORLD_SIZE", 1, low=1)
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return Launch(
        rank=_env_int("RANK", 0),
        local_rank=_env_int("LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", world_size, low=1),
        under_torchrun="TORCHELASTIC_RUN_ID" in os.environ,
        agent_store=(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0, low=1, high=65535)) if shared else None,
        elastic="TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("FSDP_ELASTIC") == "1",
    )


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
    launch = read_torchrun_env()
    dev = pick_device(device, launch.local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = None
        if launch.agent_store is not None:
            store = _attempt_store(launch, timeout)
        elif "MASTER_ADDR" not in os.environ:  # plain `python train_fsdp.py`: a world of one on this host
            # The store binds a port the system picks as it binds: a port found free first and bound later
            # may be taken in between by another process on the host (address already in use).
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout, wait_for_workers=False)
            _publish_store("127.0.0.1", store.port)
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            store=store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistEnv(launch.rank, launch.local_rank, launch.world_size, launch.local_world_size, dev)


# The key in torchrun's store under which rank 0 publishes its own store's address; every attempt overwrites it.
_STORE_ADDRESS_KEY = "fsdp_lm/attempt_store"


def _attempt_store(launch: Launch, timeout: datetime.timedelta) -> dist.Store:
    """A store of this attempt's own for the process group, hosted by rank 0 on a free port.

    Since torch 2.5 torchrun shares its TCPStore with the workers, and it outlives a --max-restarts
    restart: restarted workers then read the previous attempt's keys (peers' addresses) and fail to
    connect or hang (pytorch/pytorch#135712). The restart count cannot key the attempt on several nodes:
    each node's agent counts only its own restarts. Instead rank 0 starts a fresh store and publishes its
    address through torchrun's store; another rank that reads a previous attempt's address finds nobody
    there (all of that attempt's workers were stopped before this one started) and reads again.
    """
    assert launch.agent_store is not None, "called only under a torchrun that shares its store"
    host, port = launch.agent_store
    agent = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if launch.rank == 0:
        store = dist.TCPStore(host, 0, launch.world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        agent.set(_STORE_ADDRESS_KEY, f"{host}:{store.port}")
        _publish_store(host, store.port)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        address = agent.get(_STORE_ADDRESS_KEY).decode()  # waits for the first attempt's rank 0
        store_host, store_port = address.rsplit(":", 1)
        try:
            store = dist.TCPStore(store_host, int(store_port), launch.world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=2))
        except (RuntimeError, OSError):  # DistNetworkError / DistStoreError: a previous attempt's address
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        store.set_timeout(timeout)
        _publish_store(store_host, int(store_port))
        return store


def _publish_store(host: str, port: int) -> None:
    """MASTER_ADDR:MASTER_PORT name the process group's own store from now on, for what joins it later (the
    process checkpoint writer's group, fsdp_utils/checkpoint/async_save.py). Under torchrun that is this attempt's
    store, not torchrun's: that one outlives a restart and would hand a restarted job's writers the previous
    attempt's keys."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)


def barrier(env: DistEnv) -> None:
    if env.device.type == "cuda":
        dist.barrier(device_ids=[env.device.index])
    else:
        dist.barrier()


T = TypeVar("T")


def agree(env: DistEnv, error: Exception | None) -> None:
    """Raise on every rank the first rank's error, if any rank had one (a collective: every rank calls it,
    with None where it had no error). The error travels as its class and message, so the same class is
    raised everywhere; it must be importable (module level) and built from its message alone."""
    if env.world_size == 1:  # its own error: no process group needed
        if error is not None:
            raise error
        return
    errors: list = [None] * env.world_size
    dist.all_gather_object(errors, None if error is None else (type(error), str(error)))
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        kind, message = first
        raise kind(message)


def broadcast_decision(env: DistEnv, value: T) -> T:
    """Rank 0's `value` on every rank (a collective): rank 0 decides, every rank follows. Other ranks'
    values are ignored; pass None there."""
    box: list = [value if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    # destroy_process_group does not stop a gloo group's worker threads while anything still holds the
    # group (FSDP state sits in reference cycles); a worker may then free its last work item during
    # interpreter shutdown, and taking the GIL there aborts the process ("terminate called without an
    # active exception", exit -6, now and then on the CPU). Collect those cycles now: the group is
    # destroyed and its threads joined while Python is still alive.
    gc.collect()


ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def prefer_expandable_segments() -> None:
    """Let the CUDA caching allocator grow segments in place (expandable_segments) unless the user configured
    it: with fixed segments, blocks of the many sizes a step frees (activations of each micro-batch size the
    search tries, gathered weights, gradient buckets) fragment the cache, and reserved memory, which is what
    runs out, stays gigabytes above what is allocated. Read when CUDA starts: call it before anything touches
    the GPU. Both names are set: torch reads the newer one, older releases the other."""
    if not any(name in os.environ for name in ALLOCATOR_VARIABLES):
        for name in ALLOCATOR_VARIABLES:
            os.environ[name] = "expandable_segments:True"
