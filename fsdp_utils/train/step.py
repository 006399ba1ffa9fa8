"""The one training step: forward and backward over the micro-batches (gradients reduced after the last),
unscaling (fp16), clipping over all shards, the loss and stop-flag all-reduce, the finiteness check and
the optimizer step (whose hooks run the model converters' post-step work, e.g. FP8 scales).

The training loop, scripts/benchmark.py and the micro-batch search's trial steps all call `train_step`,
so what is timed and measured is what trains.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .optim import clip_grad_norm


def no_grad_sync(model, enabled: bool):
    """Skip the gradient reduce-scatter on non-final micro-steps (FSDP1 no_sync / FSDP2 requires_gradient_sync)."""
    if hasattr(model, "no_sync"):
        return model.no_sync() if enabled else contextlib.nullcontext()
    model.set_requires_gradient_sync(not enabled)  # FSDP2: set before every micro-step, so the last one syncs
    return contextlib.nullcontext()


def forward_backward(model, batches, scaler, *, grad_accum: int) -> torch.Tensor:
    """Run grad_accum micro-batches, reducing gradients only after the last; return this rank's mean loss."""
    loss_sum = None
    for micro in range(grad_accum):
        x, y = next(batches)
        with no_grad_sync(model, enabled=micro < grad_accum - 1):
            loss = model(x, y) / grad_accum
            (scaler.scale(loss) if scaler else loss).backward()
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
    assert loss_sum is not None, "grad_accum must be at least 1"
    return loss_sum


@dataclass
class StepResult:
    loss: torch.Tensor  # mean over the ranks and micro-batches (0-dim, on the device)
    grad_norm: torch.Tensor  # over all shards, before clipping
    applied: bool  # False: the loss or the gradient norm was not finite and the update was skipped
    stop_requested: bool  # some rank asked to stop (a signal); every rank sees the same


def train_step(model, optimizer, batches, *, grad_accum: int, grad_clip: float, world_size: int, scaler=None,
               stop_requested: bool = False) -> StepResult:
    """One optimizer step on `grad_accum` micro-batches from `batches`. Every rank calls it together and
    reaches the same decision: the loss, the gradient norm and the stop flags are reduced over the ranks,
    and the step's one host sync reads them (a non-finite step is skipped everywhere)."""
    loss_sum = forward_backward(model, batches, scaler, grad_accum=grad_accum)
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(model, grad_clip)  # already the same on every rank
    # One small collective a step: the loss (for the log and the finiteness check) and the stop flags.
    shared = torch.stack([loss_sum, torch.tensor(float(stop_requested), device=loss_sum.device)])
    dist.all_reduce(shared)
    loss = shared[0] / world_size
    # With a grad scaler an overflowing gradient is the scaler's business (it skips that step itself).
    finite = torch.isfinite(loss) if scaler is not None else torch.isfinite(loss) & torch.isfinite(grad_norm)
    is_finite, any_stop = torch.stack([finite.float(), shared[1]]).tolist()
    if not is_finite:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, grad_norm, applied=False, stop_requested=any_stop > 0)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, grad_norm, applied=True, stop_requested=any_stop > 0)
