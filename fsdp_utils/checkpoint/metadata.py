"""A checkpoint's metadata and structure, read and checked before any tensor is: meta.json of a sharded checkpoint (and
that its folder holds exactly the files it lists), a full file's checksum record, and what every metadata may hold (its
keys, the train_state record that contents.py describes, the LoRA record). Every reader goes through `check_structure`
and `check_meta`: garbage is CheckpointCorrupt, a checkpoint of another format version or step is CheckpointMismatch."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch

from safe_io import nofollow

from .checksums import META_CRC_KEY, check_size, meta_crc32
from .contents import PLAIN_PARTS, TrainState
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointUnsafe, first_line
from .names import FORMAT_VERSION, META_NAME, is_file_name, sidecar_of, step_in_name

_META_LIMIT = 64 << 20  # bytes: far more than the metadata of any model's checkpoint holds
MAX_COUNT = 2**63 - 1  # steps, samples and tokens are int64 wherever they are used
META_KEYS = ("format_version", "world_size", "model_config", "train_state")
OPTIONAL_META_KEYS = ("tokenizer_sha256", "lora")  # a checkpoint without them (no tokenizer record, no LoRA) loads


def is_int(value: object, minimum: int, maximum: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= minimum
            and (maximum is None or value <= maximum))


def _records(files: object, where: Path) -> dict[str, dict]:
    """meta.json's "files": {name: {"size", "crc32"}}; checkpoints from before checksums hold {name: size}."""
    if not isinstance(files, dict):
        raise CheckpointCorrupt(f"{where}: not a checkpoint's metadata (no list of files)")
    records = {}
    for name, entry in files.items():
        if is_int(entry, 0):
            entry = {"size": entry, "crc32": None}
        if (not is_file_name(name) or not isinstance(entry, dict) or not is_int(entry.get("size"), 0)
                or not (entry.get("crc32") is None or re.fullmatch(r"[0-9a-f]{8}", str(entry["crc32"])))):
            raise CheckpointCorrupt(f"{where}: not a checkpoint's metadata (bad entry for {name!r})")
        records[name] = entry
    return records


