"""The checkpoint format on disk, shared by the checkpoint manager and the offline tools: names, metadata,
checksums, safe reading and the error texts.

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
Measured on one core: CRC32 5 GB/s, SHA-256 0.8 GB/s, BLAKE2b 0.7 GB/s (docs/checkpoints.md).
"""
from __future__ import annotations

import json
import os
import pickle
import re
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

FULL_RE = re.compile(r"^fsdp_cpt(\d+)\.pth$")
SHARDED_RE = re.compile(r"^fsdp_sharded_cpt(\d+)$")
TMP_PREFIX = ".tmp-"  # an interrupted save: never loaded, removed by the next save
CORRUPT_PREFIX = "corrupt-"  # moved aside after failing its checks: never loaded, never deleted automatically
META_NAME = "meta.json"
RNG_NAME = "rng.pt"
FORMAT_VERSION = 1
META_KEYS = ("format_version", "world_size", "model_config", "train_state")
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
    if actual != record["size"]:
        return f"{path}: corrupt checkpoint (expected {record['size']} bytes, found {actual})"
    return None


def check_file(path: Path, record: dict) -> str | None:
    """A problem (text naming the file) if its size or CRC32 differs from the record."""
    if problem := check_size(path, record):
        return problem
    if record.get("crc32") is None:  # written before checksums were recorded: the size is all we know
        return None
    actual = file_record(path)["crc32"]
    if actual != record["crc32"]:
        return f"{path}: corrupt checkpoint (CRC32 {actual}, recorded {record['crc32']}: the bytes changed after the save)"
    return None


def save_with_checksum(obj: Any, path: Path) -> tuple[dict, float]:
    """torch.save `obj` to `path`, flushed and fsynced; return the file's {"size", "crc32"} and the
    seconds spent computing the CRC32."""
    with path.open("wb") as f:
        writer = ChecksumWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:  # a full disk, a quota, a file size limit
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return writer.record(), writer.crc_seconds


