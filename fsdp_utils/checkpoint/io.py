"""Read a training checkpoint's model in one plain process (no process group, no FSDP, no GPU): `load_model` of a
full file or a sharded folder, only the model weights read. The run's tokenizer sits next to its checkpoints, found by
the hash each records (`find_tokenizer`; `install_tokenizer` puts it there). Every problem with the input is a
CheckpointError whose message names the path, for scripts to print as one line."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from config.model_checks import model_problems
from data.store import HF_TOKENIZER_NAME, tokenizer_sha256
from model import ModelConfig, Transformer
from safe_io import nofollow
from safe_io.journal import TMP_PREFIX, Journal

from ..host_memory import format_size, host_memory
from .checksums import check_archive, check_file
from .contents import MODEL, parts_of
from .errors import CheckpointCorrupt, CheckpointError, first_line
from .metadata import check_structure, read_sharded_meta
from .safe_read import dcp_load, load_full, read_dcp_metadata

log = logging.getLogger(__name__)


def model_config_of(meta: dict, where: Path) -> ModelConfig:
    """The ModelConfig a checkpoint was saved with, each field's type and value checked. A checkpoint of a whole
    model must hold its weights: a config that describes more than its model tensors hold is not theirs, and
    building it could exhaust memory (`_check_held`). A LoRA checkpoint holds adapters, not its base: whoever
    builds the base bounds it by where the base comes from (its own files, or `check_buildable` for a seeded one)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    saved = meta["model_config"]
    unknown = sorted(set(saved) - known)
    if unknown:
        raise CheckpointError(f"{where}: model_config has fields this code does not know ({', '.join(unknown)})")
    types = {"int": (int,), "float": (int, float), "bool": (bool,), "None": (type(None),)}
    for field in dataclasses.fields(ModelConfig):
        allowed = tuple(t for name in str(field.type).split(" | ") for t in types[name])
        value = saved.get(field.name, field.default)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise CheckpointError(f"{where}: invalid model_config ({field.name}={value!r}, expected {field.type})")
    cfg = ModelConfig(**saved)
    if problems := model_problems(cfg):
        raise CheckpointError(f"{where}: invalid model_config ({'; '.join(problems)})")
    if meta.get("lora") is None:
        _check_held(cfg, where)
    return cfg


def _check_held(cfg: ModelConfig, where: Path) -> None:
    """A config describing more weights than the model tensors of the checkpoint at `where` hold is not its own.
    Counted from the tensors' recorded shapes, not from the files' sizes: a sparse file's size costs nothing."""
    if cfg.num_params() > (held := held_weights(where)):
        raise CheckpointError(f"{where}: model_config describes {cfg.num_params():,} parameters, more than the "
                              f"{held:,} weights of the checkpoint's model tensors")


def held_weights(path: Path) -> int:
    """The number of weights in the model tensors of a checkpoint, from their shapes: those DCP's metadata records
    for a sharded folder (each tensor's whole size), those of a full file's payload (memory-mapped: each bounded by
    the data the file holds for it)."""
    if path.is_dir():
        entries = read_dcp_metadata(path / ".metadata").state_dict_metadata.items()
        shapes = [m.size for name, m in entries
                  if name.startswith(f"{MODEL}.") and isinstance(m, TensorStorageMetadata)]
    else:
        shapes = [t.shape for t in load_full(path)[MODEL].values() if isinstance(t, torch.Tensor)]
    return sum(math.prod(shape) for shape in shapes)


def check_buildable(cfg: ModelConfig, where: Path, *, why: str) -> None:
    """A model that no file's size vouches for (`why` says why not) is built only if its fp32 weights fit in the
    memory this machine has free: a forged config must not make a tool exhaust it."""
    needed, free = cfg.num_params() * 4, host_memory().available
    if needed > free:
        raise CheckpointError(f"{where}: model_config describes {cfg.num_params():,} parameters ({format_size(needed)} "
                              f"in fp32), more than the {format_size(free)} of memory free here ({why})")


def read_meta(path: str | Path) -> dict:
    """Metadata (format_version, world_size, model_config, train_state) of a full file or sharded folder.

    For a full checkpoint this maps the file (mmap), so it is cheap even for large ones."""
    path = Path(path)
    if path.is_dir():
        return read_sharded_meta(path)
    return parts_of(load_full(path))[2]


def verify(path: str | Path) -> None:
    """Check every file of a checkpoint against its recorded size and CRC32 (a full file copied without its
    checksum record: against the CRC32s of its archive); CheckpointCorrupt naming the first file that differs."""
    path = Path(path)
    records = check_structure(path)
    if records is None and (problem := check_archive(path)[1]):
        raise CheckpointCorrupt(problem)
    folder = path if path.is_dir() else path.parent
    for name, record in sorted((records or {}).items()):
        if problem := check_file(folder / name, record):
            raise CheckpointCorrupt(problem)


