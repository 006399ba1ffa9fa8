"""Export a training checkpoint as a Hugging Face transformers LlamaForCausalLM directory.

    python scripts/export_hf.py checkpoints/tiny/fsdp_cpt1000.pth exported/tiny
    python scripts/export_hf.py checkpoints/llama1B/fsdp_sharded_cpt500 exported/llama1B --dtype bf16 --force

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = AutoModelForCausalLM.from_pretrained("exported/tiny"), AutoTokenizer.from_pretrained("exported/tiny")

OUT_DIR gets config.json, model.safetensors and a tokenizer that encodes like the run's (found next to the
checkpoint by the hash it records, or --tokenizer); a failed export leaves OUT_DIR as it was. A LoRA checkpoint
exports merged into its base (--merge_lora) or as a PEFT adapter folder (--lora_adapter_only): docs/huggingface.md
and docs/training.md say what each writes."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from config import ModelSection
from data.errors import DataError
from data.store import read_tokenizer_file
from data.tokenizer import load_sentencepiece
from fsdp_utils.checkpoint.contents import MODEL
from fsdp_utils.checkpoint.errors import CheckpointError, first_line
from fsdp_utils.checkpoint.io import (
    check_buildable,
    find_tokenizer,
    load_model,
    model_config_of,
    read_meta,
    verify,
)
from fsdp_utils.checkpoint.safe_read import dcp_load, load_full
from fsdp_utils.parallel.hf import (
    CausalLMAdapter,
    HFModelError,
    dtype_kwarg,
    load_hf_checkpoint,
    load_hf_config,
    load_pretrained,
)
from fsdp_utils.parallel.lora import (
    HF_NAMES,
    LoRASettings,
    adapters_of,
    attach_adapters,
    base_reference,
    merged_state_dict,
)
from model import ModelConfig, Transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ExportError(Exception):
    """A problem with the arguments or the output folder; the message names the path."""


def hf_state_dict(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameter names and fused layouts -> LlamaForCausalLM's: wqkv split into q/k/v_proj, w13 into
    gate/up_proj. Our rotary layout is Llama's rotate-half one, so q and k need no permutation."""
    q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": ours["tok_embeddings.weight"], "model.norm.weight": ours["norm.weight"]}
    out["lm_head.weight"] = ours["tok_embeddings.weight"] if cfg.tie_embeddings else ours["output.weight"]
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = ours[src + "attention.wqkv.weight"].split([q_size, kv_size, kv_size], dim=0)
        gate, up = ours[src + "feed_forward.w13.weight"].chunk(2, dim=0)
        out |= {
            dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k, dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": ours[src + "attention.wo.weight"],
            dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": ours[src + "feed_forward.w2.weight"],
            dst + "input_layernorm.weight": ours[src + "attention_norm.weight"],
            dst + "post_attention_layernorm.weight": ours[src + "ffn_norm.weight"],
        }
    return {name: t.contiguous() for name, t in out.items()}


def rope_parameters(cfg: ModelConfig) -> dict:
    """config.json's rope_parameters for our rotary settings: plain, or Llama 3's scaling (rope_type llama3)."""
    scaling = cfg.llama3_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    original = scaling.pop("original_max_seq_len")  # config.json's name for it
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **scaling,
            "original_max_position_embeddings": original}


def hf_config(cfg: ModelConfig, dtype: torch.dtype, *, bos_id: int | None, eos_id: int | None):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg), hidden_act="silu",
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
        initializer_range=cfg.init_std, bos_token_id=bos_id, eos_token_id=eos_id, **dtype_kwarg(dtype),
    )