def write_json(path: Path, payload: dict) -> None:
    """Write a small JSON file durably (flushed and fsynced) before it is renamed into place."""
    with path.open("w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def install_full(tmp: Path, final: Path) -> None:
    """Rename a written full checkpoint into place. A record left by a file of the same name goes first:
    it must never describe the new file (until its own is written, the new file loads unverified)."""
    sidecar_of(final).unlink(missing_ok=True)
    os.replace(tmp, final)


def write_record(final: Path, record: dict) -> None:
    """Write a full checkpoint's checksum record next to it (atomically)."""
    sidecar = sidecar_of(final)
    tmp = sidecar.with_name(TMP_PREFIX + sidecar.name)
    try:
        write_json(tmp, {"format_version": FORMAT_VERSION, "files": {final.name: record}})
        os.replace(tmp, sidecar)
    finally:
        tmp.unlink(missing_ok=True)


# ---- metadata -------------------------------------------------------------------------------------


def _records(files: object, where: Path) -> dict[str, dict]:
    """meta.json's "files": {name: {"size", "crc32"}}; checkpoints from before checksums hold {name: size}."""
    if not isinstance(files, dict):
        raise CheckpointCorrupt(f"{where}: not a checkpoint's metadata (no list of files)")
    records = {}
    for name, entry in files.items():
        if isinstance(entry, int):
            entry = {"size": entry, "crc32": None}
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or "/" in name:
            raise CheckpointCorrupt(f"{where}: not a checkpoint's metadata (bad entry for {name!r})")
        records[name] = entry
    return records


def read_sharded_meta(path: Path) -> dict:
    """meta.json of a complete sharded checkpoint, after checking that every file it lists has its size."""
    meta_path = path / META_NAME
    if not meta_path.is_file():
        raise CheckpointCorrupt(f"{path}: not a complete sharded checkpoint (no meta.json: an interrupted save or another folder)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointCorrupt(f"{meta_path}: incomplete or corrupt checkpoint ({err})") from None
    if not isinstance(meta, dict):
        raise CheckpointCorrupt(f"{meta_path}: not a checkpoint's meta.json")
    meta["files"] = _records(meta.get("files"), meta_path)
    for name, record in meta["files"].items():
        if problem := check_size(path / name, record):
            raise CheckpointCorrupt(problem)
    return meta


def read_full_record(pth: Path) -> dict[str, dict] | None:
    """The checksum record of a full checkpoint file, or None when it has none (a file converted or
    copied without its sidecar, or written before checksums were recorded)."""
    sidecar = sidecar_of(pth)
    if not sidecar.is_file():
        return None
    try:
        files = json.loads(sidecar.read_text()).get("files")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointCorrupt(f"{sidecar}: corrupt checksum record ({err})") from None
    return _records(files, sidecar)


def checksum_records(path: Path) -> dict[str, dict] | None:
    """{file name: record} of every file of a checkpoint (names relative to the checkpoint's folder for a
    sharded one, to the .pth's folder for a full one); None for a full file without a sidecar."""
    return read_sharded_meta(path)["files"] if path.is_dir() else read_full_record(path)


def check_structure(path: Path) -> None:
    """Cheap checks that need no reading of tensor data: the path exists, a file is a torch.save zip
    of the size recorded, a folder has its meta.json and every file it lists. Raises CheckpointError."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir():
        read_sharded_meta(path)
        return
    if not zipfile.is_zipfile(path):
        raise CheckpointCorrupt(f"{path}: not a checkpoint (not a file written by torch.save)")
    record = read_full_record(path)
    if record and path.name in record and (problem := check_size(path, record[path.name])):
        raise CheckpointCorrupt(problem)


def check_meta(meta: object, where: Path) -> dict:
    """The library's metadata keys are present and of the format version this code reads."""
    if not isinstance(meta, dict) or any(k not in meta for k in META_KEYS):
        raise CheckpointCorrupt(f"{where}: not a checkpoint of this library (expected keys {', '.join(META_KEYS)})")
    if meta["format_version"] != FORMAT_VERSION:
        raise CheckpointMismatch(f"{where}: checkpoint format_version {meta['format_version']}, this code reads {FORMAT_VERSION}")
    return meta


# ---- safe reading ----------------------------------------------------------------------------------

# What DCP's .metadata holds (torch 2.13 and 2.11, FSDP1 and FSDP2 saves): its metadata dataclasses, the
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


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: BinaryIO, where: Path):
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointUnsafe(
            f"{self.where}: refused: it references {module}.{name}, which checkpoint metadata never holds "
            f"(loading it would run code; a tampered or foreign file)")


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's .metadata, unpickled with only DCP's metadata classes admitted."""
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointUnsafe:
        raise
    except Exception as err:  # truncated, garbled, or another pickle
        raise CheckpointCorrupt(f"{path}: cannot read checkpoint metadata ({first_line(err)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorrupt(f"{path}: not DCP checkpoint metadata (a {type(metadata).__name__})")
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


def _load_plain(f: Any, where: Path, **kwargs: Any) -> Any:
    """torch.load(weights_only=True), its refusal of a pickled global turned into CheckpointUnsafe."""
    try:
        return torch.load(f, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        if found := re.search(r"Unsupported global: GLOBAL (\S+)", str(err)):
            raise CheckpointUnsafe(f"{where}: refused: it references {found.group(1)}, which a checkpoint never holds "
                                   f"(loading it would run code; a tampered or foreign file)") from None
        raise


def set_at(root: dict, path: tuple, value: Any) -> None:
    """root[path[0]][path[1]]... = value, creating dicts (str keys) and lists (int keys) on the way."""
    node: Any = root
    for key, next_key in zip(path, path[1:]):
        empty = {} if isinstance(next_key, str) else []
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
    check_meta(payload, path)
    if not isinstance(payload.get("model"), dict):
        raise CheckpointCorrupt(f"{path}: not a checkpoint of this library (no model state)")
    return payload
