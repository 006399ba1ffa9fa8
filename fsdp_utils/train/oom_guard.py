"""What a training step or an evaluation that runs out of GPU memory does (report and stop, or redo it at half
the micro-batch), and the hint for runs that leave most of the GPU's memory unused."""
from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import DistEnv
from ..parallel.fsdp import FSDPAdapter
from .batch import BatchSplit
from .memory import MemoryProbe, gib, max_over_ranks

log = logging.getLogger(__name__)
T = TypeVar("T")


class OutOfMemory(RuntimeError):
    """A micro-batch does not fit: one line with the figures and what to change."""


# ---- the hint ------------------------------------------------------------------------------------


def memory_hint(probe: MemoryProbe | None, env: DistEnv, *, micro_batch: int, grad_accum: int) -> str | None:
    """A line for runs that use under a quarter of the GPU's memory while accumulating gradients. A
    collective (the peak is MAX-reduced): every rank calls it at the same step."""
    if probe is None or grad_accum <= 1:
        return None
    used, total = max_over_ranks(probe.peak_allocated(), env), probe.total()
    if used >= total / 4:
        return None
    return (f"hint: the first steps used at most {gib(used)} GiB of this GPU's {gib(total)} GiB with micro-batch "
            f"{micro_batch} and gradient accumulation {grad_accum}: a larger train.micro_batch_size (up to "
            f"{micro_batch * grad_accum}), or auto, would likely train faster on the same samples")


# ---- out of memory during training ---------------------------------------------------------------


class OutOfMemoryGuard:
    """Runs a training step or an evaluation; on a CUDA out-of-memory error it reports the figures and then stops
    (OutOfMemory, one line) or, with train.oom_retry_half, lets the caller redo the work at half the micro-batch.

    Memory is symmetric across ranks (same shapes, same shards), so an out-of-memory error normally happens on every
    rank at the same allocation. Before retrying, the ranks that caught one meet in a side gloo group, bounded by
    run.timeout_s: if only some ranks ran out (another process on one GPU), the others are already waiting in the step's
    next collective, the meeting times out, and the run stops with that said, as it would without the retry (never a
    silent mismatch of collectives)."""

    def __init__(self, env: DistEnv, *, fsdp: FSDPAdapter, probe: MemoryProbe | None, retry: bool, timeout_s: float,
                 compile: bool, on_oom: Callable[[int, str], None] | None = None):
        self.env, self.fsdp, self.probe, self.retry, self.compile = env, fsdp, probe, retry, compile
        self.on_oom = on_oom  # (step, phase): called while the error is handled, e.g. to dump a memory snapshot
        self.timeout_s = timeout_s
        # Created now, on every rank (creating a group is itself collective).
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) if retry else None

    def attempt(self, work: Callable[[], T], *, step: int, phase: str, split: BatchSplit, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> tuple[T | None, BatchSplit]:
        """(work(), split) normally; after an out-of-memory error that train.oom_retry_half recovered from:
        (None, the smaller split to redo it with)."""
        try:
            return work(), split
        except torch.OutOfMemoryError as err:
            report = self._report(err, step=step, phase=phase, split=split)
            if self.on_oom is not None:
                self.on_oom(step, phase)
        # Out of the except block: the interrupted step's tensors, held by the traceback, are freed now.
        return None, self._recover(report, step=step, phase=phase, split=split, model=model, optimizer=optimizer)

    def run(self, work: Callable[[], T], *, step: int, phase: str, split: Callable[[], BatchSplit],
            resplit: Callable[[BatchSplit], None], model: nn.Module, optimizer: torch.optim.Optimizer) -> T:
        """work() under the guard. After an out-of-memory error that train.oom_retry_half recovered from, the
        micro-batch is smaller from then on (`resplit` gets the new split; `split` reads the current one) and the
        work is done again: a training step on the same samples, an evaluation on the same sequences."""
        while True:
            current = split()
            result, smaller = self.attempt(work, step=step, phase=phase, split=current, model=model,
                                           optimizer=optimizer)
            if smaller == current:
                return result  # type: ignore[return-value]  # work() ran to the end: a T, not None
            resplit(smaller)

    def _report(self, err: BaseException, *, step: int, phase: str, split: BatchSplit) -> str:
        figures = "no GPU memory figures on the CPU"
        if self.probe is not None:
            figures = (f"{gib(self.probe.allocated())} GiB allocated, {gib(self.probe.reserved())} GiB reserved "
                       f"(peak {gib(self.probe.peak_allocated())} GiB allocated) of {gib(self.probe.total())} GiB")
        report = (f"out of memory at step {step} ({phase}, micro-batch {split.micro_batch_size} x accumulation "
                  f"{split.grad_accum}, rank {self.env.rank}): {figures}; {str(err).splitlines()[0]}")
        log.warning("%s", report)  # every rank that ran out says so, with its own figures
        return report

    def _recover(self, report: str, *, step: int, phase: str, split: BatchSplit, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> BatchSplit:
        smaller = split.halved()
        if not self.retry:
            raise OutOfMemory(f"{report}. Lower train.micro_batch_size (or set it to auto), turn on "
                              "fsdp.activation_checkpointing, or set train.oom_retry_half=true to redo such steps "
                              "at half the micro-batch")
        if smaller is None:
            raise OutOfMemory(f"{report}. Already at micro-batch 1: nothing smaller to retry with")
        try:
            dist.all_reduce(torch.ones(1), group=self.group)
        except RuntimeError as err:
            raise OutOfMemory(f"{report}. Not every rank ran out of memory (the others did not reach the retry within "
                              f"run.timeout_s={self.timeout_s:g} s: they are waiting in the step's next collective), "
                              f"so the step cannot be redone; stopping ({str(err).splitlines()[0]})") from None
        try:
            self.fsdp.end_interrupted_step(model)
        except AttributeError as err:  # FSDP's internals moved in this torch version
            raise OutOfMemory(f"{report}. Cannot end the interrupted step with torch {torch.__version__}'s FSDP "
                              f"({err}); stopping") from None
        optimizer.zero_grad(set_to_none=True)
        if self.compile:
            torch.compiler.reset()  # the new shape compiles static, not as a dynamic batch dimension
        if self.probe is not None:
            self.probe.begin(smaller.micro_batch_size)
        log.warning("train.oom_retry_half: redoing the %s of step %d with micro-batch %d (accumulation %d: the same "
                    "samples), and keeping that size for the rest of the run", phase, step, smaller.micro_batch_size,
                    smaller.grad_accum)
        return smaller

