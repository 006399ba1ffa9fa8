"""AdamW with weight decay on matrices only, the warmup-cosine schedule and global-norm clipping."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    fused: bool = True) -> torch.optim.AdamW:
    """Decay matrices (embeddings and projections), not norm weights. Needs the original parameters
    (FSDP2, or FSDP1 with use_orig_params=True): a flat parameter mixes both kinds.

    The split goes by the owning module, not by `param.ndim`: FSDP1 (use_orig_params) shows every
    sharded parameter as a 1-D view of its shard, so an ndim test would decay nothing on several
    ranks and the matrices on one, and the groups would differ with the world size."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        is_norm = isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("Norm")
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                (no_decay if is_norm or name == "bias" else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel is one launch for all parameters; it exists for CUDA tensors only (with CPU
    # offload the sharded parameters, and so the optimizer step, live in host memory).
    on_gpu = all(p.device.type == "cuda" for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused and on_gpu)


def lr_at(step: int, *, max_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine down to max_lr * min_lr_ratio.

    A pure function of the step, so resuming needs nothing but the step counter.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return max_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the gradient norm over all shards and ranks; return that norm (before clipping).

    FSDP1's own clip_grad_norm_ reduces the norm across ranks; for FSDP2 the DTensor gradients make the
    plain utility compute the global norm. max_norm <= 0 measures without clipping.
    """
    limit = max_norm if max_norm > 0 else float("inf")
    if isinstance(model, FSDP):
        return model.clip_grad_norm_(limit)
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], limit)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
