"""The optimizer of train.optimizer (AdamW, or Muon with AdamW: muon.py) with weight decay on matrices only, and the
learning-rate schedules (warmup, then cosine, WSD or constant)."""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..parallel.fsdp import FSDPAdapter
from .muon import MuonAdamW, sharding_problem, split_parameters

if TYPE_CHECKING:
    from config import TrainConfig


def decay_split(model: nn.Module, leave_out: Collection[nn.Parameter] = ()) -> tuple[list[nn.Parameter],
                                                                                  list[nn.Parameter]]:
    """The trainable parameters (those in `leave_out` aside) as (decay, no_decay): matrices (embeddings and
    projections) decay, norm weights and biases do not. Needs the original parameters (FSDP2, or FSDP1 with
    use_orig_params=True): a flat parameter mixes both kinds.

    The split goes by the owning module, not by `param.ndim`: FSDP1 (use_orig_params) shows every
    sharded parameter as a 1-D view of its shard, so an ndim test would decay nothing on several
    ranks and the matrices on one, and the groups would differ with the world size."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = {id(p) for p in leave_out}
    for module in model.modules():
        is_norm = isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("Norm")
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                (no_decay if is_norm or name == "bias" else decay).append(param)
    return decay, no_decay


@dataclass(frozen=True)
class MuonSettings:
    """train.optimizer=muon: the blocks whose linear layers' weights Muon trains (ours, or a Hugging Face model's
    decoder layers), the FSDP adapter that sharded them, Muon's hyperparameters and the Newton-Schulz dtype."""
    blocks: Sequence[nn.Module]
    fsdp: FSDPAdapter
    momentum: float = 0.95
    ns_steps: int = 5
    ns_dtype: torch.dtype = torch.bfloat16


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    fused: bool = True, muon: MuonSettings | None = None) -> torch.optim.Optimizer:
    """AdamW on decay_split's two groups; with `muon`, MuonAdamW: Muon on the blocks' weight matrices (decayed
    alike), AdamW on the rest as decay_split divides it. ValueError where Muon cannot run on the sharded matrices."""
    # The fused kernel is one launch for all parameters; it exists for CUDA tensors only (with CPU
    # offload the sharded parameters, and so the optimizer step, live in host memory).
    fused = fused and all(p.device.type == "cuda" for p in model.parameters() if p.requires_grad)
    if muon is None:
        decay, no_decay = decay_split(model)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)
    split = split_parameters(model, muon.blocks)
    if problem := sharding_problem(muon.fsdp, split.matrices):
        raise ValueError(problem)
    decay, no_decay = decay_split(model, leave_out=split.matrices)
    muon_groups = [{"params": split.matrices, "use_muon": True, "weight_decay": weight_decay},
                   {"params": decay, "use_muon": False, "weight_decay": weight_decay},
                   {"params": no_decay, "use_muon": False, "weight_decay": 0.0}]
    return MuonAdamW(muon_groups, lr=lr, weight_decay=weight_decay, momentum=muon.momentum, ns_steps=muon.ns_steps,
                     betas=betas, fused=fused, row_splits=split.row_splits, ns_dtype=muon.ns_dtype)


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate as a pure function of the optimizer step and the config, nothing else: a resumed
    run, given the step it saved, continues the curve exactly, and a run whose train.max_steps grew on
    resume follows the new curve from there (no scheduler object whose state could drift).

    Every schedule warms up linearly over `warmup_steps`, then:
      cosine: half a cosine from max_lr down to the floor at max_steps;
      wsd: stable at max_lr, then the final `decay_steps` (train.decay_fraction of max_steps) decay to the
           floor (linear or 1-sqrt), the last step at the floor exactly;
      constant: max_lr to the end.
    The floor is max_lr * min_lr_ratio (train.min_lr given: min_lr / max_lr as that ratio)."""

    kind: str = "cosine"
    max_lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    max_steps: int = 1
    decay_steps: int = 1
    decay_shape: str = "linear"

    @classmethod
    def from_config(cls, t: TrainConfig) -> LRSchedule:
        """From the `train` section (config.TrainConfig)."""
        return cls(kind=t.lr_schedule, max_lr=t.lr, min_lr_ratio=t.resolved_min_lr_ratio, warmup_steps=t.warmup_steps,
                   max_steps=t.resolved_max_steps, decay_steps=t.wsd_decay_steps, decay_shape=t.decay_shape)

    @property
    def decay_start(self) -> int:
        """wsd: the first step (0-based) of the decay; it moves with max_steps."""
        return self.max_steps - self.decay_steps

    def describe(self) -> str:
        warmup = f"linear warmup over {self.warmup_steps} steps, then " if self.warmup_steps else ""
        floor = self.max_lr * self.min_lr_ratio
        if self.kind == "constant":
            return f"{warmup}constant {self.max_lr:g}"
        if self.kind == "wsd":
            return (f"{warmup}wsd: {self.max_lr:g} until step {self.decay_start}, then a {self.decay_shape} decay to "
                    f"{floor:g} at step {self.max_steps}")
        return f"{warmup}cosine from {self.max_lr:g} to {floor:g} at step {self.max_steps}"

    def jump(self, step: int, lr: float | None) -> str | None:
        """Why a resume at `step`, whose last step ran at `lr`, would see the learning rate jump: this schedule gives
        that step another rate (a changed train.lr, warmup, schedule or train.max_steps; for wsd, a larger
        max_steps after the decay had begun takes the run back up to its stable phase). None when it continues."""
        if lr is None or step == 0:
            return None  # saved before checkpoints recorded the learning rate
        now = self(step - 1)
        if math.isclose(now, lr, rel_tol=1e-9, abs_tol=0.0):
            return None
        msg = (f"the schedule does not continue the checkpoint's: step {step} ran at lr {lr:.6g}, which this run's "
               f"train.* settings give as {now:.6g}, so the learning rate jumps")
        if self.kind == "wsd" and lr < self.max_lr and now > lr and step <= self.decay_start:
            msg += (f". The checkpoint was taken during its WSD decay; with train.max_steps={self.max_steps} the decay "
                    f"begins after step {self.decay_start}, so the run goes back to its stable phase. To finish the "
                    f"decay, resume with the train.max_steps it was saved under; to extend a WSD run, resume from a "
                    f"checkpoint taken before its decay began")
        return msg

    def __call__(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.max_lr
        if self.kind == "wsd":
            if step < self.decay_start:
                return self.max_lr
            progress = min(1.0, (step - self.decay_start + 1) / (self.max_steps - self.decay_start))
            remaining = 1.0 - (progress if self.decay_shape == "linear" else math.sqrt(progress))
            return self.max_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * remaining)
        progress = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return self.max_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

