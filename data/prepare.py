"""Turn a text corpus into flat token files (train.bin / val.bin) plus a tokenizer.

The prepared directory is a cache: meta.json is written last and carries a
fingerprint of the inputs, so a later run with the same inputs reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

# Bump when the on-disk layout or tokenisation recipe changes, so old caches are rebuilt.
FORMAT_VERSION = 1
META_NAME = "meta.json"
TRAIN_NAME = "train.bin"
VAL_NAME = "val.bin"
TOKENIZER_NAME = "tokenizer.model"
EXTERNAL_TOKENIZER_NAME = "hf_tokenizer"  # a folder saved by the external tokenizer
TEXT_SUFFIXES = (".txt", ".jsonl")
# Caps how many lines SentencePiece learns from so tokenizer training stays quick.
MAX_TOKENIZER_SENTENCES = 300_000
# Lines longer than this (bytes) are skipped by SentencePiece training, not by encoding.
MAX_SENTENCE_BYTES = 1 << 16
ENCODE_CHUNK_DOCS = 64
STDLIB_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


class DataError(ValueError):
    """A problem with the user's data or data settings; the message names the culprit."""


@dataclass
class PreparedData:
    train_path: Path
    val_path: Path
    tokenizer_path: Path
    dtype: np.dtype
    vocab_size: int
    num_train_tokens: int
    num_val_tokens: int


def stdlib_source_files() -> list[Path]:
    """The running interpreter's stdlib .py files: a default corpus that needs no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        relative_dirs = path.relative_to(root).parts[:-1]
        if any(part in STDLIB_SKIP_DIRS for part in relative_dirs):
            continue
        if path.is_file():
            found.append(path)
    return sorted(found)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


# ---------------------------------------------------------------- input files


def _expand_inputs(files: list[str]) -> list[Path]:
    """Resolve user entries (files or directories) to a list of .txt/.jsonl files."""
    paths: list[Path] = []
    for entry in files:
        path = Path(entry).expanduser()
        if not path.exists():
            raise DataError(f"data file not found: {path}")
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not inside:
                raise DataError(f"no .txt or .jsonl files under directory {path}")
            paths.extend(inside)
        elif path.suffix in TEXT_SUFFIXES:
            paths.append(path)
        else:
            raise DataError(
                f"unsupported data file {path}: expected .txt, .jsonl or a directory of them"
            )
    return paths


def _read_text(path: Path, *, strict: bool) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="strict" if strict else "replace")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not valid UTF-8 ({err})") from err
    except OSError as err:
        raise DataError(f"cannot read data file {path}: {err}") from err


def _jsonl_documents(path: Path) -> Iterator[str]:
    text = _read_text(path, strict=True)
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {line_number}: invalid JSON ({err.msg})") from err
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{path} line {line_number}: expected an object with a string 'text' field")
        yield record["text"]


def _file_documents(path: Path, *, strict: bool) -> Iterator[str]:
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path)
    else:
        # .txt and stdlib .py files: the whole file is one document.
        yield _read_text(path, strict=strict)


def _read_documents(paths: list[Path], *, max_bytes: int, strict: bool) -> list[str]:
    """Read documents in order, skipping blank ones, until max_bytes of text (0 = no cap)."""
    documents: list[str] = []
    num_bytes = 0
    for path in paths:
        for text in _file_documents(path, strict=strict):
            if not text.strip():
                continue
            documents.append(text)
            num_bytes += len(text.encode("utf-8"))
            if max_bytes and num_bytes >= max_bytes:
                return documents
    return documents


# ---------------------------------------------------------------- split


def _split_documents(documents: list[str], *, val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded split by document; one document is split by characters instead."""
    if len(documents) == 1:
        text = documents[0]
        if len(text) < 2:
            raise DataError("corpus is a single one-character document; cannot make train and val sets")
        cut = min(max(int(len(text) * (1.0 - val_fraction)), 1), len(text) - 1)
        return [text[:cut]], [text[cut:]]
    num_val = min(max(round(len(documents) * val_fraction), 1), len(documents) - 1)
    order = np.random.default_rng(seed).permutation(len(documents))
    val_ids = set(order[:num_val].tolist())
    # Keep original order inside each split; the loader shuffles windows anyway.
    train = [doc for i, doc in enumerate(documents) if i not in val_ids]
    val = [doc for i, doc in enumerate(documents) if i in val_ids]
    return train, val


