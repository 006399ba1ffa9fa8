"""The prepared-data folder: a tokenizer, token shards, and a meta file written last.

    DIR/tokenizer.model (or hf_tokenizer/)   the tokenizer the tokens were made with
    DIR/train-00000.bin, val-00000.bin, ...  flat token ids (uint16, or uint32 past 65536 pieces),
                                             documents separated by EOS; shard k holds the training and
                                             held-out documents of one stretch of the corpus
    DIR/progress.json                        while preparing: the finished shards, for resuming
    DIR/meta.json                            written last: its presence means the folder is complete

A shard's files are written under a .tmp name and renamed once complete, then recorded in
progress.json (written atomically), so an interrupted preparation leaves only whole, recorded shards
and a rerun continues after the last of them; nothing without meta.json is ever read for training.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

# Bump when the on-disk layout or tokenisation recipe changes, so old folders are rebuilt.
FORMAT_VERSION = 2
META_NAME = "meta.json"
PROGRESS_NAME = "progress.json"
TOKENIZER_NAME = "tokenizer.model"
HF_TOKENIZER_NAME = "hf_tokenizer"  # a folder saved by a transformers tokenizer


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


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_names(index: int) -> tuple[str, str]:
    return f"train-{index:05d}.bin", f"val-{index:05d}.bin"


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
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"cannot read {path}: {err}") from err
    if not isinstance(payload, dict):
        raise DataError(f"{path} does not hold a JSON object")
    return payload


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _field(meta: dict, name: str, kind: type, where: Path):
    value = meta.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DataError(f"{where}: field '{name}' missing or not a {kind.__name__}")
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
                        f"{meta.get('format_version')}, expected {FORMAT_VERSION}); prepare it again")
    dtype_name = _field(meta, "dtype", str, meta_path)
    if dtype_name not in ("uint16", "uint32"):
        raise DataError(f"{meta_path}: field 'dtype' is {dtype_name!r}, expected uint16 or uint32")
    dtype = np.dtype(dtype_name)
    shards = _field(meta, "shards", list, meta_path)
    for shard in shards:
        check_shard(root, shard, dtype, where=meta_path)
    prepared = PreparedData(
        root=root,
        train_files=[root / shard["train"] for shard in shards],
        val_files=[root / shard["val"] for shard in shards],
        tokenizer_path=root / _field(meta, "tokenizer_file", str, meta_path),
        tokenizer_sha256=_field(meta, "tokenizer_sha256", str, meta_path),
        dtype=dtype,
        vocab_size=_field(meta, "vocab_size", int, meta_path),
        num_train_tokens=_field(meta, "num_train_tokens", int, meta_path),
        num_val_tokens=_field(meta, "num_val_tokens", int, meta_path),
    )
    if not prepared.tokenizer_path.exists():
        raise DataError(f"prepared tokenizer missing: {prepared.tokenizer_path}")
    return prepared


def check_shard(root: Path, shard: dict, dtype: np.dtype, *, where: Path) -> None:
    """A recorded shard's two files exist with exactly the recorded number of tokens."""
    for split in ("train", "val"):
        path = root / _field(shard, split, str, where)
        num_tokens = _field(shard, f"num_{split}_tokens", int, where)
        expected = num_tokens * dtype.itemsize
        if not path.is_file():
            raise DataError(f"prepared token file missing: {path}")
        if path.stat().st_size != expected:
            raise DataError(f"{path} is {path.stat().st_size} bytes but {where.name} says {num_tokens} tokens "
                            f"({expected} bytes); delete {root} to prepare it again")


def complete_fingerprint(root: Path) -> str | None:
    """The source fingerprint of a complete folder, None when there is none (or it is unreadable)."""
    try:
        return read_json(root / META_NAME).get("source_fingerprint") if (root / META_NAME).is_file() else None
    except DataError:
        return None


# ---------------------------------------------------------------- writing, resumably


