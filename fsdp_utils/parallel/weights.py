"""How a model built on the meta device gets its weights once sharded (the `WeightInit` interface that a run calls after
the wrap), the record of a built model, and the error for a model too large for its memory. Its own module, so that the
builders of our model (build.py) and of Hugging Face models (hf.py) share it without importing each other."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class WeightInit:
    """How a model built on the meta device gets its weights, whichever FSDP version shards it."""

    def init_module(self, module: nn.Module, device: torch.device) -> None:
        """FSDP1's param_init_fn: allocate (and fill) one module's own tensors before FSDP1 shards them."""
        raise NotImplementedError

    def init_sharded(self, model: nn.Module, device: torch.device) -> None:
        """After sharding: allocate what is still on the meta device (FSDP2 shards), fill every weight."""
        raise NotImplementedError


@dataclass
class BuiltModel:
    module: nn.Module
    block_classes: set[type]  # the units of activation checkpointing, compile and FSDP wrapping
    init: WeightInit | None  # None: the weights are real already


GiB = 2**30


class ModelMemoryError(RuntimeError):
    """The model does not fit the memory it is built in: one line with its size, the memory free and what to change."""


def too_large(shape: str, needed: int, free: int, where: str, parts: str, hint: str) -> ModelMemoryError:
    """The one line for fp32 weights (`shape`: the model, `parts`: how `needed` adds up) that `free` cannot hold."""
    return ModelMemoryError(f"the model ({shape}) needs {needed / GiB:,.1f} GiB of {where} for its fp32 weights "
                            f"alone{parts}, {free / GiB:,.1f} GiB free; {hint}")
