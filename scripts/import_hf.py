"""Import a local Hugging Face LlamaForCausalLM checkpoint as a full checkpoint of ours (the reverse of export_hf.py).

    python scripts/import_hf.py /models/Llama-3.2-1B llama1B.pth --config config/llama1B.yaml
    torchrun --nproc_per_node=8 train_fsdp.py config/llama1B.yaml

HF_DIR holds config.json and model.safetensors (or its shards); nothing is downloaded, no code of it runs. OUT is a
full checkpoint at step 0 (fp32 weights, no optimizer state); --config writes a training config that trains from it,
else the model section is printed. A configuration our model cannot compute exactly is refused, naming the field."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch
import yaml

from config import ConfigError, load_config
from config.model_checks import MAX_SEQ_LEN, model_problems
from data.errors import DataError
from data.jsonfile import read_json_file
from fsdp_utils.checkpoint.checksums import save_full
from fsdp_utils.checkpoint.contents import MODEL, OPTIMIZER, RNG, TrainState, full_payload, train_state_record
from fsdp_utils.checkpoint.errors import CheckpointError
from fsdp_utils.checkpoint.names import FORMAT_VERSION
from fsdp_utils.parallel.hf import HFModelError, index_shards
from fsdp_utils.train.optim import build_optimizer
from model import ModelConfig, Transformer
from model.config import ROPE_SCALING_FIELDS
from safe_io.nofollow import write_beside

ROOT = Path(__file__).resolve().parents[1]

# Tensors that older checkpoints carry and that are derived, not learned (our rotary tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFImportError(Exception):
    """The folder cannot be imported; the message names the file or config field, in one line."""


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise HFImportError(f"{path}: not found (HF_DIR must be a local Hugging Face model folder)")
    try:
        value = read_json_file(path)  # bounded: a deeply nested file is one line, not a RecursionError
    except DataError as err:
        raise HFImportError(str(err)) from None
    if not isinstance(value, dict):
        raise HFImportError(f"{path}: not a JSON object")
    return value


# config.json is JSON as Python reads it: any field may hold a string, a list, null, NaN or Infinity. Each is
# checked for its kind before use, so a malformed one is an error naming it, never a traceback or a guess.
def _number(value, field: str, where: Path) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise HFImportError(f"{where}: {field}={value!r} is not a positive finite number")
    return float(value)


def _positive_int(value, field: str, where: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise HFImportError(f"{where}: {field}={value!r} is not a positive integer")
    return value


def _flag(value, field: str, where: Path) -> bool:
    if not isinstance(value, bool):
        raise HFImportError(f"{where}: {field}={value!r} is not true or false")
    return value


def _rope(hf: dict, where: Path) -> dict:
    """Our rope_* fields, from transformers 5's rope_parameters or the older rope_theta / rope_scaling fields
    (rope_scaling first where both are given, as transformers reads them): plain, or Llama 3's scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for field, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise HFImportError(f"{where}: {field}={value!r} is not a mapping")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind not in (None, "default", "llama3"):
            raise HFImportError(f"{where}: {field} rope_type={kind!r}: our model has plain rotary embeddings and "
                               "Llama 3's scaling only (rope_type default or llama3)")
    field, rope = ("rope_scaling", scaling) if scaling else ("rope_parameters", params)
    out = {"rope_theta": _number(rope.get("rope_theta", hf.get("rope_theta", 10000.0)), "rope_theta", where)}
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return out
    for ours, key in (("rope_scaling_factor", "factor"), ("rope_low_freq_factor", "low_freq_factor"),
                      ("rope_high_freq_factor", "high_freq_factor")):
        out[ours] = _number(rope.get(key), f"{field} {key}", where)
    # As transformers reads it: a top-level original_max_position_embeddings first, then the mapping's, then
    # max_position_embeddings.
    original = hf.get("original_max_position_embeddings",
                      rope.get("original_max_position_embeddings", hf.get("max_position_embeddings", 2048)))
    return out | {"rope_original_max_seq_len": _positive_int(original, "original_max_position_embeddings", where)}


