"""The checkpoint format on disk, shared by the checkpoint manager and the offline tools: names, metadata,
checksums (written, and checked at load with the files spread over the ranks), safe reading and the error texts.

    fsdp_cpt{step}.pth            full: one torch.save file (model, optimizer, rng, train_state, ...)
    .fsdp_cpt{step}.pth.json      its checksum record (a sidecar: the .pth stays a plain torch.save file)
    fsdp_sharded_cpt{step}/       sharded: DCP's __{rank}_0.distcp files and .metadata, rng.pt, and
                                  meta.json (train state and every file's size and CRC32), written last

Nothing in a checkpoint is ever unpickled by a general unpickler: .pth and rng.pt load with
`torch.load(weights_only=True)`; DCP reads its `.metadata` with plain pickle, so `SafeFileSystemReader`
reads it with an unpickler that admits only DCP's metadata classes; DCP loads non-tensor entries (the
optimizer's param groups) with `torch.load(weights_only=False)`, so `SafeLoadPlanner` loads them with
`weights_only=True`. A checkpoint that needs anything else is refused with `CheckpointUnsafe`.

Checksums are CRC32 (zlib): they are there to catch damage (torn writes, truncation, flipped bits), not
tampering; whoever can rewrite a file can rewrite its record too, and safe reading covers that case.
CRC32 is the fastest of the hashes docs/checkpoints.md compares.
"""
from __future__ import annotations

import _compat_pickle
import json
import logging
import math
import os
import pickle
import pickletools
import re
import stat
import time
import warnings
import zipfile
import zlib
from collections.abc import Collection
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from safe_io import nofollow
from safe_io.journal import TMP_PREFIX as TMP_PREFIX  # the name of a save in progress, for the format's users
from safe_io.nofollow import write_beside

from ..distributed import DistEnv, agree

log = logging.getLogger(__name__)
T = TypeVar("T")

FULL_RE = re.compile(r"^fsdp_cpt(\d+)\.pth$")
SHARDED_RE = re.compile(r"^fsdp_sharded_cpt(\d+)$")
_DCP_FILE_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # a shard DCP wrote: __{rank}_{i}.distcp
CORRUPT_PREFIX = "corrupt-"  # moved aside after failing its checks: never loaded, never deleted automatically
META_NAME = "meta.json"
META_CRC_KEY = "meta_crc32"  # meta.json's own checksum, over its other keys
_META_LIMIT = 64 << 20  # bytes: far more than the metadata of any model's checkpoint holds
MAX_COUNT = 2**63 - 1  # steps, samples and tokens are int64 wherever they are used
RNG_NAME = "rng.pt"
FORMAT_VERSION = 1
META_KEYS = ("format_version", "world_size", "model_config", "train_state")
OPTIONAL_META_KEYS = ("tokenizer_sha256", "lora")  # a checkpoint without them (no tokenizer record, no LoRA) loads
FULL_PAYLOAD_KEYS = ("model", "optimizer", "rng")  # a full checkpoint's payload: these besides the metadata
TRAIN_STATE_KEYS = ("step", "samples_seen", "tokens_seen", "grad_scaler", "lr", "max_steps",
                    "epochs")  # checkpoint.TrainState, less rng
_CHUNK = 8 << 20  # bytes per read when hashing


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message (one line) names the file."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of a different model or setup: `latest` does not fall back past it."""


class CheckpointCorrupt(CheckpointError):
    """Damaged or incomplete files: `latest` moves such a checkpoint aside and falls back to the previous one."""


class CheckpointUnsafe(CheckpointError):
    """A checkpoint whose loading would run code: refused, never moved or deleted."""


def full_name(step: int) -> str:
    return f"fsdp_cpt{step}.pth"


def sharded_name(step: int) -> str:
    return f"fsdp_sharded_cpt{step}"


def sidecar_of(pth: Path) -> Path:
    """The checksum record of a full checkpoint file."""
    return pth.with_name(f".{pth.name}.json")


