"""The validation loss: a fixed set of validation sequences, whose loss does not depend on the micro-batch or the
world size."""
from __future__ import annotations

import torch
import torch.distributed as dist

from model.loss import IGNORE_INDEX

from ..distributed import DistEnv


@torch.no_grad()
def evaluate(model, val_data, *, num_samples: int, micro_batch: int, env: DistEnv) -> float:
    """Mean validation loss per trained target over the first num_samples sequences of the validation set: their
    summed loss over the number of their targets that are not IGNORE_INDEX, so the same sequences give the same
    loss at any micro-batch and world size. Rank r takes micro-batches r, r + W, ...; every rank runs the same
    number of forward passes (FSDP needs them all), rows past num_samples (the end of a last, partial micro-batch,
    or a whole one for a rank past the end) have every target IGNORE_INDEX: computed, never counted."""
    model.eval()
    try:
        num_batches = -(-num_samples // micro_batch)
        total = torch.zeros(2, dtype=torch.float64, device=env.device)  # summed loss, trained targets
        for first in range(0, num_batches, env.world_size):
            k = first + env.rank
            start = min(k, num_batches - 1) * micro_batch
            x, y = val_data.batch(start, micro_batch)
            y[max(0, num_samples - start) if k < num_batches else 0:] = IGNORE_INDEX
            x, y = x.to(env.device), y.to(env.device)
            loss = model(x, y, loss_reduction="sum").double()
            total += torch.stack([loss, (y != IGNORE_INDEX).sum().double()])
        dist.all_reduce(total)
    finally:
        model.train()
    return total[0].item() / max(total[1].item(), 1.0)
