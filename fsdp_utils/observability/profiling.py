"""Profiles and memory snapshots of real training runs, as two components that Trainer.fit calls once per
step: `StepProfiler` (logging.profile_steps: a torch.profiler trace of chosen steps) and `MemorySnapshots`
(logging.memory_snapshot: the CUDA allocator's history, dumped at a chosen step and on out-of-memory).
Both write under the output directory, on the ranks logging.profile_ranks names, and log the paths. Their
folders are made level by level without following links (a link there is refused in one line), and each file
is written by torch into a new folder of its own, then renamed into place: a link planted at its name is
replaced, never written through.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint
from torch.profiler import ProfilerActivity, profile, record_function

from safe_io import nofollow

if TYPE_CHECKING:
    from config import LoggingConfig

log = logging.getLogger("train")


def _level(rank: int) -> int:
    return logging.INFO if rank == 0 else logging.WARNING  # the other ranks' logs show warnings only


def chosen_rank(ranks: str, rank: int) -> bool:
    """logging.profile_ranks: rank0 or all."""
    return ranks == "all" or rank == 0


def profile_path(out_dir: Path, *, start: int, end: int, rank: int) -> Path:
    # <dir>/<run>/<worker>.pt.trace.json is the layout TensorBoard's profiler plugin reads.
    return out_dir / "profile" / f"steps{start}-{end}" / f"rank{rank}.pt.trace.json"


def make_folders(base: Path, folder: Path) -> Path:
    """`folder` (below `base`), each level from base down made if missing; UnsafePath naming the first that is a
    link, or anything but a folder (a single mkdir with parents would create the lower levels through a link)."""
    path = base
    for name in folder.relative_to(base).parts:
        path = nofollow.make_dir(path / name)
    return path


def write_staged(path: Path, write: Callable[[str], object]) -> Path:
    """`path` written by `write(name)`, a writer that opens the file itself (the profiler's export, the
    allocator's dump): into a new folder made here beside it, then renamed to `path` (nofollow.replace: a link,
    FIFO or file there is replaced as itself, never opened; a folder is refused)."""
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=path.parent) as staging:
        staged = os.path.join(staging, path.name)
        write(staged)
        nofollow.replace(staged, path)
    return path


class StepProfiler:
    """Profiles training steps start..end (1-based, both included): the profiler starts after step start-1
    ends and stops after step end, each step inside a `train_step#N` range (the step, then its log line,
    evaluation and checkpoint save, if any), then writes a chrome trace (CPU ops, and CUDA kernels and
    memory copies on GPUs)."""

    def __init__(self, section: LoggingConfig, out_dir: Path, *, rank: int, device: torch.device, first_step: int):
        """section: logging.profile_steps and logging.profile_ranks."""
        steps = section.profile_steps
        self.prof: profile | None = None
        self.step_range: AbstractContextManager | None = None
        self.device, self.rank = device, rank
        self.start: int
        self.end: int
        self.start, self.end = steps if steps else (0, 0)
        self.path = profile_path(out_dir, start=self.start, end=self.end, rank=rank)
        self.out_dir = out_dir
        self.enabled = bool(steps) and chosen_rank(section.profile_ranks, rank)
        if self.enabled and first_step >= self.start:
            if rank == 0:
                log.warning("logging.profile_steps=%s: this run resumes after step %d, no profile is written",
                            steps, first_step)
            self.enabled = False
        if self.enabled:  # a link or a file in the way is refused now, not after the profiled steps
            make_folders(out_dir, self.path.parent)
        self.on_step_end(first_step)

    def on_step_end(self, step: int) -> None:
        """After training step `step` (0: before the first): start, advance or finish the profile."""
        if not self.enabled:
            return
        if self.prof is None:
            if step + 1 == self.start:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
                self.prof = profile(activities=activities, record_shapes=True)
                self.prof.start()
                self._enter_step(step + 1)
            return
        self._exit_step()
        if step >= self.end:
            self._finish()
        else:
            self._enter_step(step + 1)

    def _enter_step(self, step: int) -> None:
        self.step_range = record_function(f"train_step#{step}")
        self.step_range.__enter__()

    def _exit_step(self) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None

    def _finish(self) -> None:
        assert self.prof is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels end inside the trace
        self.prof.stop()
        prof, self.prof, self.enabled = self.prof, None, False
        make_folders(self.out_dir, self.path.parent)
        write_staged(self.path, prof.export_chrome_trace)
        log.log(_level(self.rank), "rank %d: profile of steps %d-%d written to %s", self.rank, self.start, self.end,
                self.path)

    def close(self) -> None:
        """At the end of fit(), also after an error: a profile in progress is written with what it has."""
        if self.prof is not None:
            self._exit_step()
            self._finish()


class MemorySnapshots:
    """Records the CUDA caching allocator's history (torch.cuda.memory._record_memory_history) from the
    start of training and dumps it as a pickle for pytorch.org/memory_viz: after step `at_step` and when
    a CUDA out-of-memory error is caught (on_oom, from the out-of-memory guard), into <output_dir>/memory/."""

    def __init__(self, section: LoggingConfig, out_dir: Path, *, rank: int, device: torch.device):
        """section: logging.memory_snapshot, memory_snapshot_step, memory_snapshot_max_entries, profile_ranks."""
        enabled = section.memory_snapshot
        self.out_dir, self.dir = out_dir, out_dir / "memory"
        self.at_step, self.rank = section.memory_snapshot_step, rank
        self.recording = enabled and chosen_rank(section.profile_ranks, rank) and device.type == "cuda"
        if enabled and device.type != "cuda" and rank == 0:
            log.warning("logging.memory_snapshot: the CUDA allocator's history exists only on GPUs; this %s run "
                        "records no memory snapshot", device.type)
        self.early_stop_off: AbstractContextManager | None = None
        if self.recording:
            make_folders(out_dir, self.dir)  # a link or a file in the way is refused before training starts
            torch.cuda.memory._record_memory_history(max_entries=section.memory_snapshot_max_entries)
            # Activation checkpointing stops a recomputation early by raising an exception from inside the
            # recomputed forward; when that happens inside a custom autograd Function (torchao's Float8
            # matmul), the Python stacks the allocator records as the tensors are freed lose the exception and
            # backward fails with "SystemError: ... returned NULL without setting an exception". Recomputing
            # each checkpointed block whole costs a little time and is exact.
            self.early_stop_off = torch.utils.checkpoint.set_checkpoint_early_stop(False)
            self.early_stop_off.__enter__()

    def on_step_end(self, step: int) -> None:
        if self.recording and step == self.at_step:
            self.dump(f"step{step}")

    def on_oom(self, step: int, phase: str) -> None:
        """Called while the out-of-memory error is being handled, before the failed step's tensors are freed."""
        if self.recording:
            self.dump(f"oom_step{step}_{phase}")

    def dump(self, tag: str) -> Path:
        path = make_folders(self.out_dir, self.dir) / f"{tag}_rank{self.rank}.pickle"
        write_staged(path, torch.cuda.memory._dump_snapshot)
        log.log(_level(self.rank), "rank %d: memory snapshot written to %s (open it at https://pytorch.org/memory_viz)",
                    self.rank, path)
        return path

    def close(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False
        if self.early_stop_off is not None:
            self.early_stop_off.__exit__(None, None, None)
            self.early_stop_off = None