def first_line(err: BaseException) -> str:
    """`Type: first line of the message` (at most 200 characters); for a DCP failure, its first rank's error."""
    if isinstance(err, dcp.CheckpointException) and err.failures:
        rank, failure = min(err.failures.items(), key=lambda item: item[0])
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {first_line(inner)}"
    if isinstance(err, pickle.UnpicklingError):  # torch's text advises weights_only=False: not for a damaged file
        return "UnpicklingError: the data does not decode"
    text = str(err).strip()
    line = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def size_of(path: Path) -> int:
    """Bytes on disk of a checkpoint file or folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---- checksums ------------------------------------------------------------------------------------


class ChecksumWriter:
    """A write-only file wrapper that computes the CRC32 and size of what passes through it, so that
    torch.save's bytes are hashed while they are written (no second read of a multi-GB file)."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.name = f.name
        self.crc = 0
        self.size = 0
        self.crc_seconds = 0.0  # reported apart from the write time: what the checksums cost
        self.error: OSError | None = None

    def write(self, data) -> int:
        start = time.perf_counter()
        self.crc = zlib.crc32(data, self.crc)
        self.crc_seconds += time.perf_counter() - start
        self.size += memoryview(data).nbytes
        try:
            return self._f.write(data)
        except OSError as err:  # torch's writer reports only "unexpected pos": keep the real cause
            self.error = err
            raise

    def flush(self) -> None:
        self._f.flush()

    def record(self) -> dict:
        return {"size": self.size, "crc32": f"{self.crc:08x}"}


def file_record(path: Path) -> dict:
    """{"size", "crc32"} of a file, read in chunks."""
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, "crc32": f"{crc:08x}"}


def check_size(path: Path, record: dict) -> str | None:
    """A problem (text naming the file) if the file is missing or of another size than recorded."""
    actual = path.stat().st_size if path.is_file() else None
    if actual is None:
        return f"{path}: missing (corrupt or incomplete checkpoint: expected {record['size']} bytes)"
    if actual < record["size"]:
        return f"{path}: truncated or incomplete checkpoint (expected {record['size']} bytes, found {actual})"
    if actual != record["size"]:
        return f"{path}: corrupt checkpoint (expected {record['size']} bytes, found {actual})"
    return None


def check_file(path: Path, record: dict) -> str | None:
    """A problem (text naming the file) if its size or CRC32 differs from the record."""
    if problem := check_size(path, record):
        return problem
    if record.get("crc32") is None:  # a record without a checksum: the size is all we know
        return None
    actual = file_record(path)["crc32"]
    if actual != record["crc32"]:
        return (f"{path}: corrupt checkpoint (CRC32 {actual}, recorded {record['crc32']}: the bytes changed "
                "after the save)")
    return None


def check_archive(path: Path) -> tuple[bool, str | None]:
    """(verified, problem) of a .pth without its checksum record, against the CRC32 that torch.save writes into
    its zip archive for every record: a problem (text naming the file) if any record's bytes differ from it.
    Not verified when the archive holds no CRC32s (torch.save with crc32 computation turned off writes zeros)."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            if all(info.CRC == 0 for info in infos if info.file_size):
                return False, None
            bad = archive.testzip()  # reads every record, comparing its CRC32 with the archive's
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as err:
        return False, f"{path}: corrupt checkpoint ({first_line(err)})"
    if bad is not None:
        return False, (f"{path}: corrupt checkpoint (the CRC32 of its record {bad} differs from the one its archive "
                       "holds: the bytes changed after the save)")
    return True, None


def write_checksummed(obj: Any, f: BinaryIO) -> tuple[dict, float]:
    """torch.save `obj` into the new file `f`, flushed and fsynced; return the file's {"size", "crc32"} and the
    seconds spent computing the CRC32."""
    writer = ChecksumWriter(f)
    try:
        torch.save(obj, writer)  # type: ignore[arg-type]  # torch.save needs only write(); stubs ask for IO
    except RuntimeError:
        if writer.error is not None:  # a full disk, a quota, a file size limit
            raise writer.error from None
        raise
    f.flush()
    os.fsync(f.fileno())
    return writer.record(), writer.crc_seconds


def save_with_checksum(obj: Any, path: Path) -> tuple[dict, float]:
    """write_checksummed into a new file at `path`, what stood there removed first (a link as itself, a folder
    refused: nofollow.create). The run's own files go through its journal instead (retention.Journal)."""
    with nofollow.create(path) as f:
        return write_checksummed(obj, f)