def resumable_shards(root: Path, fingerprint: str, dtype: np.dtype) -> list[dict]:
    """The finished shards an interrupted preparation of the same inputs and settings left, in order;
    [] when there is nothing to continue (other inputs, or no progress). The recorded prefix stops
    at the first shard whose files are not whole."""
    path = root / PROGRESS_NAME
    if not path.is_file():
        return []
    try:
        progress = read_json(path)
    except DataError:
        return []
    if progress.get("source_fingerprint") != fingerprint or progress.get("dtype") != dtype.name:
        return []
    kept = []
    for shard in progress.get("shards", []):
        try:
            check_shard(root, shard, dtype, where=path)
        except DataError:
            break
        kept.append(shard)
    return kept


def clear_folder(root: Path, *, keep_tokenizer: bool) -> None:
    """Remove what an earlier preparation left (meta first, so nothing claims the files that follow)."""
    (root / META_NAME).unlink(missing_ok=True)
    for path in root.iterdir():
        # train.bin / val.bin: the single token files of format 1
        if path.name.startswith(("train-", "val-")) or path.name in (PROGRESS_NAME, PROGRESS_NAME + ".tmp",
                                                                   "train.bin", "val.bin"):
            path.unlink()
        elif not keep_tokenizer and path.name.startswith((TOKENIZER_NAME, HF_TOKENIZER_NAME)):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


class ShardWriter:
    """Appends the train and val tokens of consecutive chunks to the current shard; `finish_shard`
    makes it permanent and records it in progress.json, with the chunk it ends at."""

    def __init__(self, root: Path, *, dtype: np.dtype, progress: dict):
        self.root = root
        self.dtype = dtype
        self.progress = progress  # source_fingerprint, dtype, tokenizer, shards (finished so far)
        self._files: list = []
        self._paths: list[Path] = []
        self.num_tokens = [0, 0]  # train, val tokens of the current shard

    @property
    def shards(self) -> list[dict]:
        return self.progress["shards"]

    def append(self, train: np.ndarray, val: np.ndarray) -> None:
        if not len(train) and not len(val):
            return
        if not self._files:
            self._open()
        for i, tokens in enumerate((train, val)):
            with self._writing(self._paths[i]):
                # file.write, not ndarray.tofile: tofile reports a full disk without its errno.
                self._files[i].write(tokens.astype(self.dtype, copy=False).data)
            self.num_tokens[i] += len(tokens)

    def _open(self) -> None:
        names = shard_names(len(self.shards))
        self._paths = [self.root / (name + ".tmp") for name in names]
        for path in self._paths:
            with self._writing(path):
                self._files.append(open(path, "wb"))

    def finish_shard(self, *, end_chunk: int, totals: dict) -> None:
        if not self._files:
            return
        names = shard_names(len(self.shards))
        for file, tmp, name in zip(self._files, self._paths, names):
            with self._writing(tmp):
                file.flush()
                os.fsync(file.fileno())  # on disk before progress.json says so
                file.close()
            os.replace(tmp, self.root / name)
        self.shards.append({"train": names[0], "val": names[1], "num_train_tokens": self.num_tokens[0],
                            "num_val_tokens": self.num_tokens[1], "end_chunk": end_chunk, "totals": totals})
        with self._writing(self.root / PROGRESS_NAME):
            write_json_atomic(self.root / PROGRESS_NAME, self.progress)
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
        train_path, val_path = self.root / shard["train"], self.root / shard["val"]
        keep = shard["num_train_tokens"] - num_tokens
        tail = np.fromfile(train_path, dtype=self.dtype, offset=keep * self.dtype.itemsize)
        with self._writing(val_path):
            val_path.write_bytes(tail.data)
        os.truncate(train_path, keep * self.dtype.itemsize)
        shard.update(num_train_tokens=keep, num_val_tokens=shard["num_val_tokens"] + num_tokens)
        write_json_atomic(self.root / PROGRESS_NAME, self.progress)
        return num_tokens
