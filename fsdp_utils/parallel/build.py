"""Build the model a run trains, ours or a Hugging Face causal LM, before any sharding.

A multi-rank run builds on the meta device (no rank ever holds the full fp32 model) and returns with it
a `WeightInit` that `parallelize` calls to materialise the weights once they are sharded.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from model import DecoderBlock, ModelConfig, Transformer, initial_value
from model.transformer import chunk_loss_and_grad

from ..distributed import DistEnv
from . import hf
from .weights import BuiltModel, WeightInit


def build_model(cfg, env: DistEnv) -> BuiltModel:
    """The model of `cfg.model` (our Transformer or model.type=hf), unsharded, on the meta device when
    it will be sharded over several ranks."""
    if cfg.model.type == "hf":
        return hf.build_for_sharding(cfg, env)
    f = cfg.fsdp
    use_meta = f.meta_init and env.world_size > 1 and not f.sync_module_states
    with torch.device("meta" if use_meta else env.device):
        model = Transformer(cfg.model)
    if not use_meta:
        model.init_weights(cfg.run.seed)
    model.loss_chunk_tokens = cfg.train.loss_chunk_tokens
    if cfg.train.compile:
        # The per-chunk softmax work of the chunked loss, compiled into a couple of kernels.
        model.chunk_loss_fn = torch.compile(chunk_loss_and_grad, dynamic=False)
    return BuiltModel(model, {DecoderBlock}, SeededInit(model, cfg.model, seed=cfg.run.seed) if use_meta else None)


class SeededInit(WeightInit):
    """Every parameter's initial value is a pure function of (seed, name) (`initial_value`), so module by
    module (FSDP1) or shard by shard (FSDP2) gives exactly the weights of a direct build."""

    def __init__(self, model: Transformer, cfg: ModelConfig, *, seed: int):
        self.model, self.cfg, self.seed = model, cfg, seed
        self.names = {module: name for name, module in model.named_modules()}

    @torch.no_grad()
    def init_module(self, module: nn.Module, device: torch.device) -> None:
        module.to_empty(device=device, recurse=False)
        prefix = self.names[module]
        for pname, param in module.named_parameters(recurse=False):
            full_name = f"{prefix}.{pname}" if prefix else pname
            param.copy_(initial_value(self.cfg, full_name, tuple(param.shape), seed=self.seed, device=device,
                                      dtype=param.dtype))
        if module is self.model:
            self.model.reset_buffers()

    @torch.no_grad()
    def init_sharded(self, model: nn.Module, device: torch.device) -> None:
        if not any(p.is_meta for p in model.parameters()):
            return  # FSDP1 filled every module through init_module
        model.to_empty(device=device)
        for name, param in model.named_parameters():
            full = initial_value(self.cfg, name, tuple(param.shape), seed=self.seed, device=device, dtype=param.dtype)
            if isinstance(param, DTensor):
                param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
            else:
                param.copy_(full)
        self.model.reset_buffers()