def write_json_to(f: BinaryIO, payload: dict) -> None:
    """Write a small JSON file durably (flushed and fsynced), before it is renamed into place."""
    f.write(json.dumps(payload, indent=1).encode())
    f.flush()
    os.fsync(f.fileno())


def write_json(path: Path, payload: dict) -> None:
    """write_json_to a new file at `path` (as save_with_checksum makes it)."""
    with nofollow.create(path) as f:
        write_json_to(f, payload)


def checksum_record(final: Path, record: dict) -> dict:
    """The contents of a full checkpoint's checksum record (its sidecar), given the file's {"size", "crc32"}."""
    return {"format_version": FORMAT_VERSION, "files": {final.name: record}}


def install_full(tmp: Path, final: Path) -> None:
    """Rename a written full checkpoint into place. A record left by a file of the same name goes first:
    it must never describe the new file (until its own is written, the new file loads unverified)."""
    nofollow.remove(sidecar_of(final))
    nofollow.replace(tmp, final)


def write_record(final: Path, record: dict) -> None:
    """Write a full checkpoint's checksum record next to it, atomically (see write_beside)."""
    write_beside(sidecar_of(final), lambda f: write_json_to(f, checksum_record(final, record)))


def save_full(payload: dict, out: Path) -> None:
    """Write a tool's full checkpoint `payload` at `out`, then its checksum record (see write_beside)."""
    record, _ = write_beside(out, lambda f: write_checksummed(payload, f), install=install_full)
    write_record(out, record)


# ---- metadata -------------------------------------------------------------------------------------


def _is_file_name(name: object) -> bool:
    """A plain file name inside a checkpoint's folder: no path, nothing that leads out of it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
            and len(name) < 256)


def _records(files: object, where: Path) -> dict[str, dict]:
    """meta.json's "files": {name: {"size", "crc32"}}; checkpoints from before checksums hold {name: size}."""
    if not isinstance(files, dict):
        raise CheckpointCorrupt(f"{where}: not a checkpoint's metadata (no list of files)")
    records = {}
    for name, entry in files.items():
        if _is_int(entry, 0):
            entry = {"size": entry, "crc32": None}
        if (not _is_file_name(name) or not isinstance(entry, dict) or not _is_int(entry.get("size"), 0)
                or not (entry.get("crc32") is None or re.fullmatch(r"[0-9a-f]{8}", str(entry["crc32"])))):
            raise CheckpointCorrupt(f"{where}: not a checkpoint's metadata (bad entry for {name!r})")
        records[name] = entry
    return records


def meta_crc32(meta: dict) -> str:
    """The CRC32 of a sharded checkpoint's metadata (its canonical JSON, without the checksum itself): meta.json
    cannot hold the CRC32 of its own bytes, so it holds the one of its contents."""
    body = {k: v for k, v in meta.items() if k != META_CRC_KEY}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def with_meta_crc32(meta: dict) -> dict:
    return {**meta, META_CRC_KEY: meta_crc32(meta)}


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


def checksum_records(path: Path) -> dict[str, dict] | None:
    """{file name: record} of every file of a checkpoint (names relative to the checkpoint's folder for a
    sharded one, to the .pth's folder for a full one); None for a full file without a sidecar."""
    return read_sharded_meta(path)["files"] if path.is_dir() else read_full_record(path)


