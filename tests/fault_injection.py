"""Test-only faults for real training jobs, kept out of the production code.

`tests/train_with_faults.py` runs train_fsdp.py with the faults of the JSON object in FSDP_TEST_FAULTS
installed, by wrapping production functions in the training process (`install`). Faults:
- "stage_fail": [steps]: staging an asynchronous save of those steps fails (0: the staging tried at
  the start of the run);
- "write": {"step": K (optional: every save), "delay_s": S, "fail": bool}: the background write of the
  save at step K sleeps S seconds first, then fails on every rank if "fail";
- "sync_write_fail": [steps]: a synchronous DCP write of those steps fails (the fallback of a failed
  background write, or a synchronous save);
- "disk_free_bytes": N: the checkpoint manager sees N bytes free on the output directory's disk.
"""
from __future__ import annotations

import errno
import functools
import re
import shutil
import time

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

ENV = "FSDP_TEST_FAULTS"
_STEP_RE = re.compile(r"cpt(\d+)$")


def _step_of(checkpoint_id) -> int | None:
    match = _STEP_RE.search(str(checkpoint_id))
    return int(match.group(1)) if match else None


class FaultyWriter(FileSystemWriter):
    """DCP's file writer, slowed down or failing inside the write. A module-level class: the process
    writer receives it pickled and imports this module."""

    def __init__(self, path: str, *, delay_s: float, fail: bool):
        super().__init__(path)
        self.delay_s, self.fail = delay_s, fail

    def write_data(self, plan, planner):
        time.sleep(self.delay_s)
        if self.fail:
            raise OSError(errno.EIO, "injected write failure (test hook)")
        return super().write_data(plan, planner)


def install(spec: dict) -> None:
    from fsdp_utils.checkpoint import staging
    from fsdp_utils.checkpoint.async_save import AsyncSaver

    current = {"step": 0}  # the step of the save being staged; 0 before any (the start-of-run staging)

    if "stage_fail" in spec:
        failing = set(spec["stage_fail"])
        real_start, real_stage = AsyncSaver.start, staging.HostStaging.stage

        @functools.wraps(real_start)
        def start(self, model, optimizer, state):
            current["step"] = state.step
            return real_start(self, model, optimizer, state)

        @functools.wraps(real_stage)
        def stage(self, state_dict, *, live):
            if current["step"] in failing:
                raise RuntimeError(f"injected staging failure at step {current['step']} (test hook)")
            return real_stage(self, state_dict, live=live)

        AsyncSaver.start, staging.HostStaging.stage = start, stage

    if "write" in spec:
        fault = spec["write"]
        real_async_save = dcp.async_save

        @functools.wraps(real_async_save)
        def faulty_async_save(state_dict, **kwargs):
            if fault.get("step") in (None, _step_of(kwargs["checkpoint_id"])):
                kwargs["storage_writer"] = FaultyWriter(kwargs["checkpoint_id"], delay_s=fault.get("delay_s", 0),
                                                        fail=fault.get("fail", False))
            return real_async_save(state_dict, **kwargs)

        dcp.async_save = faulty_async_save

    if "sync_write_fail" in spec:
        failing_sync = set(spec["sync_write_fail"])
        real_save = dcp.save

        @functools.wraps(real_save)
        def faulty_save(state_dict, **kwargs):
            if _step_of(kwargs.get("checkpoint_id")) in failing_sync:
                raise OSError(errno.EIO, "injected synchronous write failure (test hook)")
            return real_save(state_dict, **kwargs)

        dcp.save = faulty_save

    if "disk_free_bytes" in spec:
        from fsdp_utils.checkpoint import base

        free = spec["disk_free_bytes"]

        class _Shutil:  # the disk-space check's view of shutil: the same, but for disk_usage
            def __getattr__(self, name):
                return getattr(shutil, name)

            @staticmethod
            def disk_usage(path):
                real = shutil.disk_usage(path)
                return type(real)(real.total, real.total - free, free)

        base.shutil = _Shutil()