def _folder_entries(path: Path) -> list[str]:
    """The names of a sharded checkpoint's files, every one a regular file of the folder: a link (which could
    lead anywhere), a folder, a FIFO or a device is never something a save wrote, and is refused."""
    names = []
    for entry in os.scandir(path):
        mode = entry.stat(follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointUnsafe(f"{entry.path}: refused: {nofollow.kind_of(mode)} inside a checkpoint, which a save "
                                   "never writes (a tampered or foreign folder)")
        names.append(entry.name)
    return names


def _parse_meta(meta_path: Path) -> Any:
    """meta.json's contents: its CRC32 checked where it records one (a checkpoint written before meta.json
    carried one is taken as it is); CheckpointCorrupt for anything that does not decode."""
    try:
        meta = json.loads(nofollow.read_small(meta_path, limit=_META_LIMIT))
        recorded = meta.get(META_CRC_KEY) if isinstance(meta, dict) else None
        actual = meta_crc32(meta) if recorded is not None else None
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: nested deeper than any metadata
        raise CheckpointCorrupt(f"{meta_path}: incomplete or corrupt checkpoint ({first_line(err)})") from None
    if actual != recorded:
        raise CheckpointCorrupt(f"{meta_path}: corrupt checkpoint (CRC32 of its contents {actual}, recorded "
                                f"{recorded!r}: it changed after the save)")
    return meta


def read_sharded_meta(path: Path) -> dict:
    """meta.json of a complete sharded checkpoint, validated, after checking that the folder holds exactly
    the files it lists (nothing else: every file read is checked), each of its recorded size."""
    meta_path = path / META_NAME
    if not os.path.lexists(meta_path):
        raise CheckpointCorrupt(f"{path}: not a complete sharded checkpoint (no meta.json: an interrupted save or "
                                "another folder)")
    names = _folder_entries(path)
    meta = _parse_meta(meta_path)
    check_meta(meta, meta_path, checkpoint=path, extra_keys=("files", META_CRC_KEY))
    meta["files"] = _records(meta.get("files"), meta_path)
    if unlisted := sorted(set(names) - set(meta["files"]) - {META_NAME}):
        raise CheckpointCorrupt(f"{path / unlisted[0]}: not listed in {META_NAME}, so it cannot be checked "
                                "(a foreign file, or a damaged meta.json)")
    for name, record in meta["files"].items():
        if problem := check_size(path / name, record):
            raise CheckpointCorrupt(problem)
    return meta


def read_full_record(pth: Path) -> dict[str, dict] | None:
    """The checksum record of a full checkpoint file, or None when it has none (a file converted or
    copied without its sidecar, or recorded without checksums)."""
    sidecar = sidecar_of(pth)
    if not os.path.lexists(sidecar):
        return None
    try:
        files = json.loads(nofollow.read_small(sidecar, limit=_META_LIMIT)).get("files")
    except nofollow.UnsafePath as err:
        raise CheckpointUnsafe(str(err)) from None
    except (OSError, ValueError, AttributeError, RecursionError) as err:
        raise CheckpointCorrupt(f"{sidecar}: corrupt checksum record ({first_line(err)})") from None
    records = _records(files, sidecar)
    if len(records) != 1:
        raise CheckpointCorrupt(f"{sidecar}: corrupt checksum record (expected the record of one file)")
    # The record of this file, whatever name it was saved under (a file renamed with its record keeps its bytes).
    return {pth.name: next(iter(records.values()))}


def check_structure(path: Path) -> dict[str, dict] | None:
    """Cheap checks that need no reading of tensor data: the path exists, a file is a torch.save zip of the size
    recorded, a folder has its meta.json and every file it lists. Raises CheckpointError. Only a regular file or a
    folder is read (a link to one is followed: the user named it): a FIFO would block, a device such as /dev/zero would
    never end. Returns the checkpoint's checksum records, {file name: record} (names relative to a sharded checkpoint's
    folder, to a full one's folder); None for a full file without its sidecar."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file or directory") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({first_line(err)})") from None
    if stat.S_ISDIR(mode):
        return read_sharded_meta(path)["files"]
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: {nofollow.kind_of(mode)}, not a checkpoint (a checkpoint is a file written by "
                              "torch.save or a sharded checkpoint's folder)")
    record = read_full_record(path)
    if record and (problem := check_size(path, record[path.name])):
        raise CheckpointCorrupt(problem)
    if not zipfile.is_zipfile(path):
        with path.open("rb") as f:
            begun = f.read(4) == b"PK\x03\x04"  # the first record of a zip archive, whose end is missing
        raise CheckpointCorrupt(f"{path}: truncated or incomplete checkpoint (a torch.save archive without its end: "
                                "the write or the copy stopped short)" if begun else
                                f"{path}: not a checkpoint (not a file written by torch.save)")
    return record


def _meta_problem(meta: dict, extra_keys: tuple[str, ...]) -> str | None:
    """What is wrong with a checkpoint's metadata (every key, type and range), or None."""
    allowed = {*META_KEYS, *OPTIONAL_META_KEYS, *extra_keys}
    if missing := [k for k in META_KEYS if k not in meta]:
        return f"missing {', '.join(missing)}"
    if unknown := sorted(str(k) for k in meta if k not in allowed):
        return f"unknown key {', '.join(unknown)}"
    if not is_int(meta["world_size"], 1, 2**31 - 1):
        return f"world_size {meta['world_size']!r} is not a positive integer below 2**31"
    config = meta["model_config"]
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        return "model_config is not a mapping of field names"
    if bad := [k for k, v in config.items() if v is not None and not isinstance(v, (bool, int, float, str))]:
        return f"model_config.{bad[0]} is not a plain value"
    if "tokenizer_sha256" in meta and not re.fullmatch(r"[0-9a-f]{64}", str(meta["tokenizer_sha256"])):
        return "tokenizer_sha256 is not a sha256 hex digest"
    return _lora_problem(meta.get("lora")) or train_state_problem(meta["train_state"])


def _lora_problem(lora: object) -> str | None:
    """What is wrong with the metadata's LoRA record (parallel/lora.py lora_record), or None (also when absent)."""
    if lora is None:
        return None
    if not isinstance(lora, dict) or not isinstance(base := lora.get("base"), dict):
        return "lora is not a mapping with its base"
    seeded = is_int(base.get("seed"), -MAX_COUNT - 1, MAX_COUNT)
    if not isinstance(base.get("fingerprint"), str) or not (
            seeded or isinstance(base.get("init_from") or base.get("hf_path"), str)):
        return "lora.base names neither a seed nor a path with its fingerprint"
    if not is_int(lora.get("rank"), 1, 2**20):
        return f"lora.rank {lora.get('rank')!r} is not a positive integer"
    alpha = lora.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        return f"lora.alpha {alpha!r} is not a finite number"
    targets = lora.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        return "lora.targets is not a list of names"
    dtype = lora.get("base_dtype", "float32")
    if not (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)):
        return f"lora.base_dtype {dtype!r} is not a torch dtype"
    return None