def check_structure(path: Path) -> None:
    """Cheap checks that need no reading of tensor data: the path exists, a file is a torch.save zip
    of the size recorded, a folder has its meta.json and every file it lists. Raises CheckpointError.
    Only a regular file or a folder is read (a link to one is followed: the user named it): a FIFO would
    block, a device such as /dev/zero would never end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file or directory") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({first_line(err)})") from None
    if stat.S_ISDIR(mode):
        read_sharded_meta(path)
        return
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: {nofollow.kind_of(mode)}, not a checkpoint (a checkpoint is a file written by "
                              "torch.save or a sharded checkpoint's folder)")
    record = read_full_record(path)
    if record and path.name in record and (problem := check_size(path, record[path.name])):
        raise CheckpointCorrupt(problem)
    if not zipfile.is_zipfile(path):
        with path.open("rb") as f:
            begun = f.read(4) == b"PK\x03\x04"  # the first record of a zip archive, whose end is missing
        raise CheckpointCorrupt(f"{path}: truncated or incomplete checkpoint (a torch.save archive without its end: "
                                "the write or the copy stopped short)" if begun else
                                f"{path}: not a checkpoint (not a file written by torch.save)")


def _is_int(value: object, minimum: int, maximum: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= minimum
            and (maximum is None or value <= maximum))


def _meta_problem(meta: dict, extra_keys: tuple[str, ...]) -> str | None:
    """What is wrong with a checkpoint's metadata (every key, type and range), or None."""
    allowed = {*META_KEYS, *OPTIONAL_META_KEYS, *extra_keys}
    if missing := [k for k in META_KEYS if k not in meta]:
        return f"missing {', '.join(missing)}"
    if unknown := sorted(str(k) for k in meta if k not in allowed):
        return f"unknown key {', '.join(unknown)}"
    if not _is_int(meta["world_size"], 1, 2**31 - 1):
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
    seeded = _is_int(base.get("seed"), -MAX_COUNT - 1, MAX_COUNT)
    if not isinstance(base.get("fingerprint"), str) or not (
            seeded or isinstance(base.get("init_from") or base.get("hf_path"), str)):
        return "lora.base names neither a seed nor a path with its fingerprint"
    if not _is_int(lora.get("rank"), 1, 2**20):
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
    """What is wrong with the metadata's train_state (its keys, the counters, the scaler, lr), or None."""
    if not isinstance(state, dict):
        return "train_state is not a mapping"
    if missing := [k for k in TRAIN_STATE_KEYS[:2] if k not in state]:
        return f"train_state has no {', '.join(missing)}"
    if unknown := sorted(str(k) for k in state if k not in TRAIN_STATE_KEYS):
        return f"train_state has unknown key {', '.join(unknown)}"
    for key in ("step", "samples_seen", "tokens_seen"):
        if key in state and not _is_int(state[key], 0, MAX_COUNT):
            return f"train_state.{key} {state[key]!r} is not an integer from 0 to 2**63-1"
    if state.get("grad_scaler") is not None and not isinstance(state["grad_scaler"], dict):
        return "train_state.grad_scaler is not a mapping"
    lr = state.get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0):
        return f"train_state.lr {lr!r} is not a finite non-negative number"
    if "max_steps" in state and not _is_int(state["max_steps"], 0, MAX_COUNT):
        return f"train_state.max_steps {state['max_steps']!r} is not an integer from 0 to 2**63-1"
    epochs = state.get("epochs")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float))
                               or not math.isfinite(epochs) or epochs <= 0):
        return f"train_state.epochs {epochs!r} is not a finite positive number"
    return None


def step_in_name(path: Path) -> int | None:
    """The step a checkpoint's name says (fsdp_cpt{step}.pth, fsdp_sharded_cpt{step}), None for another name."""
    found = FULL_RE.match(path.name) or SHARDED_RE.match(path.name)
    return int(found.group(1)) if found else None


def check_meta(meta: object, where: Path, *, checkpoint: Path | None = None, extra_keys: tuple[str, ...] = ()) -> dict:
    """Validate a checkpoint's metadata: meta.json of a sharded one, the payload of a full one (whose other
    keys are `extra_keys`). Every reader goes through here: garbage is CheckpointCorrupt, a format this code
    does not read or a step that differs from the one in the checkpoint's name is CheckpointMismatch."""
    if not isinstance(meta, dict):
        raise CheckpointCorrupt(f"{where}: not a checkpoint of this library (expected keys {', '.join(META_KEYS)})")
    version = meta.get("format_version", FORMAT_VERSION)
    if not (_is_int(version, 0) and version == FORMAT_VERSION):
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


# ---- checksums over the ranks -----------------------------------------------------------------
# Which rank hashes which file of a checkpoint when it is written, and the check of every file's size and
# CRC32 against the checkpoint's record when it is loaded.


