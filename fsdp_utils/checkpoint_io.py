"""Read a training checkpoint's model in one plain process: no process group, no FSDP, no GPU needed.

    from fsdp_utils.checkpoint_io import load_model
    model, meta = load_model("checkpoints/tiny/fsdp_cpt1000.pth")             # a full checkpoint file
    model, meta = load_model("checkpoints/llama1B/fsdp_sharded_cpt500", device="cuda")  # or a sharded folder

Only the model weights are read (a sharded checkpoint's optimizer state stays on disk). The run's
tokenizer sits next to its checkpoints: `tokenizer_path(checkpoint)`. Every problem with the input is a
CheckpointError whose message names the path, for scripts to print as one line.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from model import ModelConfig, Transformer

from .checkpoint_format import (
    META_KEYS, CheckpointCorrupt, CheckpointError, check_file, check_meta, checksum_records, dcp_load, first_line,
    load_full, read_sharded_meta)


def model_config_of(meta: dict, where: Path) -> ModelConfig:
    """The ModelConfig a checkpoint was saved with."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    saved = meta["model_config"]
    unknown = sorted(set(saved) - known)
    if unknown:
        raise CheckpointError(f"{where}: model_config has fields this code does not know ({', '.join(unknown)})")
    cfg = ModelConfig(**saved)
    if problems := cfg.problems():
        raise CheckpointError(f"{where}: invalid model_config ({'; '.join(problems)})")
    return cfg


def read_meta(path: str | Path) -> dict:
    """Metadata (format_version, world_size, model_config, train_state) of a full file or sharded folder.

    For a full checkpoint this maps the file (mmap), so it is cheap even for large ones.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir():
        return check_meta(read_sharded_meta(path), path / "meta.json")
    payload = load_full(path)
    return {k: payload[k] for k in META_KEYS}


def verify(path: str | Path) -> None:
    """Check every file of a checkpoint against its recorded size and CRC32 (a full file copied without
    its checksum record is taken as it is); CheckpointCorrupt naming the first file that differs."""
    path = Path(path)
    records = checksum_records(path)
    folder = path if path.is_dir() else path.parent
    for name, record in sorted((records or {}).items()):
        if problem := check_file(folder / name, record):
            raise CheckpointCorrupt(problem)


def load_model(path: str | Path, *, device: str | torch.device = "cpu") -> tuple[Transformer, dict]:
    """(model in eval mode on `device`, the checkpoint's metadata) for a full file or a sharded folder."""
    path = Path(path)
    meta = read_meta(path)
    verify(path)
    cfg = model_config_of(meta, path)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")  # no random init: every weight is overwritten below
    model.reset_buffers()
    if path.is_dir():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "loading in a single process" is what we want
            dcp_load({"model": model.state_dict()}, path, no_dist=True)  # in place; reads only the model's tensors
    else:
        try:
            model.load_state_dict(load_full(path)["model"], strict=True)
        except RuntimeError as err:  # missing or extra tensors, wrong shapes
            raise CheckpointError(f"{path}: does not fit the model its model_config describes ({first_line(err)})") from None
    return model.to(device).eval(), meta


def tokenizer_path(checkpoint: str | Path) -> Path:
    """The run's SentencePiece model: train_fsdp.py copies it next to the checkpoints."""
    return Path(checkpoint).absolute().parent / "tokenizer.model"


def find_tokenizer(checkpoint: str | Path, tokenizer: Path | None) -> Path:
    """The tokenizer a tool should use: the one given, else the run's, next to the checkpoint."""
    if tokenizer is None:
        tokenizer = tokenizer_path(checkpoint)
        if not tokenizer.is_file():
            raise CheckpointError(f"{tokenizer}: no tokenizer next to the checkpoint; pass --tokenizer PATH")
    elif not tokenizer.is_file():
        raise CheckpointError(f"{tokenizer}: no such tokenizer file")
    return tokenizer
