"""One place that builds a run from its config: the FSDP adapter of fsdp.version, the model with its converters and
activation checkpointing switch, parallelized, the optimizer, the precision and grad scaler, and the micro-batch plan.
train_fsdp.py, the benchmarks and the tests all build through `build_run`, so what they measure is what trains."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from config import Config

from ..distributed import DistEnv
from ..host_memory import host_memory
from ..parallel.build import build_model
from ..parallel.fsdp import FSDPAdapter, fsdp_adapter
from ..parallel.parallelize import CheckpointSwitch, Precision, model_converters, parallelize, resolve_precision
from .batch import BatchSplit
from .memory import MemoryProbe, memory_probe
from .microbatch import MicroBatchChoice, cache_key, resolve_micro_batch
from .optim import build_optimizer


def _host_free() -> int | None:
    """The bytes this host can still give, where that is known (Linux, without memory added on demand)."""
    try:
        memory = host_memory()
    except (OSError, KeyError, ValueError):  # no /proc/meminfo
        return None
    return memory.available if memory.exact else None


@dataclasses.dataclass
class BuiltRun:
    """What trains. `fsdp`: what differs between FSDP1 and FSDP2 (the step's gradient sync and clipping, the
    out-of-memory guard, the checkpoints' state-dict options); `checkpoint_switch`: set with
    fsdp.activation_checkpointing=auto, at the policy chosen with the micro-batch; `probe`: the GPU's memory readings
    (None on the CPU); `cache_key`: the micro-batch cache's key."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    fsdp: FSDPAdapter
    converters: list
    checkpoint_switch: CheckpointSwitch | None
    precision: Precision
    scaler: torch.amp.GradScaler | None
    probe: MemoryProbe | None
    cache_key: dict
    choice: MicroBatchChoice
    split: BatchSplit


def build_run(cfg: Config, env: DistEnv, *, vocab_size: int, model_signature: dict, eos_id: int | None,
              use_cache: bool = True, fused_matmul: bool | None = None, fused_adamw: bool = True,
              search_estimate: bool = True) -> BuiltRun:
    """The run of `cfg` on this rank, in the documented order: model, converters, parallelize (FSDP through the
    adapter of fsdp.version), optimizer (its hooks registered), then the micro-batch (searched with the optimizer
    state still empty). ConfigError when the batch does not split.

    `vocab_size`, `model_signature`: describe_model's; `eos_id`: the token separating documents (data.document_masking,
    model.reset_positions). `use_cache`: take train.micro_batch_size=auto's choice from the output directory's cache
    when it has one (training does; the benchmark measures afresh). `fused_matmul`: build_model's. `fused_adamw`:
    False for the multi-tensor AdamW; fp16 always gets that one, as the fused kernel does not accept the sharded grad
    scaler's inf flag. `search_estimate`: False for the micro-batch search without the estimate's order (the benchmark's
    comparison)."""
    t = cfg.train
    fsdp = fsdp_adapter(cfg.fsdp, env)
    precision = resolve_precision(t.precision, cfg.fsdp.reduce_dtype, env.device)
    # On the meta device when sharded; refused in one line where the weights cannot fit.
    built = build_model(cfg, env, fused_matmul=fused_matmul, eos_id=eos_id, host_free=_host_free())
    converters = model_converters(cfg)
    # fsdp.activation_checkpointing=auto: the policy is chosen with the micro-batch, below.
    switch = CheckpointSwitch() if cfg.fsdp.activation_checkpointing == "auto" else None
    model = parallelize(built.module, fsdp=fsdp, block_classes=built.block_classes, precision=precision,
                        compile=t.compile, init=built.init, converters=converters, checkpoint_switch=switch,
                        compile_tuning=t.compile_tuning)
    optimizer = build_optimizer(model, lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2),
                                fused=fused_adamw and not precision.use_grad_scaler)
    for converter in converters:
        converter.register(model, optimizer)  # post-step work runs inside optimizer.step()
    scaler = None
    if precision.use_grad_scaler:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler()
    probe = memory_probe(env.device, env.rank)
    key = cache_key(cfg, model_signature=model_signature, world_size=env.world_size,
                    gpu=probe.name if probe else "cpu", precision=precision.name)
    choice = resolve_micro_batch(cfg, env, model=model, optimizer=optimizer, fsdp=fsdp, vocab_size=vocab_size, key=key,
                                 probe=probe, switch=switch, use_cache=use_cache, use_estimate=search_estimate)
    split = BatchSplit.from_config(cfg.train, env.world_size, choice.micro_batch_size)
    for converter in converters:
        converter.use_accumulation(model, split.grad_accum)
        if choice.how == "search":  # the trial steps' weights were put back: their FP8 scales too
            converter.refresh(model)
    if probe is not None:
        probe.begin(split.micro_batch_size)  # the memory figures from here on are the training's
    return BuiltRun(model, optimizer, fsdp, converters, switch, precision, scaler, probe, key, choice, split)


def describe_run(cfg: Config, env: DistEnv, run: BuiltRun, *, train_tokens: int, val_tokens: int) -> list[str]:
    """The lines that say what trains: LoRA's share of the parameters, then the world, precision, sharding, batch
    split and activation checkpointing."""
    lines = []
    lora = cfg.train.lora
    if lora.rank > 0:
        # Counted over this rank's shards, so the share is the model's whatever the sharding.
        sizes = [(p.numel(), p.requires_grad) for p in run.model.parameters()]
        trainable, total = sum(n for n, g in sizes if g), sum(n for n, _ in sizes)
        lines.append(f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}: "
                     f"{100 * trainable / max(total, 1):.3f}% of the parameters train ({trainable:,} of {total:,} on "
                     f"this rank), the base is frozen in {str(run.precision.compute).replace('torch.', '')}")
    p, split = run.precision, run.split
    ac = run.checkpoint_switch.policy.name if run.checkpoint_switch else cfg.fsdp.activation_checkpointing
    lines.append(f"world size {env.world_size} on {env.device.type}, precision {p.name} (reduce "
                 f"{str(p.reduce).replace('torch.', '')}), {run.fsdp.describe()}, "
                 f"grad accumulation {split.grad_accum}, micro-batch {split.micro_batch_size}, activation "
                 f"checkpointing {ac}, train {train_tokens:,} tokens, val {val_tokens:,} tokens")
    return lines