def owner(name: str, index: int, world_size: int) -> int:
    """The rank that hashes file `name` (the index-th of the checkpoint's files): DCP's `__{rank}_{i}.distcp`
    goes to the rank that wrote it (still in its page cache), everything else round-robin."""
    if (m := _DCP_FILE_RE.match(name)) and int(m.group(1)) < world_size:
        return int(m.group(1))
    return index % world_size


def hash_own_files(folder: Path, rank: int, world_size: int) -> tuple[dict, float]:
    """{name: {"size", "crc32"}} of the files of a written checkpoint that this rank hashes, and the
    seconds it took."""
    start = time.perf_counter()
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    mine = {n: file_record(folder / n) for i, n in enumerate(names) if owner(n, i, world_size) == rank}
    return mine, time.perf_counter() - start


def verify(path: Path, env: DistEnv) -> float:
    """Collective: check every file's size and CRC32 against the checkpoint's record, the files spread over
    the ranks; CheckpointCorrupt on every rank if any differs. Returns the seconds it took."""
    start = time.perf_counter()
    error, records = None, None
    try:
        records = checksum_records(path)
    except CheckpointError as err:
        error = err
    agree(env, error)
    if records is None:  # a .pth without its record: checked against the CRC32s in its own archive
        verified, problem = check_archive(path) if env.is_main else (True, None)
        agree(env, CheckpointCorrupt(problem) if problem else None)
        if env.is_main and not verified:
            log.warning("%s has no checksum record (%s) and its archive holds no CRC32s: loading it unverified", path,
                        sidecar_of(path).name)
        return time.perf_counter() - start
    folder = path if path.is_dir() else path.parent
    names = sorted(records)
    mine = [n for i, n in enumerate(names) if owner(n, i, env.world_size) == env.rank]
    problem = next((p for n in mine if (p := check_file(folder / n, records[n]))), None)
    agree(env, CheckpointCorrupt(problem) if problem else None)
    return time.perf_counter() - start


# ---- safe reading ----------------------------------------------------------------------------------

# What DCP's .metadata holds (FSDP1 and FSDP2 saves): its metadata dataclasses, the
# file-system writer's storage records, torch.Size, dtypes, layouts (by name), and the checkpoint's
# path. Each of these only builds data when unpickled.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided")
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),  # where Python 3.13 pickles it from
    ("collections", "OrderedDict"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that imports only the globals a file of its kind holds: DCP's metadata classes and
    torch's dtypes by default, or exactly the (module, name) pairs of `allowed` (empty: plain data only,
    as in a CUDA memory snapshot). Any other global is refused with CheckpointUnsafe, naming it and `where`;
    `holds` names the kind of file in that message."""

    def __init__(self, f: BinaryIO, where: Path, *, allowed: Collection[tuple[str, str]] | None = None,
                 holds: str = "checkpoint metadata"):
        super().__init__(f)
        self.where, self.allowed, self.holds = where, allowed, holds

    def find_class(self, module: str, name: str) -> Any:
        if self.allowed is None:
            is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            admitted = (module, name) in _METADATA_GLOBALS or is_dtype
        else:
            admitted = (module, name) in self.allowed
        if admitted:
            return super().find_class(module, name)
        raise CheckpointUnsafe(
            f"{self.where}: refused: it references {_py3_name(module, name)}, which {self.holds} never holds "
            f"(loading it would run code; a tampered or foreign file)")


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's .metadata, unpickled with only DCP's metadata classes admitted."""
    try:
        with path.open("rb") as f:
            metadata = RestrictedUnpickler(f, path).load()
    except CheckpointUnsafe:
        raise
    except Exception as err:  # truncated, garbled, or another pickle
        raise CheckpointCorrupt(f"{path}: cannot read checkpoint metadata ({first_line(err)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorrupt(f"{path}: not DCP checkpoint metadata (a {type(metadata).__name__})")
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointCorrupt(f"{path}: not DCP checkpoint metadata (no storage records)")
    for index, info in storage.items():
        where = getattr(info, "relative_path", None)
        if not _is_file_name(where):  # DCP would open it relative to the folder: it must not lead out of it
            raise CheckpointUnsafe(f"{path}: refused: a storage record points at {where!r}, outside the checkpoint's "
                                   f"folder (a tampered or foreign file)")
        if not (_is_int(info.offset, 0) and _is_int(info.length, 0)):
            raise CheckpointCorrupt(f"{path}: corrupt checkpoint metadata (storage record of "
                                    f"{getattr(index, 'fqn', index)!r})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` with the restricted unpickler (read_metadata is the
    StorageReader method DCP calls for it)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP asks for a rank's own metadata file only when the global one failed
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_dcp_metadata(Path(self.path) / name)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# What torch.save writes into the pickles of a checkpoint (a .pth, rng.pt, DCP's non-tensor entries): tensors and
# parameters rebuilt from their storages (one storage class per dtype, named from torch), dtypes, devices, sizes,
# layouts, ordered dicts, and bytes (protocol 2 pickles them through _codecs.encode). Each only builds data.
_TORCH_SAVE_GLOBALS = frozenset({
    *(f"torch._utils.{name}" for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                          "_rebuild_parameter", "_rebuild_parameter_with_state")),
    "torch._tensor._rebuild_from_type_v2", "torch.nn.parameter.Parameter", "torch.Tensor", "torch.Size",
    "torch.device", "torch.serialization._get_layout", "torch.storage.UntypedStorage",  # float8 and newer dtypes
    "collections.OrderedDict", "_codecs.encode",
})


