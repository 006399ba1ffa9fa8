"""The background write of an asynchronous sharded save: torch.distributed.checkpoint's `async_save` of a
state dict already staged in host memory (staging.py), in a thread of the training process or a process
of its own (`checkpoint.async_writer`), followed by this rank's checksums. The checkpoint manager commits
the save once every rank's write is done."""
from __future__ import annotations

import inspect
import logging
import os
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)

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
    (NCCL, or gloo on the CPU) then never interleave with the writer's, whichever thread issues them.
    """

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