def hf_tokenizer(model_file: Path, max_len: int | None):
    """A tokenizers-backed tokenizer equivalent to our SentencePiece BPE model (identity normalisation,
    no dummy prefix, byte fallback). SentencePiece stores no merge list: every split of a piece into two
    pieces is a merge, ranked by the piece's score, which reproduces SentencePiece's merge order."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    try:
        sp = load_sentencepiece(model_file, need_eos=False)
    except DataError as err:
        raise ExportError(str(err)) from None
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    ranked = []
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            continue
        piece = sp.id_to_piece(i)
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-sp.get_score(i), vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    special = {name: sp.id_to_piece(i) for name, i in (("unk_token", sp.unk_id()), ("bos_token", sp.bos_id()),
                                                         ("eos_token", sp.eos_id())) if i >= 0}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=special.get("unk_token"), fuse_unk=True,
                        byte_fallback=True))
    # No normaliser, spaces -> "▁" without a prefix space, and no pre-splitting: no piece joins a word to
    # the space before the next one, so BPE over the whole text splits where SentencePiece's words do.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    # split_special_tokens: "</s>" in a text is text, as for SentencePiece, not the EOS id.
    limit = {} if max_len is None else {"model_max_length": max_len}
    return PreTrainedTokenizerFast(tokenizer_object=tok, split_special_tokens=True, clean_up_tokenization_spaces=False,
                                   **limit, **special), sp


def export_tokenizer(path: Path, max_len: int | None):
    """(a transformers tokenizer to save with the model, its number of tokens) for the run's tokenizer: a Hugging
    Face tokenizer's folder as the training loaded it, or the equivalent of a SentencePiece model."""
    if not path.is_dir():
        hf_tok, sp = hf_tokenizer(path, max_len)
        return hf_tok, sp.get_piece_size()
    from data.hf_tokenizer import HFTokenizer

    try:
        loaded = HFTokenizer(path)
    except ValueError as err:
        raise ExportError(f"{path}: not a Hugging Face tokenizer folder ({err})") from None
    return loaded.tok, loaded.get_piece_size()


# ---- LoRA checkpoints ---------------------------------------------------------------------------------


def _lora_base(meta: dict, checkpoint: Path) -> torch.nn.Module:
    """The base model a LoRA checkpoint's adapters belong to, in fp32 on the CPU, checked against the
    fingerprint the checkpoint recorded (before anything of it is read beyond that)."""
    base, config = meta["lora"]["base"], meta["model_config"]
    hf = config.get("type") == "hf"
    # Paths from the checkpoint's metadata: read as a training run reads model.hf_path, never running code of the
    # folder and never downloading.
    source = ModelSection(type="hf" if hf else "llama", init_from="" if hf else base.get("init_from", ""),
                          hf_path=base.get("hf_path", ""), hf_config=base.get("hf_config", ""))
    if base_reference(source, config, seed=base.get("seed"))["fingerprint"] != base["fingerprint"]:
        raise CheckpointError(f"{checkpoint}: its base ({', '.join(f'{k}={v}' for k, v in base.items())}) has "
                              "changed since training: the adapters belong to other weights")
    if hf:
        from transformers import AutoModelForCausalLM

        hf_config = load_hf_config(source)  # first: a folder that needs its own code is refused by name
        if source.hf_path:
            lm = load_pretrained(source)
        else:  # as the training built it: seeded, then from the config
            torch.manual_seed(base["seed"])
            lm = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False, **dtype_kwarg(torch.float32))
        return CausalLMAdapter(lm.float())
    return _our_base(meta, checkpoint, init_from=source.init_from)


def _our_base(meta: dict, checkpoint: Path, *, init_from: str) -> Transformer:
    """Our model as a LoRA checkpoint's base: the weights of `init_from`, or those its seed draws. The adapters'
    checkpoint does not hold the base, so its size does not bound the config: the base's own checkpoint does
    (load_model checks it), and a seeded base must fit in memory."""
    cfg = model_config_of(meta, checkpoint)
    if not init_from:
        seed = meta["lora"]["base"].get("seed")
        if not isinstance(seed, int):
            raise CheckpointError(f"{checkpoint}: its LoRA record names no base for our model (no init_from, no seed)")
        check_buildable(cfg, checkpoint, why="a LoRA checkpoint on a seeded base holds none of the base's weights")
        model = Transformer(cfg, fused_matmul=True)
        model.init_weights(seed)
        return model
    weights, _ = load_model(init_from)
    if weights.cfg.num_params() != cfg.num_params():
        raise CheckpointError(f"{checkpoint}: its model_config ({cfg.num_params():,} parameters) is not the model of "
                              f"its base {init_from} ({weights.cfg.num_params():,})")
    model = Transformer(cfg, fused_matmul=True)
    try:
        model.load_state_dict(weights.state_dict())
    except RuntimeError as err:  # the same size, other shapes
        raise CheckpointError(f"{checkpoint}: its model_config is not the model of its base {init_from} "
                              f"({first_line(err)})") from None
    return model