def _holds_only_data(name: str) -> bool:
    """Whether a pickled global (in Python 3 names) is one torch.save writes into a checkpoint."""
    module, _, attr = name.rpartition(".")
    if name in _TORCH_SAVE_GLOBALS:
        return True
    value = getattr(torch, attr, None) if module == "torch" else None
    return isinstance(value, torch.dtype) or (isinstance(value, type) and attr.endswith("Storage"))


def _py3_name(module: str, name: str) -> str:
    """`module.name` as Python 3 imports it: pickles of protocols 0 to 2 may name Python 2 modules
    (`__builtin__.exec`, `copy_reg._reconstructor`, `commands.Popen`), which the unpickler maps."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


_MARK = object()  # a MARK on the simulated stack


def _pop(stack: list, before: list) -> list:
    """Pop what an opcode consumes (pickletools' stack_before): through the topmost mark where it takes a
    mark and the items above it, then the fixed items below. Returns the fixed items, bottom first."""
    if pickletools.markobject in before:
        while stack.pop() is not _MARK:  # IndexError: no mark, not a whole pickle
            pass
        fixed = before.index(pickletools.markobject)
    else:
        fixed = len(before)
    return [stack.pop() for _ in range(fixed)][::-1]


def pickle_globals(data: bytes) -> list[str] | None:
    """`module.name` of every global a pickle imports (GLOBAL, INST, STACK_GLOBAL), in order, in Python 3
    names, read without unpickling: the unpickler's stack is simulated (strings, memo, marks), so
    STACK_GLOBAL names what it would really take, whatever was pushed and popped around it. None when the
    bytes do not decode as one whole pickle (damage, not a refusal)."""
    found: list[str] = []
    stack: list = []
    memo: dict[Any, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                assert isinstance(arg, str)  # pickletools decodes their argument as "module name"
                found.append(_py3_name(*arg.split(" ", 1)))
            if op.name in _IN_PLACE:
                _in_place(op.name, arg, stack, memo)
                continue
            taken = _pop(stack, op.stack_before)
            pushed: list = [None] * len(op.stack_after)
            if op.name == "STACK_GLOBAL":
                module, name = taken
                found.append(_py3_name(module, name) if isinstance(module, str) and isinstance(name, str) else "?")
            elif isinstance(arg, str) and len(pushed) == 1:  # the string opcodes
                pushed = [arg]
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                pushed = [memo.get(arg)]
            stack.extend(_MARK if kind is pickletools.markobject else value
                         for kind, value in zip(op.stack_after, pushed, strict=True))
    except (ValueError, IndexError):  # bytes that are not one whole pickle
        return None
    return found


# Opcodes that leave the stack's items as they are (pickletools' stack effects would lose their values).
_IN_PLACE = ("DUP", "POP", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")


def _in_place(name: str, arg: Any, stack: list, memo: dict) -> None:
    if name == "DUP":
        stack.append(stack[-1])
    elif name == "POP":  # the top item, or the topmost mark when that is on top
        stack.pop()
    else:  # PUT and MEMOIZE store the top item, which stays
        memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]


def _pickle_of(f: Any) -> bytes | None:
    """The data.pkl of a torch.save file (a path or a file object), None if it is not one."""
    try:
        if hasattr(f, "seek"):
            f.seek(0)
        with zipfile.ZipFile(f) as archive:
            name = next((n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")), None)
            return archive.read(name) if name else None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):  # not a whole zip
        return None


def _refused(f: Any) -> list[str]:
    """The globals of a torch.save file that no checkpoint holds, read from its pickle (not from the words of
    torch's refusal, which differ between releases and between globals, and which may name an opcode it stopped
    at before the global). [] when the pickle does not decode as a whole (damage), or holds only data."""
    names = pickle_globals(_pickle_of(f) or b"") or []
    return list(dict.fromkeys(n for n in names if not _holds_only_data(n)))


def _load_plain(f: Any, where: Path, **kwargs: Any) -> Any:
    """torch.load(weights_only=True). A failed load of a pickle that imports anything but data is CheckpointUnsafe,
    naming those globals, whatever torch's exception says; any other failure is raised as it is. Torch's warnings
    of a load that fails are dropped (the error says it all); those of a load that succeeds are shown."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = torch.load(f, map_location="cpu", weights_only=True, **kwargs)
        except Exception:
            if refused := _refused(f):
                raise CheckpointUnsafe(f"{where}: refused: it references {', '.join(refused)}, which a checkpoint "
                                       f"never holds (loading it would run code; a tampered or foreign file)") from None
            raise
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return result


def set_at(root: dict, path: tuple, value: Any) -> None:
    """root[path[0]][path[1]]... = value, creating dicts (str keys) and lists (int keys) on the way."""
    node: Any = root
    for key, next_key in pairwise(path):
        empty: dict | list = {} if isinstance(next_key, str) else []
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = empty
        else:
            node.setdefault(key, empty)
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries load with weights_only=True."""

    def __init__(self, where: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.where = where

    def load_bytes(self, read_item, value) -> None:
        obj = _load_plain(value, self.where)
        if self.flatten_state_dict:
            set_at(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_load(state: dict, path: Path, *, no_dist: bool = False) -> None:
    """dcp.load into `state` in place, through the safe reader and planner. The metadata is read first,
    so that a refused or unreadable one is reported as itself rather than as a DCP failure."""
    reader = SafeFileSystemReader(str(path))
    read_dcp_metadata(path / ".metadata")
    try:
        with warnings.catch_warnings():
            if no_dist:  # "loading in a single process" is what was asked for
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(path), no_dist=no_dist)
    except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
        raise _dcp_error(err, path) from None


def _dcp_error(err: BaseException, path: Path) -> CheckpointError:
    """The CheckpointError a failed dcp.load stands for: a refusal from our planner, else damage."""
    inner = err
    if isinstance(err, dcp.CheckpointException) and err.failures:
        failure = err.failures[min(err.failures)]
        inner = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(inner, CheckpointError):
        return inner
    return CheckpointCorrupt(f"{path}: cannot read sharded checkpoint ({first_line(err)})")


def load_rng(path: Path) -> list | None:
    """rng.pt of a sharded checkpoint: every rank's RNG state."""
    try:
        return _load_plain(path / RNG_NAME, path / RNG_NAME)["rng"]
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointCorrupt(f"{path / RNG_NAME}: cannot read ({first_line(err)})") from None


def load_full(path: Path) -> dict:
    """The payload of a full checkpoint file, memory-mapped (every rank maps the same pages; nothing is
    copied per rank), with the library's metadata keys checked."""
    check_structure(path)
    try:
        payload = _load_plain(path, path, mmap=True)
    except CheckpointError:
        raise
    except Exception as err:  # truncated, corrupt, or not a torch file at all
        raise CheckpointCorrupt(f"{path}: cannot read checkpoint ({first_line(err)})") from None
    check_meta(payload, path, checkpoint=path, extra_keys=FULL_PAYLOAD_KEYS)
    if not isinstance(payload.get("model"), dict):
        raise CheckpointCorrupt(f"{path}: not a checkpoint of this library (no model state)")
    return payload
