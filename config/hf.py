"""A Hugging Face model's config.json (model.type: hf), read at config time: the config checks run it
before any process group starts, and the model builder (fsdp_utils/parallel/hf.py) reads the same way.
transformers is imported only when a config is read."""
from __future__ import annotations

from pathlib import Path

from data.hf_tokenizer import names_own_code


class HFModelError(ValueError):
    """model.hf_path or model.hf_config cannot be used; the message names which, and why."""


def model_field(model_cfg) -> str:
    """The field naming the model's folder or config.json, with its value, for messages."""
    return f"model.hf_path={model_cfg.hf_path}" if model_cfg.hf_path else f"model.hf_config={model_cfg.hf_config}"


def one_line(err: BaseException) -> str:
    """An exception as one short line: transformers' own messages span lines."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def load_hf_config(model_cfg):
    """The transformers config of model.hf_path (or model.hf_config); HFModelError in one line when it cannot
    be read or needs the folder's own code (never run, never asked about)."""
    from transformers import AutoConfig

    path = Path(model_cfg.hf_path or model_cfg.hf_config)
    folder = path if path.is_dir() else path.parent
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        if names_own_code(folder, "config.json"):
            raise HFModelError(f"{model_field(model_cfg)}: its config.json needs the folder's own Python code "
                               f"(auto_map), which is never run; use a model type that transformers includes") from None
        raise HFModelError(f"{model_field(model_cfg)}: cannot read its config.json ({one_line(err)})") from None


def hf_problems(model_cfg) -> list[str]:
    """Config-time check of model.type=hf: the folder's config loads (before any process group starts)."""
    try:
        load_hf_config(model_cfg)
    except HFModelError as err:
        return [str(err)]
    return []