def load_lora_model(checkpoint: Path) -> tuple[torch.nn.Module, dict]:
    """(base model with the checkpoint's adapters, the checkpoint's metadata) on the CPU; the base is rounded
    to the dtype it was frozen in during training, the adapters are the trained fp32 ones."""
    meta = read_meta(checkpoint)
    verify(checkpoint)
    lora = meta["lora"]
    model = _lora_base(meta, checkpoint)
    settings = LoRASettings(lora["rank"], float(lora["alpha"]), 0.0, tuple(lora["targets"]))
    try:
        attach_adapters(model, settings, seed=0, base_dtype=getattr(torch, lora.get("base_dtype", "float32")))
    except ValueError as err:  # targets that name no layer of this model
        raise CheckpointError(f"{checkpoint}: its LoRA record does not fit its model ({err})") from None
    model.float()  # computes in fp32 from here (the rounded base values stay as they were)
    adapters = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    if checkpoint.is_dir():
        dcp_load({MODEL: adapters}, checkpoint, no_dist=True)  # in place, only the adapters
    else:
        saved = load_full(checkpoint)[MODEL]
        shapes = lambda d: {k: tuple(getattr(v, "shape", ())) for k, v in d.items()}  # noqa: E731
        if shapes(saved) != shapes(adapters):  # copy_ below would broadcast a tensor of another shape
            raise CheckpointError(f"{checkpoint}: its tensors are not the adapters train.lora={lora} makes")
        with torch.no_grad():
            for name, tensor in adapters.items():
                tensor.copy_(saved[name])
    return model.eval(), meta