def load_model(path: str | Path, *, device: str | torch.device = "cpu") -> tuple[Transformer, dict]:
    """(model in eval mode on `device`, the checkpoint's metadata) for a full file or a sharded folder."""
    path = Path(path)
    meta = read_meta(path)
    if (lora := meta.get("lora")) is not None:
        raise CheckpointError(f"{path}: holds LoRA adapters (train.lora.rank={lora.get('rank')}), not a whole model: "
                              "scripts/generate.py reads it with its base, scripts/export_hf.py --merge_lora merges "
                              "them into it")
    verify(path)
    cfg = model_config_of(meta, path)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")  # no random init: every weight is overwritten below
    model.reset_buffers()
    if path.is_dir():
        dcp_load({MODEL: model.state_dict()}, path, no_dist=True)  # in place; reads only the model's tensors
    else:
        try:
            model.load_state_dict(load_full(path)[MODEL], strict=True)
        except RuntimeError as err:  # missing or extra tensors, wrong shapes
            raise CheckpointError(
                f"{path}: does not fit the model its model_config describes ({first_line(err)})") from None
    return model.to(device).eval(), meta


# ---- the run's tokenizer, next to its checkpoints (each records its sha256) --------------------------------------
# A run that changes tokenizer (checkpoint.allow_tokenizer_change) keeps the previous one beside it under a name with
# the first 8 hex digits of its hash, so every checkpoint's tokenizer stays findable by its hash.
TOKENIZER_NAME = "tokenizer.model"


def run_tokenizer_name(source: Path) -> str:
    """The name of a run's tokenizer in its output directory."""
    return source.name if source.is_dir() else TOKENIZER_NAME


def kept_tokenizer_name(name: str, sha256: str) -> str:
    """The name a replaced tokenizer is kept under: tokenizer.<hash8>.model, or <folder>.<hash8>."""
    stem, dot, suffix = name.rpartition(".") if name == TOKENIZER_NAME else (name, "", "")
    return f"{stem}.{sha256[:8]}{dot}{suffix}"


def install_tokenizer(source: Path, out_dir: Path) -> None:
    """Copy the run's tokenizer into the output directory. A different tokenizer already there is kept
    under its hash's name (the checkpoints trained with it need it), never overwritten; nothing is
    written through a symbolic link (the copy is renamed into place, which replaces a link itself)."""
    dest = out_dir / run_tokenizer_name(source)
    new = tokenizer_sha256(source)
    if dest.exists() and not (dest.is_file() or dest.is_dir()):  # reading a FIFO or a device would never end
        raise CheckpointError(f"{dest}: {nofollow.kind_of(dest.stat().st_mode)} where the run's tokenizer goes; "
                              "move it away")
    if dest.exists():
        old = tokenizer_sha256(dest)
        if old == new:
            return
        kept = out_dir / kept_tokenizer_name(dest.name, old)
        if not kept.exists():
            os.rename(dest, kept)
        elif tokenizer_sha256(kept) != old:
            raise CheckpointError(f"{kept}: exists and is not the tokenizer {dest} holds; move one of them away")
        elif dest.is_dir() and not dest.is_symlink():  # kept already holds this very folder: a copy can go
            shutil.rmtree(dest)
        log.warning("%s is another tokenizer than this run's (sha256 %s, now %s): kept as %s for the checkpoints "
                    "trained with it", dest, old[:8], new[:8], kept.name)
    elif dest.is_symlink() and source.is_dir():  # a broken link: renaming a folder onto it would fail
        raise CheckpointError(f"{dest}: a broken symbolic link where the run's tokenizer goes; remove it")
    # Copied under a `.tmp-` name recorded in the run's journal: a leftover of an interrupted copy is removed, a
    # file of the user's under that name is kept aside.
    journal, tmp = Journal(out_dir), out_dir / f"{TMP_PREFIX}{dest.name}"
    if source.is_dir():
        journal.create_dir(tmp)
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        journal.seal(tmp)
    else:
        with source.open("rb") as src:
            journal.write_file(tmp, lambda f: shutil.copyfileobj(src, f))
    journal.rename(tmp, dest)


def find_tokenizer(checkpoint: str | Path, tokenizer: Path | None, sha256: str | None = None) -> Path:
    """The tokenizer a tool should use: the one given (a SentencePiece model file, or a Hugging Face tokenizer's
    folder), else the run's next to the checkpoint whose hash is the checkpoint's `sha256`: tokenizer.model or
    the hf_tokenizer folder, or one kept under its hash's name when the run changed tokenizer. A checkpoint without a
    tokenizer record takes tokenizer.model (a run with a Hugging Face tokenizer always records its hash)."""
    if tokenizer is not None:
        if not tokenizer.exists():
            raise CheckpointError(f"{tokenizer}: no such tokenizer file or folder")
        return tokenizer
    folder = Path(checkpoint).absolute().parent
    current = folder / TOKENIZER_NAME
    # The run's files: anything but a regular file (or the folder of a Hugging Face tokenizer) is refused, a link
    # included (UnsafePath naming it), never read.
    if sha256 is None:
        if not nofollow.check(current):
            raise CheckpointError(f"{current}: no tokenizer next to the checkpoint; pass --tokenizer PATH")
        return current
    names = (TOKENIZER_NAME, HF_TOKENIZER_NAME)
    for name in names:
        for candidate in (folder / name, folder / kept_tokenizer_name(name, sha256)):
            if nofollow.check(candidate, folder_ok=name == HF_TOKENIZER_NAME) and tokenizer_sha256(candidate) == sha256:
                return candidate
    others = [str(folder / name) for name in names if (folder / name).exists()]
    there = f"{' and '.join(others)} {'is another' if len(others) == 1 else 'are others'}" if others else \
        f"no {' or '.join(names)} there"
    raise CheckpointError(f"{checkpoint}: no tokenizer with its sha256 {sha256[:8]} next to it ({there}); "
                          f"pass --tokenizer PATH")
