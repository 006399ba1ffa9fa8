"""Build the model a run trains, ours or a Hugging Face causal LM, before any sharding.

A multi-rank run builds on the meta device (no rank ever holds the full fp32 model) and returns with it
a `WeightInit` that materialises the weights once they are sharded (train/build_run.py finish)."""
from __future__ import annotations

import dataclasses
import logging
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention.flex_attention import flex_attention

from config import Config, ConfigError, FSDPConfig, ModelSection
from config.checks import float8_size_problem
from model import DecoderBlock, Documents, ModelConfig, Transformer, initial_value
from model.float8_projection import FLOAT8_ALIGNMENT, Float8Projection, chunk_loss_and_float8_grad, float8_e4m3
from model.loss import chunk_loss_and_grad

from ..distributed import DistEnv, agree
from . import hf
from .lora import apply_lora
from .parallelize import compile_options, resolve_precision
from .weights import BuiltModel, GiB, ModelMemoryError, WeightInit, too_large

log = logging.getLogger("train")


def build_model(cfg: Config, env: DistEnv, *, fused_matmul: bool | None = None, eos_id: int | None = None,
                host_free: int | None = None) -> BuiltModel:
    """The model of `cfg.model` (our Transformer or model.type=hf), unsharded, on the meta device when it will be
    sharded over several ranks, with train.lora's adapters when set (the base then frozen in the compute dtype).
    `fused_matmul` (our model): one matmul per fused q/k/v and gate/up weight instead of one per slice; by default
    exactly when LoRA adapts those layers (an adapter adds to the layer's output). FP8 runs either way: its modules
    compute their slices themselves (parallel/float8.py). `eos_id`: the tokenizer's EOS, which separates documents;
    needed with data.document_masking or model.reset_positions. `host_free`: the bytes this host can still give, if
    known: the model's weights are checked against it (on the CPU; a GPU's free memory is read here) before anything is
    allocated (a Hugging Face model's once its meta-device skeleton tells its size). A collective with several ranks."""
    agree(env, _memory_problem(cfg, env, host_free=host_free))
    documents = model_documents(cfg, eos_id)
    base_dtype = resolve_precision(cfg.train.precision, cfg.fsdp.reduce_dtype, env.device).compute
    if cfg.model.type == "hf":
        # Sized from config.json first (a skeleton of many layers alone is slow to build), then exactly once
        # transformers has built the meta-device skeleton, before any allocation.
        agree(env, _hf_size_problem(cfg.model, env, host_free=host_free))
        built = hf.build_for_sharding(cfg, env, eos_id=documents.eos_id if documents else None)
        agree(env, _hf_memory_problem(cfg, env, cast(hf.CausalLMAdapter, built.module), host_free=host_free))
        if env.is_main:  # its parameters are counted now, from the skeleton
            log.info("%s", hf_summary(cfg.model, cast(hf.CausalLMAdapter, built.module)))
        return apply_lora(built, cfg, base_dtype=base_dtype)
    return apply_lora(_build_ours(cfg, env, fused_matmul, documents), cfg, base_dtype=base_dtype)


def builds_on_meta(f: FSDPConfig, env: DistEnv) -> bool:
    """Whether our model is built on the meta device and materialised shard by shard (fsdp.meta_init and
    fsdp.sync_module_states decide, with the world size)."""
    return f.meta_init and env.world_size > 1 and not f.sync_module_states


def _shape(m: ModelConfig) -> str:
    return f"dim {m.dim}, {m.n_layers} layers, ffn {m.hidden_dim}, vocab {m.vocab_size}: {m.num_params():,} parameters"


