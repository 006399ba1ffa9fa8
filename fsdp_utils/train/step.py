"""One training step's forward and backward passes over its micro-batches, with gradient accumulation.

Shared by train_fsdp.py and scripts/benchmark.py, so the benchmark times exactly the training step.
"""
from __future__ import annotations

import contextlib

import torch


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
    return loss_sum
