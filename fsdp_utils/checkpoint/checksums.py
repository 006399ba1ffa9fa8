"""Checksums: a checkpoint's files are CRC32-hashed while they are written (`ChecksumWriter`), recorded (a sharded
checkpoint's meta.json, a full file's sidecar) and checked against the record at load, the files spread over the
ranks (`verify`). CRC32 catches damage, not tampering (safe_read.py covers that), and is the fastest of the hashes
docs/checkpoints.md compares."""
from __future__ import annotations

import json
import logging
import os
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

from safe_io import nofollow
from safe_io.nofollow import write_beside

from ..distributed import DistEnv, agree
from .errors import CheckpointCorrupt, first_line
from .names import DCP_FILE_RE, FORMAT_VERSION, sidecar_of

log = logging.getLogger(__name__)

META_CRC_KEY = "meta_crc32"  # meta.json's own checksum, over its other keys
_CHUNK = 8 << 20  # bytes per read when hashing


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
    refused: nofollow.create). The run's own files go through its journal instead (safe_io/journal.py)."""
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


def meta_crc32(meta: dict) -> str:
    """The CRC32 of a sharded checkpoint's metadata (its canonical JSON, without the checksum itself): meta.json
    cannot hold the CRC32 of its own bytes, so it holds the one of its contents."""
    body = {k: v for k, v in meta.items() if k != META_CRC_KEY}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def with_meta_crc32(meta: dict) -> dict:
    return {**meta, META_CRC_KEY: meta_crc32(meta)}


# ---- checksums over the ranks: which rank hashes which file at a save, and the check of every file at a load


def owner(name: str, index: int, world_size: int) -> int:
    """The rank that hashes file `name` (the index-th of the checkpoint's files): DCP's `__{rank}_{i}.distcp`
    goes to the rank that wrote it (still in its page cache), everything else round-robin."""
    if (m := DCP_FILE_RE.match(name)) and int(m.group(1)) < world_size:
        return int(m.group(1))
    return index % world_size


def hash_own_files(folder: Path, rank: int, world_size: int) -> tuple[dict, float]:
    """{name: {"size", "crc32"}} of the files of a written checkpoint that this rank hashes, and the seconds it took."""
    start = time.perf_counter()
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    mine = {n: file_record(folder / n) for i, n in enumerate(names) if owner(n, i, world_size) == rank}
    return mine, time.perf_counter() - start


def verify(path: Path, records: dict[str, dict] | None, env: DistEnv) -> float:
    """Collective: check every file's size and CRC32 against the checkpoint's `records` (metadata.check_structure's),
    the files spread over the ranks; CheckpointCorrupt on every rank if any differs. Returns the seconds it took."""
    start = time.perf_counter()
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
