"""The prepared-data folder: a tokenizer, token shards, and a meta file written last.

    DIR/tokenizer.model (or hf_tokenizer/)   the tokenizer the tokens were made with
    DIR/train-00000.bin, val-00000.bin, ...  flat token ids (uint16, or uint32 past 65536 pieces),
                                             documents separated by EOS; shard k holds the training and
                                             held-out documents of one stretch of the corpus
    DIR/train-00000.mask, val-00000.mask     data.format=chat only: one byte per token of the .bin file
                                             beside it, 1 where the token is trained on (the assistant's)
    DIR/progress.json                        while preparing: the finished shards, for resuming
    DIR/meta.json                            written last: its presence means the folder is complete
    DIR/prepare.lock                         held (flock) by the process preparing the folder

A shard's files are written under a .tmp name and renamed once complete, then recorded in
progress.json (written atomically), so an interrupted preparation leaves only whole, recorded shards
and a rerun continues after the last of them; nothing without meta.json is ever read for training.

Every name a preparation may create is recorded ("files" in progress.json) before the file is made, so
the folder's records always name everything the library wrote there: only those are ever deleted, and a
folder holding anything else is not the library's to write into.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

import numpy as np

from .errors import DataError

log = logging.getLogger(__name__)

# Bump when the on-disk layout or tokenisation recipe changes, so old folders are rebuilt.
FORMAT_VERSION = 3
META_NAME = "meta.json"
PROGRESS_NAME = "progress.json"
TOKENIZER_NAME = "tokenizer.model"
HF_TOKENIZER_NAME = "hf_tokenizer"  # a folder saved by a transformers tokenizer
LOCK_NAME = "prepare.lock"
# Written by the library under these names whatever its records say (write_json_atomic, the lock).
FIXED_NAMES = (META_NAME, META_NAME + ".tmp", PROGRESS_NAME, PROGRESS_NAME + ".tmp", LOCK_NAME)


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


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


FORMATS = ("text", "chat")
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


def tokenizer_sha256(path: Path) -> str:
    """sha256 of a tokenizer file, or of a tokenizer folder's files (names and contents)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(file.relative_to(path).as_posix().encode() if path.is_dir() else b"")
        digest.update(file.read_bytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- small JSON files


def read_json(path: Path) -> dict:
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON or bad UTF-8
        raise DataError(f"cannot read {path}: {err}") from None
    if not isinstance(payload, dict):
        raise DataError(f"{path} does not hold a JSON object")
    return payload


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _record_digest(record: dict) -> str:
    body = {key: value for key, value in record.items() if key != "record_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def write_record(path: Path, record: dict) -> None:
    """meta.json or progress.json, sealed with a checksum of its content: a damaged or edited record is
    never trusted, neither to name files to delete nor to describe the data."""
    write_json_atomic(path, {**record, "record_sha256": _record_digest(record)})


def read_record(path: Path) -> dict:
    """meta.json or progress.json as written by write_record; {} when missing, unreadable or damaged."""
    try:
        record = read_json(path) if path.is_file() else {}
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


# ---------------------------------------------------------------- reading a complete folder


def load_prepared(dataset_dir: str | Path) -> PreparedData:
    """Open a complete prepared folder, checking that every file meta.json names is there, whole."""
    root = Path(dataset_dir)
    meta_path = root / META_NAME
    if not meta_path.is_file():
        raise DataError(f"no prepared data in {root}: {meta_path} not found (prepare it with scripts/prepare_data.py)")
    meta = read_json(meta_path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{root} was prepared by another version of this library (format "
                        f"{str(meta.get('format_version'))[:20]}, expected {FORMAT_VERSION}); prepare it again")
    if meta.get("record_sha256") != _record_digest(meta):
        raise DataError(f"{meta_path} is damaged or was edited (its checksum does not match); prepare {root} again")
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
    for shard in shards:
        check_shard(root, shard, dtype, where=meta_path, masked=fmt == "chat")
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
    )
    for split, num in (("train", prepared.num_train_tokens), ("val", prepared.num_val_tokens)):
        if num != sum(shard[f"num_{split}_tokens"] for shard in shards):
            raise DataError(f"{meta_path}: field 'num_{split}_tokens' ({num}) is not the sum of its shards' tokens")
    if not prepared.tokenizer_path.exists():
        raise DataError(f"prepared tokenizer missing: {prepared.tokenizer_path}")
    return prepared


def check_shard(root: Path, shard: dict, dtype: np.dtype, *, where: Path, masked: bool = False) -> None:
    """A recorded shard's two token files (and with masked, its two mask files, one byte per token) exist
    with exactly the recorded number of tokens."""
    if not isinstance(shard, dict):
        raise DataError(f"{where}: a shard is {type(shard).__name__}, not an object")
    for split in ("train", "val"):
        num_tokens = _count(shard, f"num_{split}_tokens", where)
        files = [(split, dtype.itemsize, "token")] + ([(f"{split}_mask", 1, "mask")] if masked else [])
        for key, itemsize, kind in files:
            path = root / _file_name(shard, key, where)
            expected = num_tokens * itemsize
            if not path.is_file():
                raise DataError(f"prepared {kind} file missing: {path}")
            if path.stat().st_size != expected:
                raise DataError(f"{path} is {path.stat().st_size} bytes but {where.name} says {num_tokens} tokens "
                                f"({expected} bytes); delete {root} to prepare it again")


def complete_fingerprint(root: Path) -> str | None:
    """The source fingerprint of a complete folder, None when there is none (or it is unreadable)."""
    return read_record(root / META_NAME).get("source_fingerprint")


# ---------------------------------------------------------------- writing, resumably


def resumable_shards(root: Path, progress: dict, dtype: np.dtype) -> list[dict]:
    """The finished shards an interrupted preparation recorded in progress (read from progress.json, of
    the same inputs and settings), in order. The prefix stops at the first shard whose files are not whole."""
    shards = progress.get("shards")
    if progress.get("dtype") != dtype.name or not isinstance(shards, list):
        return []
    kept = []
    for shard in shards:
        try:
            check_shard(root, shard, dtype, where=root / PROGRESS_NAME, masked=data_format(progress) == "chat")
        except DataError:
            break
        kept.append(shard)
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
    """Every name in root that the library can show it wrote: its fixed files and those its records name."""
    return {*FIXED_NAMES, *_names_in(read_record(root / META_NAME)), *_names_in(read_record(root / PROGRESS_NAME))}


def foreign_names(root: Path) -> list[str]:
    """What root holds that the library's records do not name (the user's files), sorted."""
    try:
        return sorted(set(os.listdir(root)) - recorded_names(root))
    except (FileNotFoundError, NotADirectoryError):
        return []  # nothing there yet (creating it says why it cannot be)
    except OSError as err:
        raise DataError(f"cannot list {root}: {err.strerror or err}") from None


def remove_names(root: Path, names: set[str]) -> None:
    """Delete these recorded names (files, or a saved tokenizer folder); missing ones are fine."""
    for name in sorted(names):
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def clear_folder(root: Path) -> None:
    """Remove everything an earlier preparation recorded, and nothing else. progress.json first takes
    over the names meta.json records, so an interruption midway leaves every survivor recorded."""
    names = recorded_names(root) - set(FIXED_NAMES)
    write_record(root / PROGRESS_NAME, {"files": sorted(names), "shards": []})
    (root / META_NAME).unlink(missing_ok=True)
    remove_names(root, names)


@contextmanager
def folder_lock(root: Path) -> Iterator[bool]:
    """Hold root's preparation lock (flock: released however the holder ends). Yields True when another
    process held it first and this one waited for it to finish."""
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise DataError(f"cannot write in {root}: {err.strerror or err}") from None
    try:
        waited = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process starting up"
            log.info("waiting for another preparation of %s to finish (%s)", root, holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = True
        except OSError as err:  # a filesystem without locks
            log.warning("cannot lock %s (%s): nothing stops a second preparation of %s at the same time",
                        path, err.strerror, root)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
        yield waited
    finally:
        os.close(fd)


class ShardWriter:
    """Appends the train and val tokens of consecutive chunks to the current shard; `finish_shard`
    makes it permanent and records it in progress.json, with the chunk it ends at."""

    def __init__(self, root: Path, *, dtype: np.dtype, progress: dict):
        self.root = root
        self.dtype = dtype
        self.progress = progress  # source_fingerprint, dtype, tokenizer, format, shards (finished so far)
        self.masked = data_format(progress) == "chat"  # a mask file beside each token file
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
                self._files.append(open(path, "wb"))

    def finish_shard(self, *, end_chunk: int, totals: dict) -> None:
        if not self._files:
            return
        names = self._names(len(self.shards))
        for file, tmp, name in zip(self._files, self._paths, names, strict=True):
            with self._writing(tmp):
                file.flush()
                os.fsync(file.fileno())  # on disk before progress.json says so
                file.close()
            os.replace(tmp, self.root / name)
        self.shards.append({**dict(zip(TOKEN_KEYS + MASK_KEYS, names, strict=False)),
                            "num_train_tokens": self.num_tokens[0], "num_val_tokens": self.num_tokens[1],
                            "end_chunk": end_chunk, "totals": totals})
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
            path.unlink(missing_ok=True)
        self._files, self._paths = [], []

    @contextmanager
    def _writing(self, path: Path):
        """A failed write of `path` as one line; the unfinished shard is dropped."""
        try:
            yield
        except OSError as err:
            self.abort()
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
            tail = np.fromfile(train_path, dtype=dtype, offset=keep * dtype.itemsize)
            with self._writing(val_path):
                val_path.write_bytes(tail.data)
            os.truncate(train_path, keep * dtype.itemsize)
        shard.update(num_train_tokens=keep, num_val_tokens=shard["num_val_tokens"] + num_tokens)
        write_record(self.root / PROGRESS_NAME, self.progress)
        return num_tokens