def peft_adapter(model: torch.nn.Module, meta: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors under PEFT's names, adapter_config) of a LoRA model: our fused layers' adapters are split
    per slice into the q_proj, k_proj, ... of the exported LlamaForCausalLM."""
    lora, hf = meta["lora"], meta["model_config"].get("type") == "hf"
    tensors: dict[str, torch.Tensor] = {}
    for name, _, adapter in adapters_of(model):
        row, r = 0, adapter.rank
        for i, ((_, size), target) in enumerate(zip(adapter.slices, adapter.names, strict=True)):
            if hf:
                module = name.removeprefix("lm.")
            else:
                layer = name.split(".")[1]
                part = "self_attn" if target in ("q", "k", "v", "o") else "mlp"
                module = f"model.layers.{layer}.{part}.{HF_NAMES[target]}"
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = adapter.lora_A[i * r:(i + 1) * r].detach().float().contiguous()
            tensors[f"{prefix}.lora_B.weight"] = adapter.lora_B[row:row + size].detach().float().contiguous()
            row += size
    base = lora["base"]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"], "lora_alpha": lora["alpha"],
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "target_modules": sorted(HF_NAMES[t] for t in lora["targets"]), "inference_mode": True,
              "base_model_name_or_path": base.get("hf_path") or base.get("hf_config") or None}
    return tensors, config


def _write_folder(out_dir: Path, fill) -> None:
    """fill(tmp) writes the folder's files into a temporary folder beside out_dir, which is then moved into
    place (replacing an empty or --force'd out_dir): a failed export leaves out_dir as it was."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        fill(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp's folder (and the weights file) are private: as usual instead
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        if out_dir.exists():  # empty, or --force: move it aside, put ours in place, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".old-{out_dir.name}-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            try:
                os.replace(tmp, out_dir)
            except OSError:
                os.replace(old / out_dir.name, out_dir)
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_lora(checkpoint: Path, out_dir: Path, *, adapter_only: bool, dtype: str = "fp32",
                force: bool = False) -> Path:
    """A LoRA checkpoint as a PEFT adapter folder (adapter_only) or, merged into its Hugging Face base, as
    that model's folder; returns out_dir. (A merged model of ours goes through `export`.)"""
    from safetensors.torch import save_file

    _check_out_dir(out_dir, [checkpoint], force)
    model, meta = load_lora_model(checkpoint)
    if adapter_only:
        tensors, config = peft_adapter(model, meta)

        def fill(tmp: Path) -> None:
            save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")

        _write_folder(out_dir, fill)
        return out_dir
    base = meta["lora"]["base"]
    _check_out_dir(out_dir, [checkpoint, *_base_paths(base.get("hf_path"), base.get("hf_config"))], force)
    lm = model.lm  # type: ignore[union-attr]  # model.type=hf: ours is merged by export()
    merged = {k.removeprefix("lm."): v.to(DTYPES[dtype]) for k, v in merged_state_dict(model).items()}
    with torch.device("meta"):
        plain = type(lm)(lm.config)
    plain.load_state_dict(merged, strict=False, assign=True)
    plain.tie_weights()

    def fill_model(tmp: Path) -> None:
        plain.save_pretrained(tmp)
        if "hf_path" in base:
            copy_tokenizer_files(Path(base["hf_path"]), tmp)

    _write_folder(out_dir, fill_model)
    return out_dir


# A model folder's tokenizer files as transformers writes them: the chat template lives in chat_template.jinja
# (or several in additional_chat_templates/), or in tokenizer_config.json as older releases keep it.
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "added_tokens", "vocab", "merges", "chat_template",
                      "generation_config")
CHAT_TEMPLATES_DIR = "additional_chat_templates"


def copy_tokenizer_files(folder: Path, dest: Path) -> None:
    """The tokenizer (and generation settings) of a Hugging Face model folder, as they are, into `dest`."""
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name.startswith(TOKENIZER_PREFIXES):
            shutil.copyfile(path, dest / path.name)
        elif path.is_dir() and path.name == CHAT_TEMPLATES_DIR:
            shutil.copytree(path, dest / path.name)


def export_hf_model(checkpoint: Path, out_dir: Path, *, dtype: str = "fp32", force: bool = False,
                    tokenizer: Path | None = None, base: Path | None = None) -> Path:
    """A fine-tuned Hugging Face model (model.type=hf) as that architecture's folder: the base's config.json with
    the checkpoint's weights, the run's tokenizer (its chat template included) and the base's generation
    settings; returns out_dir."""
    model, meta, source = load_hf_checkpoint(checkpoint, base=base)
    tokenizer = find_tokenizer(checkpoint, tokenizer, meta.get("tokenizer_sha256"))  # the one it was trained with
    _check_out_dir(out_dir, [checkpoint, tokenizer, *_base_paths(source.hf_path, source.hf_config)], force)
    lm = model.lm.to(DTYPES[dtype])
    hf_tok, num_tokens = export_tokenizer(tokenizer, getattr(lm.config, "max_position_embeddings", None))
    if num_tokens > lm.config.vocab_size:
        raise ExportError(f"{tokenizer}: {num_tokens} tokens, more than the model's vocab_size={lm.config.vocab_size}")
    generation = Path(source.hf_path) / "generation_config.json" if source.hf_path else None

    def fill(tmp: Path) -> None:
        lm.save_pretrained(tmp)
        hf_tok.save_pretrained(tmp)
        if not tokenizer.is_dir():
            (tmp / "tokenizer.model").write_bytes(read_tokenizer_file(tokenizer))
        if generation is not None and generation.is_file():  # the base's (stop tokens of a chat model, sampling)
            shutil.copyfile(generation, tmp / generation.name)

    _write_folder(out_dir, fill)
    return out_dir


def _base_paths(hf_path: str | None, hf_config: str | None) -> list[Path]:
    """The Hugging Face base a model.type=hf export reads: its folder (or config.json), an input like any."""
    return [Path(p) for p in (hf_path, hf_config) if p]


def _check_out_dir(out_dir: Path, inputs: list[Path], force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ExportError(f"{out_dir} exists and is not empty; pass --force to replace it")
    resolved = out_dir.resolve()
    for path in inputs:
        if path.resolve() == resolved or resolved in path.resolve().parents:
            raise ExportError(f"{out_dir} holds the input {path}; choose another output directory")


def export(checkpoint: Path, out_dir: Path, *, dtype: str = "fp32", force: bool = False,
           tokenizer: Path | None = None, merge_lora: bool = False, base: Path | None = None) -> Path:
    """Write the Hugging Face directory for `checkpoint` to `out_dir`; return out_dir. A LoRA checkpoint
    needs merge_lora (or export_lora for an adapter folder); `base`: see export_hf_model."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    meta = read_meta(checkpoint)  # first: a missing or foreign checkpoint is the error to report
    if "lora" in meta and not merge_lora:
        raise ExportError(f"{checkpoint}: holds LoRA adapters, not a model: pass --merge_lora (merged into the base) "
                          "or --lora_adapter_only (a PEFT adapter folder)")
    if merge_lora and "lora" not in meta:
        raise ExportError(f"{checkpoint}: --merge_lora, but it holds no LoRA adapters (trained without train.lora)")
    if merge_lora and meta["model_config"].get("type") == "hf":
        return export_lora(checkpoint, out_dir, adapter_only=False, dtype=dtype, force=force)
    if meta["model_config"].get("type") == "hf":
        return export_hf_model(checkpoint, out_dir, dtype=dtype, force=force, tokenizer=tokenizer, base=base)
    tokenizer = find_tokenizer(checkpoint, tokenizer, meta.get("tokenizer_sha256"))  # the one it was trained with
    _check_out_dir(out_dir, [checkpoint, tokenizer], force)
    if merge_lora:
        lora_model, _ = load_lora_model(checkpoint)
        ours = Transformer(lora_model.cfg)  # type: ignore[arg-type]  # our Transformer: model.type=hf went above
        ours.load_state_dict(merged_state_dict(lora_model))
    else:
        ours, _ = load_model(checkpoint)
    cfg = ours.cfg
    hf_tok, num_tokens = export_tokenizer(tokenizer, cfg.max_seq_len)
    if num_tokens > cfg.vocab_size:
        raise ExportError(f"{tokenizer}: {num_tokens} tokens, more than the model's vocab_size={cfg.vocab_size}")
    weights = {k: v.to(DTYPES[dtype]) for k, v in hf_state_dict(cfg, ours.state_dict()).items()}
    config = hf_config(cfg, DTYPES[dtype], bos_id=hf_tok.bos_token_id, eos_id=hf_tok.eos_token_id)
    with torch.device("meta"):  # no random init: every weight is assigned from ours
        model = LlamaForCausalLM(config)
    model.load_state_dict(weights, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.tie_weights()

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        # Only the tokenizer's own files: a --tokenizer folder may be a whole model folder (weights, config.json).
        hf_tok.save_pretrained(tmp)
        if not tokenizer.is_dir():
            (tmp / "tokenizer.model").write_bytes(read_tokenizer_file(tokenizer))

    _write_folder(out_dir, fill)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="fsdp_cpt<step>.pth or fsdp_sharded_cpt<step>/")
    parser.add_argument("out_dir", type=Path, help="the Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the saved weights")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a SentencePiece model or a Hugging Face tokenizer folder (default: the one next to "
                             "CHECKPOINT that it was trained with)")
    parser.add_argument("--base", type=Path, default=None,
                        help="model.type=hf: the Hugging Face model folder (or its config.json) the run fine-tuned "
                             "(default: model.hf_path or model.hf_config of the run's config.yaml next to CHECKPOINT)")
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument("--merge_lora", action="store_true",
                      help="a LoRA checkpoint: merge its adapters into the base and write the model")
    lora.add_argument("--lora_adapter_only", action="store_true",
                      help="a LoRA checkpoint: write a PEFT adapter folder (adapter_config.json, "
                           "adapter_model.safetensors) for peft.PeftModel.from_pretrained")
    args = parser.parse_args(argv)
    try:
        if args.lora_adapter_only:
            if "lora" not in read_meta(args.checkpoint):
                raise ExportError(f"{args.checkpoint}: --lora_adapter_only, but it holds no LoRA adapters")
            export_lora(args.checkpoint, args.out_dir, adapter_only=True, force=args.force)
            print(f"wrote {args.out_dir}: load it with peft.PeftModel.from_pretrained(base_model, "
                  f"{str(args.out_dir)!r})")
            return 0
        export(args.checkpoint, args.out_dir, dtype=args.dtype, force=args.force, tokenizer=args.tokenizer,
               merge_lora=args.merge_lora, base=args.base)
    except (ExportError, CheckpointError, HFModelError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir} ({args.dtype}): load it with "
          f"AutoModelForCausalLM.from_pretrained({str(args.out_dir)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