def _memory_problem(cfg: Config, env: DistEnv, *, host_free: int | None) -> ModelMemoryError | None:
    """ModelMemoryError when our model's fp32 weights alone cannot fit where this rank builds them: all of
    them (a direct build) or its share (on the meta device, sharded over the world), times the ranks of this
    host on the CPU. A lower bound of what training needs, so it refuses only what cannot work."""
    m = cfg.model
    on_meta = builds_on_meta(cfg.fsdp, env)
    # With fsdp.cpu_offload the shards of a meta-device build live in host memory, not on the GPU.
    if m.type != "llama" or (on_meta and env.device.type == "cuda" and cfg.fsdp.cpu_offload):
        return None
    weights = m.num_params() * 4
    share = -(-weights // env.world_size) if on_meta else weights
    free: int | None
    if env.device.type == "cuda":
        needed, free, where = share, torch.cuda.mem_get_info(env.device)[0], f"{env.device} memory"
    else:
        needed, free, where = share * env.local_world_size, host_free, "host memory"
    if free is None or needed <= free:
        return None
    ranks = f" ({env.local_world_size} ranks x {share / GiB:,.1f} GiB)" if needed != share else ""
    if on_meta or env.world_size == 1:
        hint = (f"use a smaller model, or more {_more(env)}: with several ranks the weights are built on the meta "
                f"device and sharded")
    else:
        hint = "set fsdp.meta_init: true and fsdp.sync_module_states: false so that each rank holds only its shard"
    return too_large(_shape(m), needed, free, where, ranks, hint)


def _more(env: DistEnv) -> str:
    return "GPUs" if env.device.type == "cuda" else "nodes"


def _hf_size_problem(m: ModelSection, env: DistEnv, *, host_free: int | None) -> Exception | None:
    """hf.size_problem on this rank: rank 0 reads the weight files and holds the full copy, on its host."""
    try:
        hf_config = hf.load_hf_config(m)
    except hf.HFModelError as err:
        return err
    return hf.size_problem(m, hf_config, host_free=host_free if env.rank == env.local_rank else None,
                           weights=env.is_main)


def _hf_memory_problem(cfg: Config, env: DistEnv, model: hf.CausalLMAdapter, *,
                       host_free: int | None) -> ModelMemoryError | None:
    """_memory_problem for a Hugging Face model (`model`: its meta-device skeleton), which every rank holds a
    share of; rank 0 also reads all of its fp32 weights into host memory to broadcast them (hf.Rank0Weights)."""
    n_params = sum(p.numel() for p in model.parameters())  # tied weights once
    weights = n_params * 4
    share = -(-weights // env.world_size)
    shape = hf.describe_size(cfg.model, model.lm.config, n_params)
    if env.device.type == "cuda" and not cfg.fsdp.cpu_offload:
        free = torch.cuda.mem_get_info(env.device)[0]
        if share > free:
            return too_large(shape, share, free, f"{env.device} memory", "", "use a smaller model, or more GPUs")
    # torchrun numbers ranks host by host: rank 0 is on the host whose local ranks start at 0.
    copy = weights if env.rank == env.local_rank else 0
    shards = share * env.local_world_size if env.device.type == "cpu" or cfg.fsdp.cpu_offload else 0
    if host_free is None or copy + shards <= host_free:
        return None
    n = env.local_world_size
    parts = [f"rank 0's full copy of {copy / GiB:,.1f} GiB"] if copy else []
    parts += [f"{n} shard{'s' if n > 1 else ''} of {share / GiB:,.1f} GiB"] if shards else []
    hint = ("use a smaller model: rank 0 reads all of its weights" if copy > host_free
            else f"use a smaller model, or more {_more(env)}")
    return too_large(shape, copy + shards, host_free, "host memory", f" ({' and '.join(parts)})", hint)


def _float8_projection(cfg: Config, options: dict | None) -> Float8Projection:
    """train.float8_output's functions, compiled with train.compile; the vocabulary (known now) checked."""
    if cfg.model.vocab_size % FLOAT8_ALIGNMENT:  # taken from the tokenizer (a set one is checked with the config)
        raise ConfigError([float8_size_problem("model.vocab_size (the tokenizer's)", cfg.model.vocab_size)])
    if not cfg.train.compile:
        return Float8Projection()
    return Float8Projection(cast=torch.compile(float8_e4m3, dynamic=False, options=options),
                            chunk_loss=torch.compile(chunk_loss_and_float8_grad, dynamic=False, options=options))


def _build_ours(cfg: Config, env: DistEnv, fused_matmul: bool | None, documents: Documents | None) -> BuiltModel:
    use_meta = builds_on_meta(cfg.fsdp, env)
    fused = cfg.train.lora.rank > 0 if fused_matmul is None else fused_matmul
    # The per-chunk softmax work of the chunked loss, compiled into a couple of kernels with train.compile.
    options = compile_options(cfg.train.compile_tuning)
    chunk_loss_fn = torch.compile(chunk_loss_and_grad, dynamic=False, options=options) if cfg.train.compile else None
    float8_projection = _float8_projection(cfg, options) if cfg.train.float8_output else None
    # FlexAttention (document masking) compiled on GPUs: uncompiled, it materialises every score.
    flex_fn = (torch.compile(flex_attention, dynamic=False, options=options)
               if documents and env.device.type == "cuda" else None)
    model, error = None, None
    try:
        with torch.device("meta" if use_meta else env.device):
            model = Transformer(cfg.model, fused_matmul=fused, loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                                chunk_loss_fn=chunk_loss_fn, float8_projection=float8_projection, documents=documents,
                                flex_attention_fn=flex_fn)
        if not use_meta:
            model.init_weights(cfg.run.seed)
    except (MemoryError, RuntimeError) as err:  # the CPU allocator's refusal is a plain RuntimeError
        if not isinstance(err, (MemoryError, torch.OutOfMemoryError)) and "allocate" not in str(err):
            raise
        reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        error = ModelMemoryError(f"the model ({_shape(cfg.model)}) could not be allocated on {env.device} "
                                 f"({reason}); use a smaller model or more ranks")
    agree(env, error)
    assert model is not None
    return BuiltModel(model, {DecoderBlock}, SeededInit(model, cfg.model, seed=cfg.run.seed) if use_meta else None)


def model_documents(cfg: Config, eos_id: int | None) -> Documents | None:
    """What the model does at document boundaries (data.document_masking, model.reset_positions); None: nothing."""
    if not (cfg.data.document_masking or cfg.model.reset_positions):
        return None
    assert eos_id is not None, "document masking and reset positions need the tokenizer's EOS id"
    return Documents(eos_id=eos_id, mask_attention=cfg.data.document_masking,
                     reset_positions=cfg.model.reset_positions)


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


def describe_model(cfg: Config, tokenizer_vocab: int) -> tuple[int, dict, float]:
    """(vocabulary size, shape signature stored in checkpoints, training FLOPs per token) of the model."""
    if cfg.model.type == "hf":
        hf_config = hf.load_hf_config(cfg.model)
        # FLOPs as for the same dimensions of our model (Llama-style layers), for the MFU figure.
        shape = ModelConfig(vocab_size=hf_config.vocab_size, dim=hf_config.hidden_size,
                            n_layers=hf_config.num_hidden_layers, n_heads=hf_config.num_attention_heads,
                            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                            ffn_hidden_dim=hf_config.intermediate_size)
        return hf_config.vocab_size, hf.config_signature(hf_config), shape.flops_per_token(cfg.data.seq_len)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer_vocab
    plain = ModelConfig(**{f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(ModelConfig)})
    return plain.vocab_size, dataclasses.asdict(plain), plain.flops_per_token(cfg.data.seq_len)


def log_parameter_summary(model_cfg: ModelConfig) -> None:
    n_total = model_cfg.num_params()
    n_embed = model_cfg.vocab_size * model_cfg.dim * (1 if model_cfg.tie_embeddings else 2)
    per_block = (n_total - n_embed - model_cfg.dim) // model_cfg.n_layers
    log.info("model: %s parameters (%s without embeddings), %d blocks of %s, dim %d, heads %d/%d kv, ffn %d, vocab %d",
             f"{n_total:,}", f"{n_total - n_embed:,}", model_cfg.n_layers, f"{per_block:,}", model_cfg.dim,
             model_cfg.n_heads, model_cfg.num_kv_heads, model_cfg.hidden_dim, model_cfg.vocab_size)


def hf_summary(model_cfg: ModelSection, model: hf.CausalLMAdapter) -> str:
    """The model line of a Hugging Face model, as log_parameter_summary's of ours: its parameters (tied weights
    once), its class and folder, and the sizes of its config.json."""
    lm = model.lm
    n_total = sum(p.numel() for p in lm.parameters())
    embeddings = {id(m.weight): m.weight.numel() for m in (lm.get_input_embeddings(), lm.get_output_embeddings())
                  if m is not None}
    text = lm.config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    sizes = {"layers": getattr(text, "num_hidden_layers", None), "hidden": getattr(text, "hidden_size", None),
             "heads": heads and f"{heads}/{getattr(text, 'num_key_value_heads', None) or heads} kv",
             "ffn": getattr(text, "intermediate_size", None), "vocab": getattr(text, "vocab_size", None)}
    shape = ", ".join(f"{value} layers" if key == "layers" else f"{key} {value}" for key, value in sizes.items()
                      if value is not None)
    tied = ", tied embeddings" if len(embeddings) == 1 and getattr(lm.config, "tie_word_embeddings", False) else ""
    return (f"model: {n_total:,} parameters ({n_total - sum(embeddings.values()):,} without embeddings), "
            f"{type(lm).__name__} from {model_cfg.hf_path or model_cfg.hf_config}: {shape}{tied}")
