"""The one training step: forward and backward over the micro-batches (gradients reduced as fsdp.grad_sync says),
unscaling (fp16), clipping over all shards, the loss and stop-flag all-reduce, the finiteness check, the spike
skipper's decision (train.skip_spikes) and the optimizer step (whose hooks run the model converters' post-step work,
e.g. FP8 scales).

The training loop, benchmarks/benchmark.py and the micro-batch search's trial steps all call `train_step`,
so what is timed and measured is what trains."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from model.loss import IGNORE_INDEX

from ..parallel.fsdp import FSDPAdapter
from .spikes import SpikeSkipper

log = logging.getLogger("train")

Batches = Iterator[tuple[Tensor, Tensor]]  # (inputs, targets) micro-batches, each (micro-batch, sequence)
Scaler = torch.amp.GradScaler  # fp16's loss scaling (FSDP's ShardedGradScaler)


def forward_backward(model: nn.Module, batches: Batches, scaler: Scaler | None, *, fsdp: FSDPAdapter,
                     grad_accum: int, world_size: int = 1, masked_targets: bool = False) -> Tensor:
    """Run grad_accum micro-batches, reducing gradients as fsdp.grad_sync says (fsdp.gradient_sync); return this
    rank's share of the step's loss (summed over the ranks, it is the global batch's mean loss times the world size).

    Every target counts (masked_targets False): each micro-batch's mean loss, over grad_accum. Targets may be
    IGNORE_INDEX (masked_targets, fine-tuning data): the step's loss is the sum over the global batch's trained
    targets divided by their number, all micro-batches and ranks together, so a micro-batch holding few of them
    weighs no more per token than one holding many. The count needs every micro-batch first: they are drawn
    up front (token ids only, small) and their counts all-reduced once."""
    if masked_targets:
        return _forward_backward_token_mean(model, batches, scaler, fsdp=fsdp, grad_accum=grad_accum,
                                            world_size=world_size)
    loss_sum = None
    for micro in range(grad_accum):
        x, y = next(batches)
        with fsdp.gradient_sync(model, last=micro == grad_accum - 1):
            loss = model(x, y) / grad_accum
            (scaler.scale(loss) if scaler else loss).backward()
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
    assert loss_sum is not None, "grad_accum must be at least 1"
    return loss_sum


def _forward_backward_token_mean(model: nn.Module, batches: Batches, scaler: Scaler | None, *, fsdp: FSDPAdapter,
                                 grad_accum: int, world_size: int) -> Tensor:
    micro_batches = [next(batches) for _ in range(grad_accum)]
    num_trained = torch.stack([(y != IGNORE_INDEX).sum() for _, y in micro_batches]).sum().float()
    dist.all_reduce(num_trained)
    # The gradient reduction averages over the ranks, hence the world size; a global batch with no trained
    # target at all (possible with tiny batches) gives a loss and gradients of 0, not NaN.
    scale = world_size / num_trained.clamp(min=1)
    loss_sum = torch.zeros((), device=num_trained.device)
    for micro, (x, y) in enumerate(micro_batches):
        with fsdp.gradient_sync(model, last=micro == grad_accum - 1):
            loss = model(x, y, loss_reduction="sum") * scale
            (scaler.scale(loss) if scaler else loss).backward()
        loss_sum = loss_sum + loss.detach().float()
    return loss_sum


class NonFiniteError(RuntimeError):
    """The loss or gradient norm stopped being finite."""


@dataclass
class StepResult:
    loss: Tensor  # mean over the ranks and micro-batches (0-dim, on the device)
    grad_norm: Tensor  # over all shards, before clipping
    applied: bool  # False: the loss or the gradient norm was not finite and the update was skipped
    stop_requested: bool  # some rank asked to stop (a signal); every rank sees the same
    skipped: bool = False  # the spike skipper held this finite step's update back
    skip_reason: str | None = None  # why, for the log
    skipped_steps: int | None = None  # the run's spike-skipped steps so far, resumes included; None: no skipper


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, *, fsdp: FSDPAdapter,
               grad_accum: int, grad_clip: float, world_size: int, scaler: Scaler | None = None,
               stop_requested: bool = False, masked_targets: bool = False,
               skipper: SpikeSkipper | None = None) -> StepResult:
    """One optimizer step on `grad_accum` micro-batches from `batches`. Every rank calls it together and
    reaches the same decision: the loss, the gradient norm and the stop flags are reduced over the ranks,
    and the step's one host sync reads them (a non-finite step is skipped everywhere). masked_targets: the
    targets may hold IGNORE_INDEX (see forward_backward). `skipper` (train.skip_spikes) decides from the values
    that sync reads whether the update is held back: the gradients are dropped, the optimizer state stays as
    it was; the caller moves the data and the schedule on as for any step."""
    loss_sum = forward_backward(model, batches, scaler, fsdp=fsdp, grad_accum=grad_accum, world_size=world_size,
                                masked_targets=masked_targets)
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = fsdp.clip_grad_norm(model, grad_clip)  # over all shards: already the same on every rank
    # One small collective a step: the loss (for the log and the finiteness check) and the stop flags.
    shared = torch.stack([loss_sum, torch.tensor(float(stop_requested), device=loss_sum.device)])
    dist.all_reduce(shared)
    loss = shared[0] / world_size
    # With a grad scaler an overflowing gradient is the scaler's business (it skips that step itself).
    finite = torch.isfinite(loss) if scaler is not None else torch.isfinite(loss) & torch.isfinite(grad_norm)
    # The step's one host sync, which the spike skipper's values ride on.
    is_finite, any_stop, loss_value, norm_value = torch.stack(
        [finite.float(), shared[1], loss, grad_norm.to(loss.device, torch.float32)]).tolist()
    if not is_finite:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, grad_norm, applied=False, stop_requested=any_stop > 0)
    result = StepResult(loss, grad_norm, applied=True, stop_requested=any_stop > 0)
    if skipper is not None:
        result.skipped = skipper.check(loss_value, norm_value)
        result.skip_reason, result.skipped_steps = skipper.reason, skipper.num_skipped
    if scaler is not None:
        if not result.skipped:
            scaler.step(optimizer)
        # Also after a skip: it ends the step's unscale_ record, and counts the finite gradients as any step's.
        scaler.update()
    elif not result.skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return result


class BadSteps:
    """train.max_bad_steps: a step with a non-finite loss or gradient norm was not applied (train_step skipped its
    update on every rank); up to `allowed` of them are skipped with a warning, the next one stops the run before
    its update (NonFiniteError), with no checkpoint written."""

    def __init__(self, allowed: int):
        self.allowed, self.seen = allowed, 0

    def check(self, result: StepResult, *, step: int) -> None:
        if result.applied:
            return
        self.seen += 1
        msg = f"non-finite loss ({result.loss.item()}) or gradient norm ({result.grad_norm.item()}) at step {step}"
        if self.seen > self.allowed:
            raise NonFiniteError(f"{msg}; stopping before the optimizer step, no checkpoint written "
                                 f"(train.max_bad_steps={self.allowed} allows skipping such steps)")
        log.warning("%s: skipping the update (%d of train.max_bad_steps=%d)", msg, self.seen, self.allowed)