def train_state_problem(state: object) -> str | None:
    """What is wrong with the metadata's train_state record, or None: its keys are contents.TrainState's fields (those
    marked required present) and PLAIN_PARTS, each of the field's type (a count from 0 to 2**63-1, a name, or a finite
    number from 0, above 0 where marked positive), each plain part a mapping or None."""
    if not isinstance(state, dict):
        return "train_state is not a mapping"
    fields = dataclasses.fields(TrainState)
    if missing := [f.name for f in fields if f.metadata.get("required") and f.name not in state]:
        return f"train_state has no {', '.join(missing)}"
    if unknown := sorted(str(k) for k in state if k not in {f.name for f in fields} | set(PLAIN_PARTS)):
        return f"train_state has unknown key {', '.join(unknown)}"
    for f in fields:
        if f.name in state and (expected := _field_problem(f, state[f.name])):
            return f"train_state.{f.name} {state[f.name]!r} is not {expected}"
    if bad := [name for name in PLAIN_PARTS if state.get(name) is not None and not isinstance(state[name], dict)]:
        return f"train_state.{bad[0]} is not a mapping"
    return None


def _field_problem(field: dataclasses.Field, value: object) -> str | None:
    """What a TrainState field's value should have been, or None when it is that."""
    if field.type == "int":
        return None if is_int(value, 0, MAX_COUNT) else "an integer from 0 to 2**63-1"
    if field.type == "str":
        return None if isinstance(value, str) and re.fullmatch(r"[a-z0-9_]{1,64}", value) else "a name"
    positive = field.metadata.get("positive", False)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                         and (value > 0 if positive else value >= 0)):
        return None
    return "a finite positive number" if positive else "a finite non-negative number"


def check_meta(meta: object, where: Path, *, checkpoint: Path | None = None, extra_keys: tuple[str, ...] = ()) -> dict:
    """Validate a checkpoint's metadata: meta.json of a sharded one, the payload of a full one (whose other
    keys are `extra_keys`). Every reader goes through here: garbage is CheckpointCorrupt, a format this code
    does not read or a step that differs from the one in the checkpoint's name is CheckpointMismatch."""
    if not isinstance(meta, dict):
        raise CheckpointCorrupt(f"{where}: not a checkpoint of this library (expected keys {', '.join(META_KEYS)})")
    version = meta.get("format_version", FORMAT_VERSION)
    if not (is_int(version, 0) and version == FORMAT_VERSION):
        raise CheckpointMismatch(f"{where}: checkpoint format_version {meta['format_version']!r}, this code reads "
                                 f"{FORMAT_VERSION}")
    if problem := _meta_problem(meta, extra_keys):
        raise CheckpointCorrupt(f"{where}: not a valid checkpoint of this library ({problem})")
    named = step_in_name(checkpoint) if checkpoint is not None else None
    if named is not None and named != meta["train_state"]["step"]:
        raise CheckpointMismatch(
            f"{checkpoint}: holds step {meta['train_state']['step']}, its name says step {named} (a renamed "
            "checkpoint?); give it back its name or move it out of the output directory")
    return meta