# ---------------------------------------------------------------- tokenizer


def _training_lines(documents: list[str]) -> Iterator[str]:
    # SentencePiece learns from lines; newlines themselves are covered by byte fallback.
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line


def _sampled_training_lines(documents: list[str], *, max_lines: int, seed: int) -> Iterator[str]:
    """At most max_lines lines, drawn with our own seeded RNG.

    SentencePiece's shuffle_input_sentence sampling is not reproducible even with a
    fixed seed, so we sample here and let it use everything it is given.
    """
    num_lines = sum(1 for _ in _training_lines(documents))
    if num_lines <= max_lines:
        yield from _training_lines(documents)
        return
    keep = np.zeros(num_lines, dtype=bool)
    keep[np.random.default_rng(seed).choice(num_lines, size=max_lines, replace=False)] = True
    for line_index, line in enumerate(_training_lines(documents)):
        if keep[line_index]:
            yield line


def _train_tokenizer(documents: list[str], *, vocab_size: int, seed: int, out_path: Path) -> None:
    model = _ProtoSink()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sampled_training_lines(
                documents, max_lines=MAX_TOKENIZER_SENTENCES, seed=seed
            ),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            # Already sampled above; 0 tells SentencePiece to keep every line it gets.
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=MAX_SENTENCE_BYTES,
            # Thread count changes only the recorded trainer settings, not the learned pieces.
            num_threads=os.cpu_count() or 1,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False,
            # Identity normalisation and no dummy prefix make decode(encode(text)) == text for code.
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise DataError(
            f"SentencePiece could not train a vocabulary of {vocab_size} on this corpus ({err}); "
            f"try a smaller data.vocab_size or more data"
        ) from err
    out_path.write_bytes(model.data)


