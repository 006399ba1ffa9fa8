"""One place that builds a run from its config, in three calls in the documented order: `build` (the FSDP adapter of
fsdp.version, the model, on the meta device when sharded, its converters, activation checkpointing, compile), the
adapter's `wrap` (its auto-wrap policy and MixedPrecision given at the call), then `finish` (the weights materialised,
the optimizer after FSDP2's fully_shard, the grad scaler, the micro-batch plan). train_fsdp.py's set_up makes the
three calls itself; the benchmarks and the tests through `build_run`, so what they measure is what trains
(tests/test_architecture.py holds the two wraps alike)."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from config import Config, ConfigError

from ..distributed import DistEnv
from ..host_memory import host_memory
from ..parallel.build import build_model
from ..parallel.fsdp import FSDPAdapter, fsdp_adapter
from ..parallel.parallelize import CheckpointSwitch, Precision, model_converters, prepare_blocks, resolve_precision
from ..parallel.weights import WeightInit
from .batch import BatchSplit
from .memory import MemoryProbe, memory_probe
from .microbatch import MicroBatchChoice, cache_key, resolve_micro_batch
from .optim import MuonSettings, build_optimizer
from .spikes import SpikeSkipper


def _host_free() -> int | None:
    """The bytes this host can still give, where that is known (Linux, without memory added on demand)."""
    try:
        memory = host_memory()
    except (OSError, KeyError, ValueError):  # no /proc/meminfo
        return None
    return memory.available if memory.exact else None


@dataclasses.dataclass
class Parts:
    """What `build` makes, before FSDP: the model (on the meta device when it will be sharded: `init` materialises
    it), the adapter and the module classes it makes units of, the precision, the converters, and the switch of
    fsdp.activation_checkpointing=auto (its policy chosen with the micro-batch)."""
    model: nn.Module
    fsdp: FSDPAdapter
    units: set[type[nn.Module]]
    precision: Precision
    init: WeightInit | None
    converters: list
    checkpoint_switch: CheckpointSwitch | None


@dataclasses.dataclass
class BuiltRun(Parts):
    """What trains: the Parts with the wrapped model (`fsdp` serves the step, the out-of-memory guard and the
    checkpoints), its optimizer, the grad scaler, the GPU's memory readings (`probe`, None on the CPU), the micro-batch
    cache's key, the micro-batch choice, the batch split and the spike skipper."""
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    probe: MemoryProbe | None
    cache_key: dict
    choice: MicroBatchChoice
    split: BatchSplit
    skipper: SpikeSkipper | None = None  # train.skip_spikes: train_step's, saved in checkpoints


def build(cfg: Config, env: DistEnv, *, eos_id: int | None, fused_matmul: bool | None = None) -> Parts:
    """The model of `cfg` on this rank up to FSDP: built (refused in one line where its weights cannot fit), then its
    converters, activation checkpointing and compile. `eos_id`: the token separating documents
    (data.document_masking, model.reset_positions); `fused_matmul`: build_model's."""
    fsdp = fsdp_adapter(cfg.fsdp, env)
    built = build_model(cfg, env, fused_matmul=fused_matmul, eos_id=eos_id, host_free=_host_free())
    blocks = [m for m in built.module.modules() if type(m) in built.block_classes]
    converters = model_converters(cfg)
    switch = CheckpointSwitch() if cfg.fsdp.activation_checkpointing == "auto" else None
    prepare_blocks(blocks, cfg.fsdp, converters=converters, checkpoint_switch=switch, compile=cfg.train.compile,
                   compile_tuning=cfg.train.compile_tuning)
    return Parts(built.module, fsdp, fsdp.units(built.module, blocks),
                 resolve_precision(cfg.train.precision, cfg.fsdp.reduce_dtype, env.device), built.init, converters,
                 switch)


