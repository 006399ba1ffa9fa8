"""LoRA (train.lora): low-rank adapters on the blocks' linear layers, the base model frozen (docs/training.md).

Each adapted linear layer gets a child module `lora` (a `LoRAAdapter`) and a forward hook that adds its output,
y = x W^T + (alpha / r) * B A dropout(x), for every chosen slice of the layer's output: our fused wqkv and w13 get one
(A, B) pair per slice, exactly PEFT's on q_proj, k_proj, ... of the exported model. The base weights keep their names,
so a base checkpoint or Hugging Face folder loads as it is; checkpoints hold only the adapters and a reference to the
base. A ~ N(0, 1/r^2) (PEFT's "gaussian"), B = 0: the model equals its base at step 0. The base is frozen in the
compute dtype, the adapters are fp32 (each an FSDP1 unit of its own: a unit is one flat tensor of one dtype)."""
from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .weights import BuiltModel, WeightInit

if TYPE_CHECKING:
    from config import Config, LoRAConfig, ModelSection

# Canonical target name -> the Hugging Face (Llama, Qwen2, Mistral, ...) module name.
HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
            "down": "down_proj"}
# The canonical target names, one per projection of a Llama-style block, and the groups train.lora.targets may
# name instead (the config accepts exactly these names: config.sections.LoRATarget).
PROJECTIONS = tuple(HF_NAMES)
GROUPS = {"attention": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down"), "all": PROJECTIONS}
# Bytes read from the start and the end of each base weights file for its fingerprint.
_SAMPLE_BYTES = 1 << 20


class LoRAAdapter(nn.Module):
    """The low-rank update of chosen output slices of one linear layer: forward(x) is the delta to add to
    the layer's output (..., out_features), zero outside the slices.

    lora_A: (num_slices * r, in_features), the slices' A matrices stacked; lora_B: (sum of slice sizes, r),
    their B matrices stacked."""

    def __init__(self, in_features: int, out_features: int, slices: list[tuple[int, int]], *, rank: int,
                 alpha: float, dropout: float, device=None, names: list[str] | None = None):
        super().__init__()
        self.out_features, self.slices, self.rank = out_features, slices, rank  # slices: (start, size), ascending
        self.names = names or [""] * len(slices)  # each slice's target (q, k, ...): the export's PEFT names
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Parameter(torch.empty(len(slices) * rank, in_features, device=device))
        self.lora_B = nn.Parameter(torch.empty(sum(size for _, size in slices), rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(self.dropout(x), self.lora_A.to(x.dtype))  # (..., num_slices * r)
        b = self.lora_B.to(x.dtype)
        if len(self.slices) == 1 and self.slices[0] == (0, self.out_features):
            return F.linear(h, b) * self.scale
        pieces, at, row = [], 0, 0
        for i, (start, size) in enumerate(self.slices):
            if start > at:  # an output range without adapter
                pieces.append(x.new_zeros(*x.shape[:-1], start - at))
            pieces.append(F.linear(h[..., i * self.rank:(i + 1) * self.rank], b[row:row + size]))
            at, row = start + size, row + size
        if at < self.out_features:
            pieces.append(x.new_zeros(*x.shape[:-1], self.out_features - at))
        return torch.cat(pieces, dim=-1) * self.scale

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """The update as a weight (out_features, in_features), for merging: scale * B A per slice."""
        a, b = self.lora_A.float(), self.lora_B.float()
        delta = torch.zeros(self.out_features, a.shape[1], dtype=torch.float32, device=a.device)
        row = 0
        for i, (start, size) in enumerate(self.slices):
            delta[start:start + size] = b[row:row + size] @ a[i * self.rank:(i + 1) * self.rank]
            row += size
        return delta * self.scale


def _add_adapter_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + cast(LoRAAdapter, module.lora)(args[0])


def _output_requires_grad(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    # The frozen embedding's output would need no gradient, and then neither would the first block's
    # input: FSDP1 reshards a frozen unit after backward from a hook on its inputs' gradients, and a
    # NO_SHARD unit left alone keeps plain tensors where its parameters were.
    return output.requires_grad_() if torch.is_grad_enabled() and not output.requires_grad else output


def adapter_initial_value(name: str, shape: tuple[int, ...], *, rank: int, seed: int, device=None) -> torch.Tensor:
    """An adapter parameter's initial value, a pure function of (seed, name, shape): A normal with std 1/r,
    B zero. The same whether the model was built directly or on the meta device and sharded."""
    if name.endswith("lora_B"):
        return torch.zeros(shape, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape, device=device).normal_(0.0, 1.0 / rank, generator=generator)


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # names of PROJECTIONS, groups written out


def lora_targets(names: Sequence[str]) -> list[str]:
    """train.lora.targets with the groups written out, in PROJECTIONS order."""
    chosen = {t for name in names for t in GROUPS.get(name, (name,))}
    return [t for t in PROJECTIONS if t in chosen]


def settings_of(lora: LoRAConfig) -> LoRASettings | None:
    """train.lora as settings, or None when it is off."""
    if lora.rank <= 0:
        return None
    return LoRASettings(lora.rank, float(lora.alpha), float(lora.dropout), tuple(lora_targets(lora.targets)))


def _our_slices(module: nn.Module, leaf: str, targets: tuple[str, ...]) -> list[tuple[str, tuple[int, int]]]:
    """The chosen output slices of one of our model's linear layers (named `leaf` in its parent)."""
    from model.transformer import Attention, FeedForward

    if isinstance(module, Attention) and leaf == "wqkv":
        q, kv = module.n_heads * module.head_dim, module.n_kv_heads * module.head_dim
        parts = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
    elif isinstance(module, Attention) and leaf == "wo":
        parts = {"o": (0, module.wo.out_features)}
    elif isinstance(module, FeedForward) and leaf == "w13":
        parts = {"gate": (0, module.hidden_dim), "up": (module.hidden_dim, module.hidden_dim)}
    elif isinstance(module, FeedForward) and leaf == "w2":
        parts = {"down": (0, module.w2.out_features)}
    else:
        return []
    return [(t, parts[t]) for t in parts if t in targets]


def adapted_layers(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, nn.Linear, list]]:
    """(name, linear layer, [(target, (start, size)) of each chosen output slice]) of every layer that gets
    an adapter: our model's wqkv/wo/w13/w2, or a Hugging Face model's q_proj ... down_proj (whole outputs)."""
    hf_leaves = {HF_NAMES[t]: t for t in targets}
    found = []
    for parent_name, parent in model.named_modules():
        for leaf, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            slices = _our_slices(parent, leaf, targets)
            if not slices and leaf in hf_leaves:
                slices = [(hf_leaves[leaf], (0, child.out_features))]
            if slices:
                found.append((f"{parent_name}.{leaf}" if parent_name else leaf, child, slices))
    return found


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRAAdapter) for m in model.modules())


def attach_adapters(model: nn.Module, settings: LoRASettings, *, seed: int, base_dtype: torch.dtype) -> int:
    """Freeze the model (base weights cast to `base_dtype`, in place: tied weights stay tied) and give the
    chosen layers adapters, fp32 and trainable; returns how many layers. On the meta device the adapters
    stay unallocated (LoRAInit fills them once sharded), otherwise they get their initial values now."""
    for param in model.parameters():
        param.requires_grad_(False)
        if param.is_floating_point() and param.dtype != base_dtype:
            param.data = param.data.to(base_dtype)
    layers = adapted_layers(model, settings.targets)
    if not layers:
        raise ValueError(f"train.lora.targets={list(settings.targets)}: no such linear layer in this model "
                         f"(our wqkv/wo/w13/w2, or a Hugging Face model's {', '.join(HF_NAMES.values())})")
    for name, linear, slices in layers:
        adapter = LoRAAdapter(linear.in_features, linear.out_features, [s for _, s in slices], rank=settings.rank,
                              alpha=settings.alpha, dropout=settings.dropout, device=linear.weight.device,
                              names=[t for t, _ in slices])
        if not linear.weight.is_meta:
            with torch.no_grad():
                for pname, param in adapter.named_parameters():
                    param.copy_(adapter_initial_value(f"{name}.lora.{pname}", tuple(param.shape), rank=settings.rank,
                                                      seed=seed, device=param.device))
        linear.lora = adapter
        linear.register_forward_hook(_add_adapter_output)
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None:
        embedding.register_forward_hook(_output_requires_grad)
    return len(layers)


def adapters_of(model: nn.Module) -> list[tuple[str, nn.Module, LoRAAdapter]]:
    """(layer name, layer, its adapter) of every adapted layer of an unwrapped model."""
    return [(name, m, m.lora) for name, m in model.named_modules() if isinstance(getattr(m, "lora", None), LoRAAdapter)]


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base's state dict with every adapter merged into its layer's weight (fp32: W + scale * B A per
    slice), the adapters' own tensors left out: a plain model of the same kind loads it."""
    merged = {name: t.float() for name, t in model.state_dict().items() if ".lora." not in f".{name}"}
    for name, layer, adapter in adapters_of(model):
        merged[f"{name}.weight"] = cast(torch.Tensor, layer.weight).float() + adapter.delta_weight()
    return merged


class LoRAInit(WeightInit):
    """The base model's own WeightInit (our seeded init, or a Hugging Face model's weights from rank 0),
    then the adapters' initial values, given as a full state dict that every rank computes alike."""

    def __init__(self, inner: WeightInit, model: nn.Module, *, rank: int, seed: int):
        self.inner, self.model, self.rank, self.seed = inner, model, rank, seed
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
        self.adapter_parts = {m for a in model.modules() if isinstance(a, LoRAAdapter) for m in a.modules()}

    def init_module(self, module: nn.Module, device: torch.device) -> None:
        if module in self.adapter_parts:
            module.to_empty(device=device, recurse=False)  # the values come in init_sharded
        else:
            self.inner.init_module(module, device)

    @torch.no_grad()
    def init_sharded(self, model: nn.Module, device: torch.device) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self.inner.init_sharded(model, device)
        values: dict[str, Any] = {
            name: adapter_initial_value(name, shape, rank=self.rank, seed=self.seed, device=device)
            for name, shape in self.shapes.items()}
        set_model_state_dict(model, values, options=StateDictOptions(full_state_dict=True, strict=False))


def apply_lora(built: BuiltModel, cfg: Config, *, base_dtype: torch.dtype) -> BuiltModel:
    """The built model with train.lora's adapters (unchanged when LoRA is off), drawn from run.seed."""
    settings = settings_of(cfg.train.lora)
    if settings is None:
        return built
    attach_adapters(built.module, settings, seed=cfg.run.seed, base_dtype=base_dtype)
    init = built.init
    if init is not None:
        init = LoRAInit(init, built.module, rank=settings.rank, seed=cfg.run.seed)
    return BuiltModel(built.module, built.block_classes, init)


# ---- the base a LoRA checkpoint belongs to -----------------------------------------------------------


def _files_fingerprint(path: Path) -> str:
    """Size and the first and last MiB of every weights file under `path`: a base changed in any tensor
    changes it, a copy of the same files does not (no modification times)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (
        ".safetensors", ".bin", ".pth", ".pt", ".distcp", ".json", ".metadata"))
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path) if file != path else file.name}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                f.seek(size - _SAMPLE_BYTES)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def base_reference(m: ModelSection, model_signature: dict, *, seed: int | None) -> dict:
    """Where a LoRA run's base weights come from and their fingerprint, recorded in its checkpoints: a resume
    on another base is refused, and scripts/export_hf.py finds the base to merge into. The base is the model
    section's model.hf_path or model.init_from, or else the weights that `seed` (run.seed) draws."""
    if m.type == "hf" and m.hf_path:
        source: dict[str, object] = {"hf_path": str(Path(m.hf_path).resolve())}
        fingerprint = _files_fingerprint(Path(m.hf_path))
    elif m.init_from:
        source = {"init_from": str(Path(m.init_from).resolve())}
        fingerprint = _files_fingerprint(Path(m.init_from))
    else:  # a randomly initialised base: (model, seed) decides it
        source = {"seed": seed}
        if m.type == "hf":
            source["hf_config"] = str(Path(m.hf_config).resolve())
        fingerprint = hashlib.sha256(json.dumps([model_signature, seed], sort_keys=True).encode()).hexdigest()
        fingerprint = fingerprint[:16]
    return {**source, "fingerprint": fingerprint}


def lora_record(cfg: Config, model_signature: dict, *, base_dtype: torch.dtype) -> dict | None:
    """What a LoRA run's checkpoints record about it: the adapters' settings (train.lora), the base (the model
    section and run.seed) and the dtype it was frozen in (an export merges into the same rounded weights); None when
    LoRA is off."""
    settings = settings_of(cfg.train.lora)
    if settings is None:
        return None
    return {"rank": settings.rank, "alpha": settings.alpha, "targets": list(settings.targets),
            "base": base_reference(cfg.model, model_signature, seed=cfg.run.seed),
            "base_dtype": str(base_dtype).replace("torch.", "")}