class _ProtoSink:
    """Collects the serialized model SentencePiece writes, so nothing is half-written on disk."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def _load_tokenizer(path: Path) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    try:
        processor.load(str(path))
    except (OSError, RuntimeError) as err:
        raise DataError(f"cannot load SentencePiece model {path}: {err}") from err
    if processor.eos_id() < 0:
        raise DataError(f"SentencePiece model {path} has no EOS piece; documents need one as separator")
    return processor


# ---------------------------------------------------------------- encoding


def _encode_to_file(
    documents: list[str],
    *,
    processor: spm.SentencePieceProcessor,
    dtype: np.dtype,
    out_path: Path,
    desc: str,
    show_progress: bool,
) -> int:
    """Encode documents, EOS after each, appending raw ids to out_path; returns the token count."""
    eos = processor.eos_id()
    num_tokens = 0
    with open(out_path, "wb") as out, tqdm(
        total=len(documents), desc=desc, unit="doc", disable=not show_progress, file=sys.stderr
    ) as bar:
        for first in range(0, len(documents), ENCODE_CHUNK_DOCS):
            chunk = documents[first : first + ENCODE_CHUNK_DOCS]
            encoded = processor.encode(chunk, out_type=int, num_threads=os.cpu_count() or 1)
            ids = [token for doc_ids in encoded for token in (*doc_ids, eos)]
            np.asarray(ids, dtype=dtype).tofile(out)
            num_tokens += len(ids)
            bar.update(len(chunk))
            bar.set_postfix(tokens=f"{num_tokens:,}")
    return num_tokens


# ---------------------------------------------------------------- fingerprint and meta


def _fingerprint(
    paths: list[Path],
    *,
    tokenizer_model: Path | None,
    vocab_size: int,
    val_fraction: float,
    max_corpus_mb: float,
    seed: int,
    external: str | None = None,
) -> str:
    """Hash of everything that determines the prepared files, so a cache hit is safe."""

    def describe(path: Path) -> list:
        stat = path.stat()
        return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]

    record = {
        "format_version": FORMAT_VERSION,
        "inputs": sorted(describe(p) for p in paths),
        "tokenizer_model": describe(tokenizer_model) if tokenizer_model else None,
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "max_corpus_mb": max_corpus_mb,
        "seed": seed,
        "external_tokenizer": external,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode("utf-8")).hexdigest()


def _read_meta(meta_path: Path) -> dict:
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"cannot read {meta_path}: {err}") from err
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path} does not hold a JSON object")
    return meta


def _meta_field(meta: dict, name: str, kind: type, meta_path: Path):
    value = meta.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DataError(f"{meta_path}: field '{name}' missing or not a {kind.__name__}")
    return value


def load_prepared(dataset_dir: str) -> PreparedData:
    """Open a prepared directory, checking that its files exist and match meta.json."""
    root = Path(dataset_dir)
    meta_path = root / META_NAME
    if not meta_path.is_file():
        raise DataError(f"no prepared data in {root}: {meta_path} not found")
    meta = _read_meta(meta_path)
    dtype_name = _meta_field(meta, "dtype", str, meta_path)
    if dtype_name not in ("uint16", "uint32"):
        raise DataError(f"{meta_path}: field 'dtype' is {dtype_name!r}, expected uint16 or uint32")
    prepared = PreparedData(
        train_path=root / _meta_field(meta, "train_file", str, meta_path),
        val_path=root / _meta_field(meta, "val_file", str, meta_path),
        tokenizer_path=root / _meta_field(meta, "tokenizer_file", str, meta_path),
        dtype=np.dtype(dtype_name),
        vocab_size=_meta_field(meta, "vocab_size", int, meta_path),
        num_train_tokens=_meta_field(meta, "num_train_tokens", int, meta_path),
        num_val_tokens=_meta_field(meta, "num_val_tokens", int, meta_path),
    )
    if not prepared.tokenizer_path.exists():
        raise DataError(f"prepared tokenizer missing: {prepared.tokenizer_path}")
    for path, num_tokens in (
        (prepared.train_path, prepared.num_train_tokens),
        (prepared.val_path, prepared.num_val_tokens),
    ):
        if not path.is_file():
            raise DataError(f"prepared token file missing: {path}")
        expected = num_tokens * prepared.dtype.itemsize
        if path.stat().st_size != expected:
            raise DataError(
                f"{path} is {path.stat().st_size} bytes but {meta_path} says {num_tokens} tokens "
                f"({expected} bytes); delete {root} to re-prepare"
            )
    return prepared


def _cached(root: Path, fingerprint: str) -> PreparedData | None:
    meta_path = root / META_NAME
    if not meta_path.is_file():
        return None
    try:
        if _read_meta(meta_path).get("source_fingerprint") != fingerprint:
            return None
        return load_prepared(str(root))
    except DataError:
        # A damaged cache is rebuilt rather than reported.
        return None


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------- entry point


def _check_settings(*, vocab_size: int, val_fraction: float, max_corpus_mb: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    if max_corpus_mb < 0:
        raise DataError(f"data.max_corpus_mb must be >= 0 (0 = no cap), got {max_corpus_mb}")
    if vocab_size < 1:
        raise DataError(f"data.vocab_size must be positive, got {vocab_size}")


def prepare_data(
    *,
    dataset_dir: str,
    files: list[str],
    tokenizer_model: str | None,
    vocab_size: int,
    val_fraction: float,
    max_corpus_mb: float,
    seed: int,
    show_progress: bool = True,
    external_tokenizer=None,
) -> PreparedData:
    """Tokenise the corpus into dataset_dir, or reuse what an earlier identical call left there.

    `external_tokenizer` replaces SentencePiece (e.g. a Hugging Face tokenizer, adapted by the caller so
    this package needs no transformers): it must offer `encode(list[str], out_type=int, num_threads=int)`,
    `eos_id()`, `get_piece_size()`, `save(path)` (writes what it needs into the file or folder `path`)
    and a `fingerprint` string identifying it.
    """
    _check_settings(vocab_size=vocab_size, val_fraction=val_fraction, max_corpus_mb=max_corpus_mb)
    use_stdlib = not files
    paths = stdlib_source_files() if use_stdlib else _expand_inputs(files)
    given_tokenizer = Path(tokenizer_model).expanduser() if tokenizer_model else None
    if given_tokenizer is not None and not given_tokenizer.is_file():
        raise DataError(f"tokenizer model not found: {given_tokenizer}")

    root = Path(dataset_dir)
    fingerprint = _fingerprint(
        paths,
        tokenizer_model=given_tokenizer,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        max_corpus_mb=max_corpus_mb,
        seed=seed,
        external=getattr(external_tokenizer, "fingerprint", None),
    )
    cached = _cached(root, fingerprint)
    if cached is not None:
        return cached

    root.mkdir(parents=True, exist_ok=True)
    # Drop the old meta first: if we crash midway, nothing claims the half-rewritten files.
    (root / META_NAME).unlink(missing_ok=True)

    # Stdlib files are not ours to fix, so undecodable bytes are replaced rather than fatal.
    documents = _read_documents(paths, max_bytes=int(max_corpus_mb * 2**20), strict=not use_stdlib)
    if not documents:
        named = "the Python stdlib" if use_stdlib else ", ".join(str(p) for p in files)
        raise DataError(f"no text found in {named}")
    train_docs, val_docs = _split_documents(documents, val_fraction=val_fraction, seed=seed)

    tokenizer_name = TOKENIZER_NAME if external_tokenizer is None else EXTERNAL_TOKENIZER_NAME
    tmp_tokenizer = root / (tokenizer_name + ".tmp")
    if external_tokenizer is not None:
        if tmp_tokenizer.is_dir():
            shutil.rmtree(tmp_tokenizer)
        external_tokenizer.save(tmp_tokenizer)
    elif given_tokenizer is not None:
        # Copy so the prepared directory is self-contained.
        shutil.copyfile(given_tokenizer, tmp_tokenizer)
    else:
        _train_tokenizer(train_docs, vocab_size=vocab_size, seed=seed, out_path=tmp_tokenizer)
    processor = external_tokenizer if external_tokenizer is not None else _load_tokenizer(tmp_tokenizer)
    actual_vocab = processor.get_piece_size()
    dtype = token_dtype(actual_vocab)

    tmp_train = root / (TRAIN_NAME + ".tmp")
    tmp_val = root / (VAL_NAME + ".tmp")
    num_train_tokens = _encode_to_file(
        train_docs, processor=processor, dtype=dtype, out_path=tmp_train,
        desc="tokenising train", show_progress=show_progress,
    )
    num_val_tokens = _encode_to_file(
        val_docs, processor=processor, dtype=dtype, out_path=tmp_val,
        desc="tokenising val", show_progress=show_progress,
    )
    if num_val_tokens < 2:
        raise DataError(
            f"validation split of {root} holds {num_val_tokens} tokens; raise data.val_fraction or add data"
        )

    if (root / tokenizer_name).is_dir():
        shutil.rmtree(root / tokenizer_name)
    os.replace(tmp_tokenizer, root / tokenizer_name)
    os.replace(tmp_train, root / TRAIN_NAME)
    os.replace(tmp_val, root / VAL_NAME)
    _write_json_atomic(
        root / META_NAME,
        {
            "format_version": FORMAT_VERSION,
            "source_fingerprint": fingerprint,
            "dtype": dtype.name,
            "vocab_size": actual_vocab,
            "num_train_tokens": num_train_tokens,
            "num_val_tokens": num_val_tokens,
            "num_train_documents": len(train_docs),
            "num_val_documents": len(val_docs),
            "train_file": TRAIN_NAME,
            "val_file": VAL_NAME,
            "tokenizer_file": tokenizer_name,
            "tokenizer_source": (external_tokenizer.fingerprint if external_tokenizer is not None
                                 else str(given_tokenizer.resolve()) if given_tokenizer else "trained"),
            "inputs": "python-stdlib" if use_stdlib else [str(p) for p in files],
        },
    )
    return load_prepared(str(root))