def finish(cfg: Config, env: DistEnv, parts: Parts, model: nn.Module, *, vocab_size: int, model_signature: dict,
           use_cache: bool = True, fused_adamw: bool = True, use_estimate: bool = True) -> BuiltRun:
    """The run of the wrapped `model`: its weights materialised, the optimizer (its hooks registered), the grad scaler,
    then the micro-batch (searched with the optimizer state still empty); ConfigError when the batch does not split.
    `use_cache`: take train.micro_batch_size=auto's choice from the output directory's cache (the benchmark measures
    afresh). `fused_adamw`: False for the multi-tensor AdamW, which fp16 always gets (the fused kernel does not
    accept the sharded grad scaler's inf flag). `use_estimate`: False for the micro-batch search without the estimate's
    order (the benchmark's comparison)."""
    t, fsdp, precision, converters = cfg.train, parts.fsdp, parts.precision, parts.converters
    if parts.init is not None:  # with CPU offload the sharded parameters live in host memory
        parts.init.init_sharded(model, torch.device("cpu") if fsdp.offload else env.device)
    try:
        optimizer = build_optimizer(model, lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2),
                                    fused=fused_adamw and not precision.use_grad_scaler,
                                    muon=_muon_settings(cfg, env, parts, model))
    except ValueError as err:  # Muon on matrices it cannot take (the config's checks refuse FSDP1 before)
        raise ConfigError([str(err)]) from None
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
                                 probe=probe, switch=parts.checkpoint_switch, use_cache=use_cache,
                                 use_estimate=use_estimate)
    split = BatchSplit.from_config(cfg.train, env.world_size, choice.micro_batch_size)
    for converter in converters:
        converter.use_accumulation(model, split.grad_accum)
        if choice.how == "search":  # the trial steps' weights were put back: their FP8 scales too
            converter.refresh(model)
    if probe is not None:
        probe.begin(split.micro_batch_size)  # the memory figures from here on are the training's
    skipper = SpikeSkipper(window=t.spike_window, sigmas=t.spike_sigmas,
                           min_values=min(SpikeSkipper.MIN_VALUES, t.spike_window)) if t.skip_spikes else None
    return BuiltRun(**{**vars(parts), "model": model}, optimizer=optimizer, scaler=scaler, probe=probe, cache_key=key,
                    choice=choice, split=split, skipper=skipper)


def _muon_settings(cfg: Config, env: DistEnv, parts: Parts, model: nn.Module) -> MuonSettings | None:
    """train.optimizer=muon's settings: the blocks of the wrapped model (FSDP2 shards them in place), Newton-Schulz
    in bf16 on GPUs and in fp32 on the CPU, where bf16 matmuls are emulated and slow, and where fp32 keeps a
    sharded run equal to one process's to float rounding."""
    t = cfg.train
    if t.optimizer != "muon":
        return None
    blocks = [m for m in model.modules() if isinstance(m, tuple(parts.units))]
    return MuonSettings(blocks, parts.fsdp, momentum=t.muon_momentum, ns_steps=t.muon_ns_steps,
                        ns_dtype=torch.bfloat16 if env.device.type == "cuda" else torch.float32)


def build_run(cfg: Config, env: DistEnv, *, vocab_size: int, model_signature: dict, eos_id: int | None,
              use_cache: bool = True, fused_matmul: bool | None = None, fused_adamw: bool = True,
              search_estimate: bool = True) -> BuiltRun:
    """The run of `cfg` on this rank: build, wrap and finish as train_fsdp.py's set_up calls them."""
    parts = build(cfg, env, eos_id=eos_id, fused_matmul=fused_matmul)
    model = parts.fsdp.wrap(parts.model, auto_wrap_policy=ModuleWrapPolicy(parts.units),
                            mixed_precision=MixedPrecision(param_dtype=parts.precision.compute,
                                                           reduce_dtype=parts.precision.reduce),
                            compile=cfg.train.compile, init=parts.init)
    return finish(cfg, env, parts, model, vocab_size=vocab_size, model_signature=model_signature, use_cache=use_cache,
                  fused_adamw=fused_adamw, use_estimate=search_estimate)


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