def model_config_of(hf: dict, where: Path) -> ModelConfig:
    """Our ModelConfig for a LlamaForCausalLM config.json; HFImportError naming the first field our model cannot
    express."""
    if hf.get("model_type") != "llama":
        raise HFImportError(f"{where}: model_type={hf.get('model_type')!r}: only LlamaForCausalLM (model_type "
                           "'llama') is imported")
    refusals = {
        "hidden_act": ("silu", "our MLP is SwiGLU (silu)"),
        "attention_bias": (False, "our attention projections have no bias"),
        "mlp_bias": (False, "our MLP projections have no bias"),
        "attention_dropout": (0.0, "our attention has no dropout"),
    }
    for field, (ours, why) in refusals.items():
        if field in hf and hf[field] != ours:
            raise HFImportError(f"{where}: {field}={hf[field]!r}: {why}")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        _positive_int(hf.get(field), field, where)
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if dim % n_heads:
        raise HFImportError(f"{where}: hidden_size={dim} is not a multiple of num_attention_heads={n_heads}")
    if hf.get("head_dim") not in (None, dim // n_heads):
        raise HFImportError(f"{where}: head_dim={hf['head_dim']}: our model's head_dim is hidden_size / "
                           f"num_attention_heads = {dim // n_heads}")
    kv = hf.get("num_key_value_heads")
    n_kv = n_heads if kv is None else _positive_int(kv, "num_key_value_heads", where)
    context = _positive_int(hf.get("max_position_embeddings", 2048), "max_position_embeddings", where)
    cfg = ModelConfig(vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=n_heads,
                      n_kv_heads=n_kv, ffn_hidden_dim=hf["intermediate_size"], max_seq_len=min(context, MAX_SEQ_LEN),
                      norm_eps=_number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
                      tie_embeddings=_flag(hf.get("tie_word_embeddings", False), "tie_word_embeddings", where),
                      **_rope(hf, where))
    if problems := model_problems(cfg):
        raise HFImportError(f"{where}: our model cannot take these dimensions ({problems[0]})")
    return cfg


def read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = index_shards(index)  # files of HF_DIR only
        except HFModelError as err:
            raise HFImportError(str(err)) from None
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        other = " (only .safetensors weights are read)" if any(hf_dir.glob("*.bin")) else ""
        raise HFImportError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json{other}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors |= load_file(hf_dir / name)
        except (OSError, SafetensorError) as err:
            raise HFImportError(f"{hf_dir / name}: cannot read ({err})") from None
    return tensors


def ours_state_dict(cfg: ModelConfig, hf: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's names and separate projections -> ours, fused (export_hf.hf_state_dict reversed)."""
    hf = {k: v for k, v in hf.items() if not k.endswith(IGNORED_SUFFIXES)}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise HFImportError(f"{where}: the weights have no {name}")
        used.add(name)
        return hf[name].to(torch.float32)

    ours = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        ours["output.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf:  # a tied model saved with its (shared) head: it must be the embedding
        if not torch.equal(take("lm_head.weight"), ours["tok_embeddings.weight"]):
            raise HFImportError(f"{where}: tie_word_embeddings=true but lm_head.weight differs from the embedding")
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        ours |= {
            dst + "attention.wqkv.weight": torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"]),
            dst + "attention.wo.weight": take(attn + "o_proj.weight"),
            dst + "feed_forward.w13.weight": torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]),
            dst + "feed_forward.w2.weight": take(mlp + "down_proj.weight"),
            dst + "attention_norm.weight": take(src + "input_layernorm.weight"),
            dst + "ffn_norm.weight": take(src + "post_attention_layernorm.weight"),
        }
    if extra := sorted(set(hf) - used):
        raise HFImportError(f"{where}: tensors our model has no place for, e.g. {extra[0]} ({len(extra)} in all)")
    return ours


def checkpoint_payload(cfg: ModelConfig, weights: dict[str, torch.Tensor], where: Path) -> dict:
    """The full checkpoint of step 0 for these weights: the payload FullCheckpoint writes, with an optimizer
    that has parameter groups (named as the training's optimizer names them) and no state yet."""
    with torch.device("meta"):  # no random init: every weight is assigned below
        model = Transformer(cfg)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as err:  # a tensor of another shape than config.json describes
        lines = [line.strip() for line in str(err).splitlines() if "size mismatch" in line] or [str(err)]
        raise HFImportError(f"{where}: the weights do not fit config.json ({lines[0]})") from None
    optimizer = build_optimizer(model, lr=0.0, weight_decay=0.0, betas=(0.9, 0.95), fused=False)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    return full_payload({MODEL: model.state_dict(), OPTIMIZER: {"state": {}, "param_groups": groups}}, {RNG: None},
                        {"format_version": FORMAT_VERSION, "world_size": 1, "model_config": dataclasses.asdict(cfg),
                         "train_state": train_state_record(TrainState())})


def read_model_config(hf_dir: Path) -> ModelConfig:
    """Our ModelConfig for the LlamaForCausalLM folder `hf_dir` (its config.json only)."""
    where = hf_dir / "config.json"
    return model_config_of(_read_json(where), where)


def _check_target(path: Path, force: bool, what: str) -> None:
    if path.exists() and not force:
        raise HFImportError(f"{path} exists; pass --force to overwrite it")
    if path.is_dir():
        raise HFImportError(f"{path} is a directory; give the path of the {what} to write")


def import_hf(hf_dir: Path, out: Path, *, force: bool = False) -> ModelConfig:
    """Write the full checkpoint for the LlamaForCausalLM in `hf_dir` to `out` (atomically); return its config."""
    _check_target(out, force, ".pth file")
    cfg = read_model_config(hf_dir)
    payload = checkpoint_payload(cfg, ours_state_dict(cfg, read_safetensors(hf_dir), hf_dir), hf_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_full(payload, out)  # and .OUT.json next to it: a load from OUT verifies its CRC32
    return cfg


def model_section(cfg: ModelConfig) -> str:
    """The `model` section (YAML) that describes the imported model."""
    fields: tuple[str, ...] = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim",
                               "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings")
    if cfg.rope_scaling_factor is not None:
        fields += ("rope_scaling_factor", *ROPE_SCALING_FIELDS)
    return "model:\n" + "".join(f"  {name}: {json.dumps(getattr(cfg, name))}\n" for name in fields)


DEFAULT_BASE_CONFIG = ROOT / "config/train1B_fsdp.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def training_overrides(cfg: ModelConfig, hf_dir: Path, checkpoint: Path, base: Path) -> list[str]:
    """The overrides that make the config `base` train the imported model: its whole model section (no field of
    the base's model survives), started from `checkpoint`, with HF_DIR's tokenizer; HFImportError naming the
    base when it is not a valid config itself."""
    if not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        raise HFImportError(f"{hf_dir}: no tokenizer ({', '.join(TOKENIZER_FILES)}) for the config to train with")
    try:
        seq_len = load_config(base).data.seq_len
    except ConfigError as err:
        raise HFImportError(f"--base_config {base}: {'; '.join(err.problems)}") from None
    model = {"type": "llama", "hf_path": "", "hf_config": "", "init_from": str(checkpoint.absolute()),
             **dataclasses.asdict(cfg)}
    data = {"tokenizer": "hf", "hf_tokenizer": str(hf_dir.absolute()), "tokenizer_model": "",
            "seq_len": min(seq_len, cfg.max_seq_len)}
    return [f"--{section}.{key}={json.dumps(value)}" for section, values in (("model", model), ("data", data))
            for key, value in values.items()] + [f"--run.name={json.dumps(checkpoint.stem)}"]


def write_training_config(path: Path, base: Path, overrides: list[str], *, check_only: bool = False) -> None:
    """`base` with `overrides`, validated as train_fsdp.py validates it, written (renamed into place) to `path`
    as the complete resolved config; check_only: validate without writing (model.init_from may not exist yet)."""
    if check_only:
        overrides = [o for o in overrides if not o.startswith("--model.init_from=")]
    try:
        cfg = load_config(base, overrides)
    except ConfigError as err:
        raise HFImportError(f"--base_config {base} with the imported model: {'; '.join(err.problems)}") from None
    if check_only:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"# {base.name} with the model imported by scripts/import_hf.py\n" + yaml.safe_dump(cfg.to_dict(),
                                                                                           sort_keys=False)
    write_beside(path, lambda f: f.write(text.encode()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path, help="a local LlamaForCausalLM folder (config.json + safetensors)")
    parser.add_argument("out", type=Path, help="the full checkpoint file to write, e.g. llama.pth")
    parser.add_argument("--force", action="store_true", help="overwrite OUT (and --config) if it exists")
    parser.add_argument("--config", type=Path, default=None,
                        help="write a complete training config for the imported model here (a .yaml file)")
    parser.add_argument("--base_config", type=Path, default=DEFAULT_BASE_CONFIG,
                        help="the config --config starts from (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        overrides: list[str] = []
        if args.config is not None:  # every check before the import, which takes a while for large models
            _check_target(args.config, args.force, ".yaml file")
            overrides = training_overrides(read_model_config(args.hf_dir), args.hf_dir, args.out, args.base_config)
            write_training_config(args.config, args.base_config, overrides, check_only=True)
        cfg = import_hf(args.hf_dir, args.out, force=args.force)
        if args.config is not None:
            write_training_config(args.config, args.base_config, overrides)
    except (HFImportError, CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({cfg.num_params():,} parameters, {args.out.stat().st_size / 2**20:.1f} MiB)", end="")
    if args.config is not None:
        print(f" and {args.config}; train from it with:\n  torchrun --nproc_per_node=N train_fsdp.py {args.config}")
    else:
        print(f"; train from it with --model.init_from={args.out} and this model section (max_seq_len may be "
              f"smaller), or pass --config FILE to have the whole config written:\n{model_section(cfg)}", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
