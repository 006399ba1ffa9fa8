"""The prepared-data folder: a tokenizer, token shards (and chat data's mask shards), progress.json while
preparing, and meta.json written last, whose presence means the folder is complete (its layout: docs/data.md, "The
prepared folder"). Shard files are written under a .tmp name, renamed once complete and recorded in progress.json,
so an interrupted preparation leaves only whole, recorded shards. Every name a preparation may create is recorded
before the file is made, and only those are ever deleted; a folder is the library's only when its marker
(data-folder.json) says so. Each shard's sha256 per block and its largest token id are recorded, checked by the
loader at a block's first read. Nothing is written, read or deleted through a link (safe_io/nofollow.py)."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeGuard, get_args

import numpy as np

from safe_io import nofollow

from .errors import DataError, refusals_as_data_errors

log = logging.getLogger(__name__)

# Bump when the on-disk layout or tokenisation recipe changes, so old folders are rebuilt.
FORMAT_VERSION = 4
META_NAME = "meta.json"
PROGRESS_NAME = "progress.json"
TOKENIZER_NAME = "tokenizer.model"
HF_TOKENIZER_NAME = "hf_tokenizer"  # a folder saved by a transformers tokenizer
# The only names the library writes folders under: any other folder in the dataset folder is the user's.
FOLDER_NAMES = (HF_TOKENIZER_NAME, HF_TOKENIZER_NAME + ".tmp")
LOCK_NAME = "prepare.lock"
LOCK_TMP_NAME = LOCK_NAME + ".tmp"  # a new lock file, renamed over one with other hard links
MARKER_NAME = "data-folder.json"
RECORD_LIMIT = 1 << 30  # bytes: more than meta.json or progress.json of any corpus holds
MARKER_KIND = "a prepared data folder of this library: only the files its records name are the library's"
MARKER_VERSION = 1
# Shard files are hashed in blocks of this size: the loader checks a block on its first read, so the
# check costs each rank one block's hash for each block it reads, and nothing at start-up, whatever the
# size of the store (docs/data.md gives the figures).
HASH_BLOCK_BYTES = 16 << 20
# A SentencePiece model is a few MB, the largest file of a Hugging Face tokenizer's folder tens of MB: a file
# past this is no tokenizer, and reading it whole could exhaust memory.
MAX_TOKENIZER_BYTES = 64 << 20
# Written by the library under these names whatever its records say (write_record, the lock).
FIXED_NAMES = (META_NAME, META_NAME + ".tmp", PROGRESS_NAME, PROGRESS_NAME + ".tmp", LOCK_NAME, LOCK_TMP_NAME)


@dataclass
class PreparedData:
    root: Path
    train_files: list[Path]
    val_files: list[Path]
    tokenizer_path: Path
    tokenizer_sha256: str
    dtype: np.dtype
    vocab_size: int
    num_train_tokens: int
    num_val_tokens: int
    format: str = "text"  # "chat": conversations, with a mask store beside the token store
    train_mask_files: list[Path] = field(default_factory=list)  # data.format=chat: one per train file
    val_mask_files: list[Path] = field(default_factory=list)
    hashes: BlockHashes | None = None  # of every shard file, checked by the loader as it reads
    max_token_id: int = -1  # the largest token id in the shards (below vocab_size)


@dataclass(frozen=True)
class BlockHashes:
    """The sha256 (hex) of each block_bytes block of each shard file of a folder, by file name."""

    block_bytes: int
    by_name: dict[str, list[str]]
    record: Path  # the meta.json they come from, for messages


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


DataFormat = Literal["text", "chat"]  # data.format: what a prepared folder holds
FORMATS = get_args(DataFormat)
# The names of a shard's files in a meta.json or progress.json shard record: tokens, and masks for chat.
TOKEN_KEYS = ("train", "val")
MASK_KEYS = ("train_mask", "val_mask")


def shard_names(index: int) -> tuple[str, str]:
    return f"train-{index:05d}.bin", f"val-{index:05d}.bin"


def mask_names(index: int) -> tuple[str, str]:
    return f"train-{index:05d}.mask", f"val-{index:05d}.mask"


def data_format(record: dict) -> str:
    """The format a meta.json or progress.json records; folders from before chat data hold text."""
    return record.get("format", "text") if isinstance(record, dict) else "text"


def format_problem(path: str | Path, found: str, wanted: str) -> str | None:
    """Why a prepared folder of data format `found` cannot be trained on with data.format=wanted, or None."""
    if found == wanted:
        return None
    return (f"{path} holds {found} data (prepared with data.format={found}), not {wanted}: set data.format={found}, "
            f"or prepare the corpus with data.format={wanted} into another folder")


def read_tokenizer_file(path: Path) -> bytes:
    """The bytes of a tokenizer file (a SentencePiece model, a file of a tokenizer's folder), as every reader of one
    reads it: a regular file, opened without blocking (a FIFO or a device is refused, never read), of at most
    MAX_TOKENIZER_BYTES whatever its size says; UnsafePath (an OSError) in one line naming it otherwise. A link is
    followed: the user may keep their models anywhere (a hub cache's files are links); in a folder the library
    keeps (a prepared folder, a run's), whoever names the file refuses a link there first (nofollow.check)."""
    return nofollow.read_capped(path, limit=MAX_TOKENIZER_BYTES, follow_links=True, what="a tokenizer file")


def tokenizer_sha256(path: Path) -> str:
    """sha256 of a tokenizer file, or of a tokenizer folder's files (names and contents), each read as every tokenizer
    is (read_tokenizer_file: UnsafePath in one line for a FIFO, a device or a file past its size bound; in a folder
    too, where a library would open it by name)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if not p.is_dir()) if path.is_dir() else [path]
    for file in files:
        digest.update(file.relative_to(path).as_posix().encode() if path.is_dir() else b"")
        digest.update(read_tokenizer_file(file))
    return digest.hexdigest()


# ---------------------------------------------------------------- small JSON files


@refusals_as_data_errors()
def read_json(path: Path) -> dict:
    try:
        payload = json.loads(nofollow.read_small(path, limit=RECORD_LIMIT).decode("utf-8"))
    except (DataError, nofollow.UnsafePath):
        raise
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON or bad UTF-8
        raise DataError(f"cannot read {path}: {err}") from None
    if not isinstance(payload, dict):
        raise DataError(f"{path} does not hold a JSON object")
    return payload


def write_atomic(path: Path, data: bytes) -> None:
    """path holds data, or (interrupted) what it held before: written under path.tmp, then renamed."""
    nofollow.replace_file(path, data, tmp=path.with_name(path.name + ".tmp"))


def _record_digest(record: dict) -> str:
    body = {key: value for key, value in record.items() if key != "record_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def write_record(path: Path, record: dict) -> None:
    """meta.json or progress.json, sealed with a checksum of its content: a damaged or edited record is
    never trusted, neither to name files to delete nor to describe the data."""
    sealed = {**record, "record_sha256": _record_digest(record)}
    write_atomic(path, (json.dumps(sealed, indent=1) + "\n").encode("utf-8"))


def read_record(path: Path) -> dict:
    """meta.json or progress.json as written by write_record; {} when missing, unreadable, damaged, or not a
    file (a link is not followed)."""
    try:
        record = read_json(path) if nofollow.kind_at(path) == "a file" else {}
    except DataError:
        return {}
    return record if record.get("record_sha256") == _record_digest(record) else {}


def _field(meta: dict, name: str, kind: type, where: Path):
    value = meta.get(name) if isinstance(meta, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DataError(f"{where}: field '{name}' missing or not a {kind.__name__}")
    return value


def _count(meta: dict, name: str, where: Path) -> int:
    value = _field(meta, name, int, where)
    if value < 0:
        raise DataError(f"{where}: field '{name}' is negative ({value})")
    return value


def is_plain_name(name: object) -> TypeGuard[str]:
    """A file name directly inside the folder: no path separators, no '..', nothing absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def _file_name(meta: dict, name: str, where: Path) -> str:
    value = _field(meta, name, str, where)
    if not is_plain_name(value):
        raise DataError(f"{where}: field '{name}' is {value!r}, not a file name inside the folder")
    return value


def hash_block_bytes(record: dict, where: Path) -> int:
    """The block size a record's shard hashes were taken with."""
    value = _count(record, "hash_block_bytes", where)
    if not (4096 <= value <= 1 << 40 and value % 8 == 0):
        raise DataError(f"{where}: field 'hash_block_bytes' is {value}, not a multiple of 8 from 4096 to 2**40")
    return value


def block_digest(data) -> str:
    """The recorded hash of one block of a shard file (bytes, or any contiguous buffer)."""
    return hashlib.sha256(data).hexdigest()


def scan_file(path: Path, *, block_bytes: int, dtype: np.dtype | None = None) -> tuple[list[str], int]:
    """(the hash of each block, the largest token id or -1) of a shard file; the largest id only with dtype."""
    digests, largest = [], -1
    with os.fdopen(nofollow.open_fd(path, os.O_RDONLY), "rb") as file:
        while block := file.read(block_bytes):
            digests.append(block_digest(block))
            if dtype is not None and len(block) >= dtype.itemsize:
                whole = len(block) // dtype.itemsize * dtype.itemsize
                largest = max(largest, int(np.frombuffer(block[:whole], dtype=dtype).max()))
    return digests, largest


# ---------------------------------------------------------------- reading a complete folder


@refusals_as_data_errors()
def load_prepared(dataset_dir: str | Path) -> PreparedData:
    """Open a complete prepared folder, checking that every file meta.json names is there, whole, and that the
    tokenizer is the one the tokens were made with (the shards' contents are checked as they are read)."""
    root = Path(dataset_dir)
    meta_path = root / META_NAME
    if not nofollow.check(meta_path):
        raise DataError(f"no prepared data in {root}: {meta_path} not found (prepare it with scripts/prepare_data.py)")
    meta = read_json(meta_path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{root} was prepared by another version of this library (format "
                        f"{str(meta.get('format_version'))[:20]}, expected {FORMAT_VERSION}); prepare it again")
    if meta.get("record_sha256") != _record_digest(meta):
        raise DataError(f"{meta_path} is damaged or was edited (its checksum does not match); delete {root} and "
                        f"prepare it again, or choose another data.dataset_dir")
    dtype_name = _field(meta, "dtype", str, meta_path)
    if dtype_name not in ("uint16", "uint32"):
        raise DataError(f"{meta_path}: field 'dtype' is {dtype_name!r}, expected uint16 or uint32")
    dtype = np.dtype(dtype_name)
    vocab_size = _count(meta, "vocab_size", meta_path)
    if not 0 < vocab_size <= np.iinfo(dtype).max + 1:
        raise DataError(f"{meta_path}: field 'vocab_size' is {vocab_size}, which {dtype_name} token ids cannot hold")
    fmt = data_format(meta)
    if fmt not in FORMATS:
        raise DataError(f"{meta_path}: field 'format' is {str(fmt)[:20]!r}, expected text or chat")
    shards = _field(meta, "shards", list, meta_path)
    block_bytes = hash_block_bytes(meta, meta_path)
    for shard in shards:
        check_shard(root, shard, dtype, where=meta_path, masked=fmt == "chat", block_bytes=block_bytes)
        _check_token_range(shard, vocab_size, where=meta_path)
    prepared = PreparedData(
        root=root,
        train_files=[root / shard["train"] for shard in shards],
        val_files=[root / shard["val"] for shard in shards],
        tokenizer_path=root / _file_name(meta, "tokenizer_file", meta_path),
        tokenizer_sha256=_field(meta, "tokenizer_sha256", str, meta_path),
        dtype=dtype,
        vocab_size=vocab_size,
        num_train_tokens=_count(meta, "num_train_tokens", meta_path),
        num_val_tokens=_count(meta, "num_val_tokens", meta_path),
        format=fmt,
        train_mask_files=[root / shard["train_mask"] for shard in shards] if fmt == "chat" else [],
        val_mask_files=[root / shard["val_mask"] for shard in shards] if fmt == "chat" else [],
        hashes=BlockHashes(block_bytes, {shard[key]: shard["sha256"][key] for shard in shards
                                         for key in _shard_keys(fmt == "chat")}, meta_path),
        max_token_id=max((shard["max_token_id"] for shard in shards), default=-1),
    )
    for split, num in (("train", prepared.num_train_tokens), ("val", prepared.num_val_tokens)):
        if num != sum(shard[f"num_{split}_tokens"] for shard in shards):
            raise DataError(f"{meta_path}: field 'num_{split}_tokens' ({num}) is not the sum of its shards' tokens")
    check_tokenizer(prepared.tokenizer_path, prepared.tokenizer_sha256, where=meta_path)
    return prepared


def check_tokenizer(path: Path, sha256: str, *, where: Path) -> None:
    """The folder's tokenizer (a file, or a saved folder) is there and is the one its tokens were made with."""
    if not nofollow.check(path, folder_ok=path.name in FOLDER_NAMES):
        raise DataError(f"prepared tokenizer missing: {path}")
    if tokenizer_sha256(path) != sha256:
        raise DataError(f"{path} is not the tokenizer the data in {path.parent} was made with (its sha256 differs "
                        f"from the one {where.name} records); put the original back or prepare {path.parent} again")


def _shard_keys(masked: bool) -> tuple[str, ...]:
    return TOKEN_KEYS + (MASK_KEYS if masked else ())


def _check_token_range(shard: dict, vocab_size: int, *, where: Path) -> None:
    largest = _field(shard, "max_token_id", int, where)
    if not -1 <= largest < vocab_size:
        raise DataError(f"{where}: shard {shard['train']} holds token id {largest}, outside the tokenizer's "
                        f"vocabulary of {vocab_size}; prepare {where.parent} again")


def _check_hashes(shard: dict, key: str, num_bytes: int, block_bytes: int, *, where: Path) -> None:
    hashes = shard.get("sha256")
    digests = hashes.get(key) if isinstance(hashes, dict) else None
    expected = -(-num_bytes // block_bytes)
    if (not isinstance(digests, list) or len(digests) != expected
            or not all(isinstance(d, str) and len(d) == 64 and set(d) <= set("0123456789abcdef") for d in digests)):
        raise DataError(f"{where}: the hashes of {shard[key]} are missing or not {expected} sha256 digests")


def check_shard(root: Path, shard: dict, dtype: np.dtype, *, where: Path, masked: bool = False,
                block_bytes: int) -> None:
    """A recorded shard's two token files (and with masked, its two mask files, one byte per token) exist
    with exactly the recorded number of tokens, and with a recorded hash for each block."""
    if not isinstance(shard, dict):
        raise DataError(f"{where}: a shard is {type(shard).__name__}, not an object")
    for split in ("train", "val"):
        num_tokens = _count(shard, f"num_{split}_tokens", where)
        files = [(split, dtype.itemsize, "token")] + ([(f"{split}_mask", 1, "mask")] if masked else [])
        for key, itemsize, kind in files:
            path = root / _file_name(shard, key, where)
            expected = num_tokens * itemsize
            if not nofollow.check(path):
                raise DataError(f"prepared {kind} file missing: {path}")
            if path.stat().st_size != expected:
                raise DataError(f"{path} is {path.stat().st_size} bytes but {where.name} says {num_tokens} tokens "
                                f"({expected} bytes); delete {root} to prepare it again")
            _check_hashes(shard, key, expected, block_bytes, where=where)


def verify_shard(root: Path, shard: dict, dtype: np.dtype, *, masked: bool, block_bytes: int) -> None:
    """Read a recorded shard's files whole: each block must have its recorded hash, and the tokens the recorded
    largest id."""
    largest = -1
    for key in _shard_keys(masked):
        path = root / shard[key]
        digests, file_max = scan_file(path, block_bytes=block_bytes, dtype=None if key in MASK_KEYS else dtype)
        if digests != shard["sha256"][key]:
            raise DataError(f"{path} does not match its recorded hashes")
        largest = max(largest, file_max)
    if largest != shard.get("max_token_id"):
        raise DataError(f"{root / shard['train']}: its largest token id is {largest}, not the recorded one")


def complete_fingerprint(root: Path) -> str | None:
    """The source fingerprint of a complete folder, None when there is none (or it is unreadable)."""
    return read_record(root / META_NAME).get("source_fingerprint")


# ---------------------------------------------------------------- writing, resumably


def resumable_shards(root: Path, progress: dict, dtype: np.dtype) -> list[dict]:
    """The finished shards an interrupted preparation recorded in progress (read from progress.json, of
    the same inputs and settings), in order. The prefix stops at the first shard whose files are not whole,
    or not what was recorded (each is read once, to check its hashes)."""
    shards = progress.get("shards")
    if progress.get("dtype") != dtype.name or not isinstance(shards, list):
        return []
    masked, where = data_format(progress) == "chat", root / PROGRESS_NAME
    kept = []
    try:
        block_bytes = hash_block_bytes(progress, where)
        for shard in shards:
            check_shard(root, shard, dtype, where=where, masked=masked, block_bytes=block_bytes)
            verify_shard(root, shard, dtype, masked=masked, block_bytes=block_bytes)
            kept.append(shard)
    except (DataError, OSError):  # a shard missing, damaged, or refused (a link, ...)
        pass
    return kept


# ---------------------------------------------------------------- what the library wrote


def _names_in(record: dict) -> set[str]:
    """The file names a meta.json or progress.json record claims (only plain names inside the folder)."""
    names = [record.get("tokenizer_file")]
    if isinstance(record.get("files"), list):
        names += record["files"]
    if isinstance(record.get("shards"), list):
        names += [shard.get(key) for shard in record["shards"] if isinstance(shard, dict)
                  for key in TOKEN_KEYS + MASK_KEYS]
    return {name for name in names if is_plain_name(name)}


def recorded_names(root: Path) -> set[str]:
    """Every name in root that the library can show it wrote: its fixed files and those its records name
    (not the marker, which stays for the folder's life)."""
    return {*FIXED_NAMES, *_names_in(read_record(root / META_NAME)), *_names_in(read_record(root / PROGRESS_NAME))}


def is_marked(root: Path) -> bool:
    """root holds the library's marker. One being written by a process that just created it is waited for."""
    for _ in range(20):
        marker = read_record(root / MARKER_NAME)
        if marker:
            return marker.get("kind") == MARKER_KIND and isinstance(marker.get("marker_version"), int)
        try:
            if os.lstat(root / MARKER_NAME).st_size or nofollow.kind_at(root / MARKER_NAME) != "a file":
                return False
        except OSError:  # no marker
            return False
        time.sleep(0.05)
    return False


def is_ours(root: Path) -> bool:
    """root is a folder this library prepared: its marker says so or, in a folder without one (the marker is
    written once a preparation starts), a meta.json or progress.json whose checksum holds."""
    return is_marked(root) or bool(read_record(root / META_NAME)) or bool(read_record(root / PROGRESS_NAME))


def foreign_names(root: Path) -> list[str]:
    """What root holds that the library's records do not name (the user's files), sorted: everything, in a
    folder that is not the library's."""
    try:
        names = set(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []  # nothing there yet (creating it says why it cannot be)
    except OSError as err:
        raise DataError(f"cannot list {root}: {err.strerror or err}") from None
    if names and is_ours(root):
        names -= {*recorded_names(root), MARKER_NAME}
    return sorted(names)


def claim_folder(root: Path) -> None:
    """Create root if need be and mark it as the library's (a new or empty folder, or one of an earlier
    preparation: the caller has checked that it holds nothing else)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"cannot create {root}: {err.strerror or err}") from None
    marker = {"kind": MARKER_KIND, "marker_version": MARKER_VERSION}
    payload = json.dumps({**marker, "record_sha256": _record_digest(marker)}, indent=1) + "\n"
    try:
        with nofollow.open_new(root / MARKER_NAME) as file:
            file.write(payload.encode("utf-8"))
    except FileExistsError:
        return  # marked already (by an earlier preparation, or one running beside this)
    except nofollow.UnsafePath:  # its own line, naming the path: a DataError at data's boundary
        raise
    except OSError as err:
        raise DataError(f"cannot write in {root}: {err.strerror or err}") from None


def remove_names(root: Path, names: set[str]) -> None:
    """Delete these recorded names (files, or a saved tokenizer folder); missing ones are fine."""
    for name in sorted(names):
        nofollow.remove(root / name, folder_ok=name in FOLDER_NAMES)


def clear_folder(root: Path) -> None:
    """Remove everything an earlier preparation recorded, and nothing else. progress.json first takes
    over the names meta.json records, so an interruption midway leaves every survivor recorded."""
    names = recorded_names(root) - set(FIXED_NAMES)
    write_record(root / PROGRESS_NAME, {"files": sorted(names), "shards": []})
    nofollow.remove(root / META_NAME)
    remove_names(root, names)


class FolderInUse(DataError):
    """Another process holds the folder's lock: a preparation writing it, or a training job reading it."""


@contextmanager
def folder_lock(root: Path, *, wait: Callable[[str], bool] | None = None) -> Iterator[bool]:
    """Hold root's preparation lock (flock: released however the holder ends; a lock file with other hard links is
    replaced, never written: nofollow.lock_file). Held by another process (a preparation, or a training job reading
    the folder: see hold_for_reading): FolderInUse, or wait while `wait(its holder's line)` says to. Yields True
    when this one waited."""
    _stop_reading(root)  # this process's own read of the folder is no other reader
    try:
        held = nofollow.lock_file(root / LOCK_NAME, holder=f"host {socket.gethostname()}, pid {os.getpid()}",
                                  wait=wait, tmp=root / LOCK_TMP_NAME)
    except nofollow.LockHeld as err:
        raise FolderInUse(f"{root}: its {LOCK_NAME} is held by another process ({err.holder})") from None
    except nofollow.UnsafePath:  # its own line, naming the path: a DataError at data's boundary
        raise
    except OSError as err:
        raise DataError(f"cannot write in {root}: {err.strerror or err}") from None
    try:
        if not held.locked:  # a filesystem without locks
            log.warning("cannot lock %s: nothing stops a second preparation of %s at the same time", root / LOCK_NAME,
                        root)
        yield held.waited
    finally:
        os.close(held.fd)


# Shared locks on the lock files of the folders this process reads, held until it ends: fd by folder.
_READING: dict[Path, int] = {}
READ_LOCK_WAIT_S = 10.0  # a preparation that only checks a folder holds its lock for a moment


def hold_for_reading(root: Path) -> None:
    """Hold a shared lock on root's preparation lock until this process ends, so that no preparation replaces the data
    while this process reads it (one that would, refuses: folder_lock). A folder without a lock file, or whose lock
    file this process cannot open (a read-only copy), is read without it. DataError if a preparation holds it for
    longer than READ_LOCK_WAIT_S."""
    root = Path(root).absolute()
    if root in _READING or nofollow.kind_at(root / LOCK_NAME) != "a file":
        return
    try:
        fd = nofollow.open_fd(root / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return
    deadline = time.monotonic() + READ_LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            holder = nofollow.holder_of(fd)
            os.close(fd)
            raise DataError(f"{root} is being prepared by another process ({holder}); wait for it to finish") from None
        except OSError:  # a filesystem without locks
            os.close(fd)
            return
    _READING[root] = fd


def _stop_reading(root: Path) -> None:
    fd = _READING.pop(Path(root).absolute(), None)
    if fd is not None:
        os.close(fd)


class ShardWriter:
    """Appends the train and val tokens of consecutive chunks to the current shard; `finish_shard`
    makes it permanent and records it in progress.json, with the chunk it ends at."""

    def __init__(self, root: Path, *, dtype: np.dtype, progress: dict):
        self.root = root
        self.dtype = dtype
        self.progress = progress  # source_fingerprint, dtype, tokenizer, format, hash_block_bytes, shards so far
        self.masked = data_format(progress) == "chat"  # a mask file beside each token file
        self.block_bytes = hash_block_bytes(progress, root / PROGRESS_NAME)
        self._files: list = []
        self._paths: list[Path] = []
        self.num_tokens = [0, 0]  # train, val tokens of the current shard

    def _names(self, index: int) -> tuple[str, ...]:
        """The current shard's files: train and val tokens, then (masked) train and val masks."""
        return shard_names(index) + (mask_names(index) if self.masked else ())

    @property
    def shards(self) -> list[dict]:
        return self.progress["shards"]

    def append(self, train: np.ndarray, val: np.ndarray, train_mask: np.ndarray | None = None,
               val_mask: np.ndarray | None = None) -> None:
        if not len(train) and not len(val):
            return
        if not self._files:
            self._open()
        arrays = [train.astype(self.dtype, copy=False), val.astype(self.dtype, copy=False)]
        if self.masked:
            assert train_mask is not None and val_mask is not None, "a chat folder's shards have masks"
            assert len(train_mask) == len(train) and len(val_mask) == len(val), "one mask byte per token"
            arrays += [train_mask.astype(np.uint8, copy=False), val_mask.astype(np.uint8, copy=False)]
        for i, values in enumerate(arrays):
            with self._writing(self._paths[i]):
                # file.write, not ndarray.tofile: tofile reports a full disk without its errno.
                self._files[i].write(values.data)
        self.num_tokens[0] += len(train)
        self.num_tokens[1] += len(val)

    def _open(self) -> None:
        names = self._names(len(self.shards))
        self._paths = [self.root / (name + ".tmp") for name in names]
        # Recorded before they exist: whatever happens next, these names are known to be ours.
        new = [n for name in names for n in (name, name + ".tmp") if n not in self.progress["files"]]
        if new:
            self.progress["files"] += new
            with self._writing(self.root / PROGRESS_NAME):
                write_record(self.root / PROGRESS_NAME, self.progress)
        for path in self._paths:
            with self._writing(path):
                self._files.append(nofollow.create(path))

    def finish_shard(self, *, end_chunk: int, totals: dict) -> None:
        if not self._files:
            return
        names = self._names(len(self.shards))
        for file, tmp, name in zip(self._files, self._paths, names, strict=True):
            with self._writing(tmp):
                file.flush()
                os.fsync(file.fileno())  # on disk before progress.json says so
                file.close()
                nofollow.replace(tmp, self.root / name)
        shard = {**dict(zip(TOKEN_KEYS + MASK_KEYS, names, strict=False)),
                 "num_train_tokens": self.num_tokens[0], "num_val_tokens": self.num_tokens[1],
                 "end_chunk": end_chunk, "totals": totals}
        with self._writing(self.root / names[0]):
            self._record_contents(shard)
        self.shards.append(shard)
        with self._writing(self.root / PROGRESS_NAME):
            write_record(self.root / PROGRESS_NAME, self.progress)
        self._files, self._paths, self.num_tokens = [], [], [0, 0]

    def abort(self) -> None:
        """Drop the unfinished shard (its .tmp files); the finished ones stay for a rerun."""
        for file in self._files:
            try:
                file.close()
            except OSError:
                pass  # flushing what is buffered fails again on a full disk; the file goes anyway
        for path in self._paths:
            if nofollow.kind_at(path) == "a file":  # anything else was never this writer's
                path.unlink()
        self._files, self._paths = [], []

    def _record_contents(self, shard: dict) -> None:
        """The hash of each block of the shard's files, and its largest token id, read back from the disk."""
        scans = {key: scan_file(self.root / shard[key], block_bytes=self.block_bytes,
                                dtype=None if key in MASK_KEYS else self.dtype) for key in _shard_keys(self.masked)}
        shard["sha256"] = {key: digests for key, (digests, _) in scans.items()}
        shard["max_token_id"] = max(largest for _, largest in scans.values())

    @contextmanager
    def _writing(self, path: Path):
        """A failed write of `path` as one line; the unfinished shard is dropped."""
        try:
            yield
        except OSError as err:
            self.abort()
            if isinstance(err, nofollow.UnsafePath):  # its own line (see claim_folder)
                raise
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DataError(f"disk full while writing {path}; free some space and rerun to continue "
                                f"after the {len(self.shards)} finished shards") from None
            raise DataError(f"cannot write {path}: {err.strerror or err}") from None

    def hold_out_tail(self, num_tokens: int) -> int:
        """Move the last num_tokens training tokens of the last shard into its (empty) val file, for a
        corpus too small for any document to be held out. Returns how many tokens moved."""
        shard = self.shards[-1]
        num_tokens = min(num_tokens, shard["num_train_tokens"] - 1)
        keep = shard["num_train_tokens"] - num_tokens
        pairs = [("train", "val", self.dtype)]
        if self.masked:
            pairs.append(("train_mask", "val_mask", np.dtype(np.uint8)))
        for train_key, val_key, dtype in pairs:
            train_path, val_path = self.root / shard[train_key], self.root / shard[val_key]
            tail = nofollow.read_small(train_path, limit=shard["num_train_tokens"] * dtype.itemsize)
            with self._writing(val_path):
                write_atomic(val_path, tail[keep * dtype.itemsize:])
                nofollow.truncate(train_path, keep * dtype.itemsize)
        shard.update(num_train_tokens=keep, num_val_tokens=shard["num_val_tokens"] + num_tokens)
        self._record_contents(shard)
        write_record(self.root / PROGRESS_NAME, self.progress)
        return num_tokens
