"""Prepare a corpus once: text files in, a tokenizer and sharded token files out (data/store.py), streamed in
bounded memory through worker processes (the pipeline: docs/data.md, "What preparing does"). Chunk boundaries depend
only on the input and results are written in chunk order, so the output is byte-identical whatever the number of
workers. The folder is also a cache: meta.json's fingerprint of the inputs and settings lets a later call reuse it,
and an interrupted one continues after its last finished shard."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import sys
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path

from tqdm import tqdm

from safe_io import nofollow
from safe_io.names import shown
from safe_io.urls import display

from . import worker
from .chat import ChatFields
from .errors import DataError, refusals_as_data_errors
from .hf_datasets import OpenedDataset, open_dataset
from .readers import InputFile, Piece, expand_inputs, format_of, input_size, read_pieces, truncate
from .remote import FetchLimit, RemoteFile, SourceChanged
from .settings import DEFAULT_SEED, DataConfig
from .store import (
    FIXED_NAMES,
    FOLDER_NAMES,
    FORMAT_VERSION,
    HASH_BLOCK_BYTES,
    HF_TOKENIZER_NAME,
    LOCK_NAME,
    MARKER_NAME,
    MASK_KEYS,
    META_NAME,
    PROGRESS_NAME,
    TOKEN_KEYS,
    TOKENIZER_NAME,
    FolderInUse,
    PreparedData,
    ShardWriter,
    claim_folder,
    clear_folder,
    complete_fingerprint,
    data_format,
    folder_lock,
    foreign_names,
    is_marked,
    is_ours,
    is_plain_name,
    load_prepared,
    read_record,
    read_tokenizer_file,
    recorded_names,
    remove_names,
    resumable_shards,
    token_dtype,
    tokenizer_sha256,
    write_record,
)
from .tokenizer import (
    MAX_TOKENIZER_SENTENCES,
    TokenizerSample,
    load_sentencepiece,
    load_tokenizer,
    sampled_training_lines,
    train_tokenizer,
)

log = logging.getLogger(__name__)

# Input per work unit: large enough that sending it to a worker costs little next to encoding it,
# small enough that the few per worker in flight hold little memory.
CHUNK_BYTES = 1 << 20
# By default, a corpus up to this size (on disk, or read up to data.max_corpus_mb) is prepared by the
# calling process alone: spawning workers (which import the caller's main script, torch included, in a
# training job) costs more than such a corpus takes to encode.
IN_PROCESS_MAX_BYTES = 16 << 20
# What is fetched of URLs whose size the server does not give may pass data.max_corpus_mb (of text) by this much
# beyond twice it and a document: read-ahead, and compression's framing.
STREAM_SLACK_BYTES = 16 << 20
# A file may read as at most this many times its size on disk (and always as EXPANSION_FLOOR_BYTES): compressed text
# (gzip, zstd, parquet pages) reads as a few times its size, a compression bomb (one parquet dictionary value that
# every row repeats, a zstd stream of one byte) as thousands, which would keep preparation busy without end in
# bounded memory. data.max_corpus_mb, a bound on all that is read, lifts it.
MAX_EXPANSION = 100
EXPANSION_FLOOR_BYTES = 16 << 20
PREPARE_FIRST = ("prepare it first with `python scripts/prepare_data.py CONFIG --data.dataset_dir=DIR`, then train "
                 "with --data.dataset_dir=DIR")
# Folders whose .py files the built-in corpora leave out: tests, byte code, and in the stdlib the installed packages
# (data.builtin_corpus=python lists them itself) and tools.
STDLIB_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
# The built-in corpora (data.builtin_corpus): how messages name each, and how meta.json's inputs do.
BUILTIN_CORPORA = {"stdlib": ("the Python stdlib", "python-stdlib"),
                   "python": ("the Python sources of the stdlib and the installed packages",
                              "python-stdlib-and-packages")}
CHAT_SETTINGS = ("format", "messages_field", "prompt_field", "response_field", "chat_template")


# The settings that decide a prepared folder, in its record's order (files and num_workers as None: the inputs are
# described apart, and the workers change nothing); a text folder's record holds none of CHAT_SETTINGS.
RECORDED = ("files", "tokenizer_model", "hf_tokenizer", "vocab_size", "val_fraction", "max_corpus_mb",
            "max_document_mb", "seed", "text_field", "on_bad_record", "shard_tokens", "num_workers")


@dataclass
class PrepareSettings(DataConfig):
    """The data section, and the settings of other sections that decide the prepared folder with it."""

    seed: int = DEFAULT_SEED  # run.seed: the validation split and the tokenizer's sample
    model_hf_path: str = ""  # model.hf_path: the tokenizer of data.tokenizer=hf without data.hf_tokenizer

    @property
    def hf_tokenizer_dir(self) -> str:
        """The Hugging Face tokenizer's folder (data.tokenizer=hf), or "" for SentencePiece."""
        return (self.hf_tokenizer or self.model_hf_path) if self.tokenizer == "hf" else ""

    @property
    def folder(self) -> str:
        """The prepared folder: data.dataset_dir, or the cache folder these settings name."""
        return self.dataset_dir or default_dataset_dir(self)

    @property
    def chat(self) -> ChatFields | None:
        """Where records keep their conversation (data.format=chat), or None for text."""
        if self.format != "chat":
            return None
        return ChatFields(messages=self.messages_field, prompt=self.prompt_field, response=self.response_field)

    @property
    def template(self) -> str:
        """data.format=chat: "tokenizer" (the HF tokenizer's own chat template) or "plain" (ours)."""
        return "tokenizer" if self.chat_template == "auto" and self.hf_tokenizer_dir else "plain"

    def record(self) -> dict:
        """The settings that decide the prepared folder; a text preparation's record holds no chat field, so
        folders prepared before chat data keep their fingerprint."""
        settings = {name: getattr(self, name) for name in RECORDED}
        settings.update(files=None, num_workers=None, hf_tokenizer=self.hf_tokenizer_dir)
        if self.format != "text":
            settings.update({name: getattr(self, name) for name in CHAT_SETTINGS})
        if self.hf_dataset.path:
            settings["hf_dataset"] = self.hf_dataset.record()
        if self.builtin_corpus != "stdlib":  # away from the default only, so that the stdlib's folders keep theirs
            settings["builtin_corpus"] = self.builtin_corpus
        return settings

    def processes(self, corpus_bytes: int) -> int:
        """Worker processes to start: num_workers, or by default one per CPU core, or none (this process
        does the work) for a corpus so small that starting processes would cost more than they save. Never
        more than the CPU cores this process may run on: more would only share them."""
        if self.num_workers:
            return min(self.num_workers, usable_cpus())
        return usable_cpus() if corpus_bytes > IN_PROCESS_MAX_BYTES else 0


def usable_cpus() -> int:
    """The CPU cores this process may run on (its affinity where the platform tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ---------------------------------------------------------------- the corpus


def _python_files(root: Path) -> Iterator[Path]:
    """The readable .py files below root, outside the folders named in STDLIB_SKIP_DIRS. Links to folders are not
    followed, so the walk neither loops nor leaves the tree; a link to a file is that file."""
    for folder, dirs, names in os.walk(root):  # errors (a folder it may not list) leave that folder out
        dirs[:] = [name for name in dirs if name not in STDLIB_SKIP_DIRS]
        for name in names:
            path = Path(folder, name)
            if name.endswith(".py") and path.is_file() and os.access(path, os.R_OK):
                yield path


def stdlib_source_files() -> list[Path]:
    """The running interpreter's stdlib .py files: a default corpus that needs no download."""
    return sorted(_python_files(Path(sysconfig.get_paths()["stdlib"])))


def python_source_files() -> list[Path]:
    """The stdlib's .py files and those of every installed package (sysconfig's purelib and platlib folders), in
    sorted order. A file reached twice (purelib is platlib, a link to a file found already, a hard link) is listed
    once, under its own name rather than a link's; every file of stdlib_source_files is listed."""
    found = stdlib_source_files()
    seen = {_file_identity(path) for path in found}
    roots = dict.fromkeys(Path(sysconfig.get_paths()[name]).resolve() for name in ("purelib", "platlib"))
    packages = sorted(path for root in roots for path in _python_files(root))
    for path in sorted(packages, key=Path.is_symlink):  # stable: the files, then the links, each in sorted order
        if (identity := _file_identity(path)) not in seen:
            seen.add(identity)
            found.append(path)
    return sorted(found)


def _file_identity(path: Path) -> tuple[int, int]:
    """The file a path leads to: the same for its links and hard links."""
    stat = path.stat()
    return stat.st_dev, stat.st_ino


@dataclass
class Corpus:
    paths: list[InputFile]
    name: str  # for messages
    strict: bool  # undecodable bytes are an error (users' files) or replaced (the stdlib)
    max_mb: float  # data.max_corpus_mb
    max_document_mb: float
    hf: OpenedDataset | None = None  # a Hugging Face dataset (paths: its files)
    max_job_mb: float = 0.0  # data.max_in_job_mb in a training job: the most text it reads (0: no bound)

    @classmethod
    def of(cls, settings: PrepareSettings, *, max_input_mb: float = 0.0) -> Corpus:
        """The corpus settings name; max_input_mb (> 0, in a training job) bounds what its URLs may give and the
        text it reads."""
        corpus = cls._of(settings, max_input_mb=max_input_mb)
        corpus.max_job_mb = max_input_mb
        return corpus

    @classmethod
    def _of(cls, settings: PrepareSettings, *, max_input_mb: float) -> Corpus:
        if settings.hf_dataset.path:
            hf = open_dataset(settings.hf_dataset, text_field=settings.text_field, chat=settings.chat)
            return cls([*hf.files], hf.where, strict=True, max_mb=settings.max_corpus_mb,
                       max_document_mb=settings.max_document_mb, hf=hf)
        if not settings.files:
            if settings.format == "chat":
                raise DataError("data.format=chat needs data.files: .jsonl files of conversations")
            return cls.builtin(settings)
        paths = _bounded(expand_inputs(list(settings.files), timeout_s=settings.remote_timeout_s), settings,
                         max_input_mb=max_input_mb)
        if settings.format == "chat" and (other := [p for p in paths if (format_of(p) or ("",))[0] != "jsonl"]):
            raise DataError(f"{shown(other[0])}: data.format=chat reads .jsonl files (also .jsonl.gz, .jsonl.zst) of "
                            f"conversations, one JSON object a line")
        return cls(paths, ", ".join(shown(display(entry)) for entry in settings.files), strict=True,
                   max_mb=settings.max_corpus_mb, max_document_mb=settings.max_document_mb)

    @classmethod
    def builtin(cls, settings: PrepareSettings) -> Corpus:
        """data.builtin_corpus: this interpreter's .py files, named with their count and size for the log. They are
        not the user's to fix: undecodable bytes are replaced."""
        paths = python_source_files() if settings.builtin_corpus == "python" else stdlib_source_files()
        corpus = cls([*paths], "", strict=False, max_mb=settings.max_corpus_mb,
                     max_document_mb=settings.max_document_mb)
        corpus.name = (f"{BUILTIN_CORPORA[settings.builtin_corpus][0]} ({len(paths):,} .py files, "
                       f"{corpus.disk_bytes / 2**20:,.1f} MB)")
        return corpus

    @cached_property
    def disk_bytes(self) -> int:
        """The corpus's size as stored (a URL's as its server says it; 0 where it does not)."""
        return sum(input_size(path) for path in self.paths)

    @property
    def read_bytes(self) -> int:
        """About how much will be read: all of it on disk, or up to data.max_corpus_mb."""
        return min(self.disk_bytes, int(self.max_mb * 2**20) or self.disk_bytes)


def _bounded(paths: list[InputFile], settings: PrepareSettings, *, max_input_mb: float) -> list[InputFile]:
    """The files, their URLs given bounds on what reads may fetch (remote.FetchLimit): in a training job,
    data.max_in_job_mb for the whole corpus (a server need not give a file's size, nor keep it); with
    data.max_corpus_mb, for the URLs whose size is not given, as much as that much text can take."""
    if not any(isinstance(path, RemoteFile) for path in paths):
        return paths
    in_job = []
    if max_input_mb:
        local = sum(input_size(path) for path in paths if not isinstance(path, RemoteFile))
        in_job = [FetchLimit(int(max_input_mb * 2**20) - local, f"the corpus passed data.max_in_job_mb="
                             f"{max_input_mb:g} MB while this file was read, more than a training job prepares: "
                             f"{PREPARE_FIRST}")]
    stream = []
    if bound := stream_bound(settings):
        stream = [FetchLimit(bound, f"more than {bound / 2**20:,.0f} MB read of URLs whose size is not given (no "
                             f"Content-Length), more than data.max_corpus_mb={settings.max_corpus_mb:g} MB of text can "
                             f"need (twice it and data.max_document_mb, and {STREAM_SLACK_BYTES >> 20} MB): a stream "
                             f"without end?")]
    return [replace(path, limits=(*in_job, *([] if path.sized else stream))) if isinstance(path, RemoteFile) else path
            for path in paths]


def stream_bound(settings: PrepareSettings) -> int:
    """With data.max_corpus_mb, the most a preparation fetches of URLs whose size is not given: twice that of
    text (compressed input is never much larger than its text) and a document (the piece that passes the cap),
    with STREAM_SLACK_BYTES to spare; 0 without a cap."""
    if not settings.max_corpus_mb:
        return 0
    return int(2 * settings.max_corpus_mb * 2**20 + settings.max_document_mb * 2**20) + STREAM_SLACK_BYTES


def _chunks(corpus: Corpus, *, text_field: str, skip_long: bool, say_cut: bool) -> Iterator[worker.Chunk]:
    """The corpus as numbered chunks of whole pieces, each of at least CHUNK_BYTES but the last. With
    data.max_corpus_mb, reading stops at the first line, row or document that reaches it (said in the log)."""
    max_bytes = int(corpus.max_mb * 2**20)
    pieces: list = []
    num_bytes = read = 0
    index = 0
    for piece, disk_done in _located_pieces(corpus, text_field=text_field, skip_long=skip_long):
        if max_bytes and read + piece.num_bytes >= max_bytes:
            piece = truncate(piece, max_bytes - read)
            pieces.append(piece)
            if say_cut:
                log.info("data.max_corpus_mb=%g: read the first %.2f MB of the corpus (%.2f MB on disk), "
                         "stopping in %s", corpus.max_mb, (read + piece.num_bytes) / 2**20, corpus.disk_bytes / 2**20,
                         piece.path)
            yield worker.Chunk(index, pieces, disk_done)
            return
        pieces.append(piece)
        num_bytes += piece.num_bytes
        read += piece.num_bytes
        if num_bytes >= CHUNK_BYTES:
            yield worker.Chunk(index, pieces, disk_done)
            pieces, num_bytes, index = [], 0, index + 1
    if pieces:
        yield worker.Chunk(index, pieces, corpus.disk_bytes)


def _located_pieces(corpus: Corpus, *, text_field: str, skip_long: bool) -> Iterator[tuple[Piece, int]]:
    """Each piece of the corpus, with the bytes of the corpus on disk read once it is done. With
    data.max_corpus_mb, a file is read no further than the piece that reaches it. What is read is bounded
    (_check_read): a piece past a bound is a DataError, not given."""
    if corpus.hf is not None:
        read = 0
        for piece in corpus.hf.pieces(disk_bytes=corpus.disk_bytes):
            read += piece.num_bytes
            _check_read(corpus, piece.path, read, corpus.disk_bytes, total=read)
            yield piece, piece.disk_end
        return
    max_bytes = int(corpus.max_mb * 2**20)
    read = done_files = 0
    for path in corpus.paths:
        in_file, size = 0, input_size(path)
        for piece in read_pieces(path, piece_bytes=CHUNK_BYTES, text_field=text_field,
                                 max_document_mb=corpus.max_document_mb, skip_long=skip_long,
                                 max_read_bytes=max_bytes - read if max_bytes else 0):
            read += piece.num_bytes
            in_file += piece.num_bytes
            _check_read(corpus, piece.path, in_file, size, total=read)
            yield piece, done_files + piece.disk_end
        done_files += size


def _check_read(corpus: Corpus, where: str, read: int, disk_bytes: int, *, total: int) -> None:
    """Stop, in one line naming the file, at a file that reads as more than MAX_EXPANSION times its disk_bytes
    (unless data.max_corpus_mb bounds what is read), and in a training job at more text in all than
    data.max_in_job_mb (unless data.max_corpus_mb stops reading first): a training job's bound is on the work its
    preparation does, which text measures."""
    if not corpus.max_mb and read > max(MAX_EXPANSION * disk_bytes, EXPANSION_FLOOR_BYTES):
        raise DataError(f"{where} reads as more than {MAX_EXPANSION} times its {disk_bytes:,} bytes on disk (a "
                        f"compression bomb? a parquet dictionary value repeated row after row, a compressed run of "
                        f"one byte): refused; to read it anyway, set data.max_corpus_mb to bound what is read")
    if corpus.max_job_mb and total > corpus.max_job_mb * 2**20 and not 0 < corpus.max_mb <= corpus.max_job_mb:
        raise DataError(f"{where}: the corpus reads as more than data.max_in_job_mb={corpus.max_job_mb:g} MB of text "
                        f"({corpus.disk_bytes / 2**20:,.1f} MB on disk), more than a training job prepares itself: "
                        f"{PREPARE_FIRST}")


@dataclass(frozen=True)
class Source:
    """What the prepared files depend on: the fingerprint (a hash of all of it) and, for messages, a
    summary (the settings, and digests of the inputs and of a given tokenizer) that the records keep."""

    fingerprint: str
    summary: dict

    @classmethod
    def of(cls, settings: PrepareSettings, corpus: Corpus) -> Source:
        def describe(path: InputFile) -> list:
            if isinstance(path, RemoteFile):  # its URL, size and ETag (or modification time, or content's hash)
                return path.identity(hash_bytes=stream_bound(settings))
            stat = path.stat()
            return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]

        def digest(value: object) -> str:
            return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()

        tokenizer_model = Path(settings.tokenizer_model).expanduser() if settings.tokenizer_model else None
        settings_record = settings.record()
        record = {
            "format_version": FORMAT_VERSION,
            "inputs": [describe(p) for p in corpus.paths],
            "settings": settings_record,
            "tokenizer_model": describe(tokenizer_model) if tokenizer_model else None,
            "hf_tokenizer": _hf_fingerprint(settings.hf_tokenizer_dir) if settings.hf_tokenizer_dir else None,
        }
        summary = {"settings": {k: v for k, v in settings_record.items() if v is not None},
                   "inputs": digest(record["inputs"]),
                   "tokenizer": digest([record["tokenizer_model"], record["hf_tokenizer"]])}
        return cls(digest(record), summary)

    def difference(self, record: dict) -> str:
        """How the preparation a meta.json or progress.json record describes differs from this one."""
        theirs = record.get("source")
        if (not isinstance(theirs, dict) or not isinstance(theirs.get("settings"), dict)
                or record.get("format_version", FORMAT_VERSION) != FORMAT_VERSION):
            return "prepared by another version of this library"
        names = {"seed": "run.seed", "hf_tokenizer": "data.hf_tokenizer (or model.hf_path)"}
        defaults = {"format": "text", "builtin_corpus": "stdlib"}  # a record names neither at its default
        parts = [f"{names.get(key, 'data.' + key)} {theirs['settings'].get(key, defaults.get(key))!r} there, "
                 f"{value!r} here" for key, value in self.summary["settings"].items()
                 if theirs["settings"].get(key, defaults.get(key)) != value]
        if theirs.get("inputs") != self.summary["inputs"]:
            parts.append("other input files (names, sizes, modification times, ETags or content hashes)")
        if theirs.get("tokenizer") != self.summary["tokenizer"]:
            parts.append("another given tokenizer")
        return "; ".join(parts) or "the same inputs and settings"


def _hf_fingerprint(path: str) -> str:
    from .hf_tokenizer import tokenizer_files_digest

    return tokenizer_files_digest(Path(path))


# The settings the default folder's name has held from the start, and num_workers, which changes nothing prepared.
FIRST_NAMED = ("files", "num_workers", "tokenizer_model", "hf_tokenizer", "vocab_size", "val_fraction",
               "max_corpus_mb", "seed", *CHAT_SETTINGS, "hf_dataset")


def default_dataset_dir(settings: PrepareSettings) -> str:
    """Where the data of these settings is cached when data.dataset_dir is empty: a name from every setting
    that decides the folder, so that settings that differ never share one."""
    tokenizer = settings.hf_tokenizer_dir or settings.tokenizer_model
    record = settings.record()
    chat = [] if settings.format == "text" else [record[name] for name in CHAT_SETTINGS]
    hf = [settings.hf_dataset.record()] if settings.hf_dataset.path else []
    # The others join the name only away from their defaults, so that the folders named before keep their names.
    defaults = {f.name: f.default for f in fields(PrepareSettings)}
    others = {name: value for name, value in record.items() if name not in FIRST_NAMED and value != defaults[name]}
    what = json.dumps([list(settings.files), tokenizer, settings.vocab_size, settings.val_fraction,
                       settings.max_corpus_mb, settings.seed, FORMAT_VERSION, *chat, *hf]
                      + ([others] if others else []))
    kind = settings.builtin_corpus if not settings.files and not hf else "custom"
    return str(Path("data/cache") / f"{kind}-{hashlib.sha1(what.encode()).hexdigest()[:10]}")


# ---------------------------------------------------------------- running chunks on the workers


def _worker_pool(settings: PrepareSettings, corpus: Corpus, num_workers: int):
    """num_workers processes, or this process itself for 0."""
    initargs = (worker.WorkerSettings(text_field=settings.text_field, strict=corpus.strict,
                                      skip_bad_records=settings.on_bad_record == "skip",
                                      max_document_mb=settings.max_document_mb,
                                      val_fraction=settings.val_fraction, seed=settings.seed,
                                      chat=settings.chat, chat_template=settings.template),)
    if num_workers == 0:
        return _InProcess(initargs)
    # spawn, not fork: the caller may be a training rank with communication threads running, and a
    # forked copy of such a process can deadlock.
    return ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=worker.init_process, initargs=(*initargs, os.getpid()))


class _InProcess:
    """The pool's interface, running each task at once in this process."""

    def __init__(self, initargs: tuple):
        worker.init(*initargs)

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as err:  # noqa: BLE001 - delivered by future.result(), as from a process
            future.set_exception(err)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass

    def __enter__(self) -> _InProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        pass


def _in_order(submit: Callable[[worker.Chunk], Future], chunks: Iterator[worker.Chunk], *,
              window: int) -> Iterator[worker.ChunkResult]:
    """Submit chunks, keeping at most `window` in flight; yield their results in chunk order."""
    pending: deque[Future] = deque()
    try:
        for chunk in chunks:
            pending.append(submit(chunk))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise DataError("a data preparation worker process died (killed, or out of memory?); "
                        "rerun to continue after the finished shards") from None
    finally:
        for future in pending:
            future.cancel()


def _progress_bar(desc: str, total: int | None, *, initial: int = 0, show: bool, **style: str) -> tqdm:
    # Into a log file (Slurm, a pipe) rather than a terminal: a line every 30 s, not ten a second.
    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, disable=not show,
                file=sys.stderr, dynamic_ncols=True, smoothing=0.05, mininterval=0.1 if sys.stderr.isatty() else 30,
                **style)


@contextlib.contextmanager
def _elapsed_bar(desc: str, *, show: bool) -> Iterator[None]:
    """A progress line for work that gives no count to show (SentencePiece's training, one call into its library):
    its elapsed time, redrawn by a thread as often as the other bars are."""
    bar = _progress_bar(desc, None, show=show, bar_format="{desc}: {elapsed} elapsed")
    done = threading.Event()

    def redraw() -> None:
        while not done.wait(bar.mininterval):
            bar.refresh()

    thread = threading.Thread(target=redraw, name="elapsed-bar", daemon=True)
    if show:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if show:
            thread.join()
        bar.close()


# ---------------------------------------------------------------- the passes


class _Preparation:
    def __init__(self, root: Path, settings: PrepareSettings, corpus: Corpus, source: Source,
                 pool: ProcessPoolExecutor | _InProcess, *, window: int, show_progress: bool):
        self.root, self.settings, self.corpus, self.source = root, settings, corpus, source
        self.pool, self.show_progress = pool, show_progress
        self.window = window  # chunks in flight: enough to keep every worker busy, few enough to bound memory
        self.seconds: dict[str, float] = {}  # per phase, for the summary
        self.rate_mb_s = 0.0

    def chunks(self, *, say_cut: bool = False) -> Iterator[worker.Chunk]:
        return _chunks(self.corpus, text_field=self.settings.text_field,
                       skip_long=self.settings.on_bad_record == "skip", say_cut=say_cut)

    # -- tokenizer --------------------------------------------------------------------------------

    def tokenizer(self) -> tuple[str, Path]:
        """(kind, path) of the folder's tokenizer, made now: copied, saved or trained."""
        s = self.settings
        if s.hf_tokenizer_dir:
            path = self.root / HF_TOKENIZER_NAME
            _replace_with(path, lambda tmp: load_tokenizer("hf", Path(s.hf_tokenizer_dir)).save(tmp))
            return "hf", path
        path = self.root / TOKENIZER_NAME
        if s.tokenizer_model:
            _replace_with(path, lambda tmp: _copy_into(Path(s.tokenizer_model).expanduser(), tmp))
        else:
            start = time.perf_counter()
            documents = self.tokenizer_sample()
            self.seconds["tokenizer sample"] = time.perf_counter() - start
            lines = sampled_training_lines(documents, max_lines=MAX_TOKENIZER_SENTENCES, seed=s.seed)
            with _elapsed_bar(f"training the tokenizer ({s.vocab_size:,} pieces)", show=self.show_progress):
                _replace_with(path, lambda tmp: train_tokenizer(lines, vocab_size=s.vocab_size, out_path=tmp))
            self.seconds["tokenizer training"] = time.perf_counter() - start - self.seconds["tokenizer sample"]
        load_tokenizer("sentencepiece", path)  # checks it loads and has an EOS piece
        return "sentencepiece", path

    def check_chat_template(self, kind: str, path: Path) -> None:
        if self.settings.format == "chat" and self.settings.template == "tokenizer" \
                and not load_tokenizer(kind, path).has_chat_template():
            raise DataError(f"the tokenizer of model.hf_path={self.settings.hf_tokenizer_dir} has no chat template; "
                            f"set data.chat_template=plain to use ours (docs/training.md)")

    def tokenizer_sample(self) -> list[str]:
        sample, totals = TokenizerSample(), _zero_totals()
        with _progress_bar("sampling for the tokenizer", self.corpus.read_bytes, show=self.show_progress) as bar:
            submit = lambda chunk: self.pool.submit(worker.sample_chunk, chunk, sample.threshold)  # noqa: E731
            for result in _in_order(submit, self.chunks(), window=self.window):
                _add_totals(totals, result)
                for key, text in result.sample:
                    sample.offer(key, text)
                bar.update(result.disk_done - bar.n)
        if not totals["num_train_documents"]:
            # Every document held out (a handful at most) also leaves nothing to train a tokenizer on.
            raise self._no_text(totals)
        return sample.documents()

    def _no_text(self, totals: dict) -> DataError:
        """'no text found', with what was read instead and why none of it is text."""
        num_bad, num_blank = totals["num_bad_records"], totals["num_blank_records"]
        num_docs = totals["num_train_documents"] + totals["num_val_documents"]
        found = []
        if num_docs:
            found.append(f"{num_docs:,} held out for validation (data.val_fraction={self.settings.val_fraction:g})")
        if num_blank:
            found.append(f"{num_blank:,} blank")
        if num_bad:
            found.append(f"{num_bad:,} skipped as bad (data.on_bad_record=skip; the first: "
                         f"{totals['first_bad_record']})")
        if not found:
            return DataError(f"no text found in {self.corpus.name}")
        return DataError(f"no text {'to train on ' if num_docs else ''}found in {self.corpus.name}: of the "
                         f"{num_docs + num_blank + num_bad:,} records read (lines, rows or documents), "
                         f"{', '.join(found)}")

    # -- tokens -----------------------------------------------------------------------------------

    def run(self) -> PreparedData:
        progress = self._resume_or_restart()
        writer = ShardWriter(self.root, dtype=token_dtype(progress["vocab_size"]), progress=progress)
        if writer.shards:
            log.info("continuing an interrupted preparation after its %d finished shards", len(writer.shards))
        totals = dict(writer.shards[-1]["totals"]) if writer.shards else _zero_totals()
        start, bytes_before = time.perf_counter(), totals["text_bytes"]
        try:
            self._encode(writer, totals)
        except BaseException as err:
            writer.abort()
            if isinstance(err, SourceChanged):  # the finished shards may hold the file's old bytes: none is kept
                clear_folder(self.root)
            raise
        self.seconds["tokenising"] = time.perf_counter() - start
        self.rate_mb_s = (totals["text_bytes"] - bytes_before) / 2**20 / max(self.seconds["tokenising"], 1e-9)
        return self._finish(writer, totals)

    def _encode(self, writer: ShardWriter, totals: dict) -> None:
        """Pass 2: every chunk after the finished shards, encoded by the workers, written in order."""
        next_chunk = writer.shards[-1]["end_chunk"] if writer.shards else 0
        chunks = (chunk for chunk in self._after_finished_shards(writer.shards) if chunk.index >= next_chunk)
        tokenizer = (writer.progress["tokenizer_kind"], str(self.root / writer.progress["tokenizer_file"]))
        submit = lambda chunk: self.pool.submit(worker.encode_chunk, chunk, tokenizer, writer.dtype.name)  # noqa: E731
        bar = _progress_bar("tokenising", self.corpus.read_bytes, initial=totals["disk_bytes"], show=self.show_progress)
        with bar:
            for result in _in_order(submit, chunks, window=self.window):
                _add_totals(totals, result)
                assert result.train is not None and result.val is not None, "encode_chunk sets both"
                writer.append(result.train, result.val, result.train_mask, result.val_mask)
                next_chunk = result.index + 1
                if writer.num_tokens[0] >= self.settings.shard_tokens:
                    writer.finish_shard(end_chunk=next_chunk, totals=dict(totals))
                bar.update(totals["disk_bytes"] - bar.n)
                bar.set_postfix(tokens=f"{totals['num_train_tokens'] + totals['num_val_tokens']:,}", refresh=False)
        writer.finish_shard(end_chunk=next_chunk, totals=dict(totals))

    def _after_finished_shards(self, shards: list[dict]) -> Iterator[worker.Chunk]:
        """The chunks, checking on the way that the last finished shard ends where the corpus says."""
        end, disk_bytes = (shards[-1]["end_chunk"], shards[-1]["totals"]["disk_bytes"]) if shards else (0, 0)
        matched = not shards
        for chunk in self.chunks(say_cut=True):
            matched = matched or (chunk.index == end - 1 and chunk.disk_done == disk_bytes)
            if chunk.index >= end - 1 and not matched:
                break
            yield chunk
        if not matched:
            raise DataError(f"{self.root / PROGRESS_NAME} does not match the corpus (its last finished shard does not "
                            f"end where a work unit of it ends); delete it to prepare {self.root} again")

    def _resume_or_restart(self) -> dict:
        """progress.json's record: the finished shards of an interrupted run of the same inputs and
        settings, with its tokenizer; or a fresh start with a new tokenizer and nothing else. Either way,
        only names the folder's records hold are deleted."""
        progress = read_record(self.root / PROGRESS_NAME)
        if progress.get("source_fingerprint") == self.source.fingerprint and _resumable(self.root, progress):
            nofollow.remove(self.root / META_NAME)  # from now on, the folder is incomplete
            shards = _sound_prefix(resumable_shards(self.root, progress, token_dtype(progress["vocab_size"])))
            keys = TOKEN_KEYS + (MASK_KEYS if data_format(progress) == "chat" else ())
            keep = {progress["tokenizer_file"], *(shard[key] for shard in shards for key in keys)}
            remove_names(self.root, recorded_names(self.root) - keep - {META_NAME, PROGRESS_NAME, LOCK_NAME})
            progress.update(shards=shards, files=sorted(keep))
            write_record(self.root / PROGRESS_NAME, progress)
            return progress
        meta = read_record(self.root / META_NAME)
        if (meta or progress).get("source_fingerprint") not in (None, self.source.fingerprint):
            log.warning("%s holds data %s from other inputs or settings (%s): preparing it again in its place",
                        self.root, "prepared" if meta else "partly prepared", self.source.difference(meta or progress))
        clear_folder(self.root)
        name = HF_TOKENIZER_NAME if self.settings.hf_tokenizer_dir else TOKENIZER_NAME
        progress = {"source_fingerprint": self.source.fingerprint, "source": self.source.summary,
                    "files": [name, name + ".tmp"], "shards": [], "format": self.settings.format,
                    "hash_block_bytes": HASH_BLOCK_BYTES}
        write_record(self.root / PROGRESS_NAME, progress)  # the tokenizer's names, before it is written
        kind, path = self.tokenizer()
        self.check_chat_template(kind, path)
        vocab_size = load_tokenizer(kind, path).get_piece_size()
        progress.update(tokenizer_kind=kind, tokenizer_file=path.name, tokenizer_sha256=tokenizer_sha256(path),
                        vocab_size=vocab_size, dtype=token_dtype(vocab_size).name)
        write_record(self.root / PROGRESS_NAME, progress)
        return progress

    def _finish(self, writer: ShardWriter, totals: dict) -> PreparedData:
        s, progress = self.settings, writer.progress
        if not totals["num_documents"]:
            raise self._no_text(totals)
        num_train = sum(shard["num_train_tokens"] for shard in writer.shards)
        num_val = sum(shard["num_val_tokens"] for shard in writer.shards)
        if num_val < 2:
            # Too few documents for any to be held out (a single .txt file, say): hold out the end of
            # the training tokens instead, as much as val_fraction asks for.
            wanted = max(2, num_train - int(num_train * (1.0 - s.val_fraction)))
            moved = writer.hold_out_tail(wanted)
            num_train, num_val = num_train - moved, num_val + moved
            log.info("no document was held out for validation (%d documents); its last %d training tokens are "
                     "the validation split instead", totals["num_documents"], moved)
        if num_val < 2 or num_train < 2:
            split, num = ("validation", num_val) if num_val < 2 else ("training", num_train)
            raise DataError(f"the {split} split of {self.root} holds {num} tokens; change data.val_fraction "
                            "or add data")
        keys = TOKEN_KEYS + (MASK_KEYS if writer.masked else ())
        meta = {
            "format_version": FORMAT_VERSION,
            **progress,
            "format": s.format,
            "num_train_tokens": num_train,
            "num_val_tokens": num_val,
            "num_train_documents": totals["num_train_documents"],
            "num_val_documents": totals["num_val_documents"],
            "num_skipped_records": totals["num_bad_records"],
            "first_skipped_record": totals["first_bad_record"],
            "text_bytes": totals["text_bytes"],
            "inputs": ({"hf_dataset": s.hf_dataset.record()} if s.hf_dataset.path
                       else [display(entry) for entry in s.files] or BUILTIN_CORPORA[s.builtin_corpus][1]),
            "seconds": {phase: round(seconds, 2) for phase, seconds in self.seconds.items()},
            "shards": [{k: shard[k] for k in (*keys, "num_train_tokens", "num_val_tokens", "max_token_id", "sha256")}
                       for shard in writer.shards],
            "files": [progress["tokenizer_file"], *(shard[key] for shard in writer.shards for key in keys)],
        }
        if writer.masked:
            meta |= {"chat_template": s.template, "num_trained_tokens": totals["num_trained_tokens"],
                     "num_conversations_with_eos_inside": totals["num_eos_inside"]}
        write_record(self.root / META_NAME, meta)
        nofollow.remove(self.root / PROGRESS_NAME)
        _log_summary(self.root, totals, meta, rate_mb_s=self.rate_mb_s)
        return load_prepared(self.root)


def _zero_totals() -> dict:
    return {"num_documents": 0, "num_train_documents": 0, "num_val_documents": 0, "num_train_tokens": 0,
            "num_val_tokens": 0, "text_bytes": 0, "disk_bytes": 0, "num_bad_records": 0, "first_bad_record": None,
            "num_blank_records": 0, "num_trained_tokens": 0, "num_eos_inside": 0}


def _add_totals(totals: dict, result: worker.ChunkResult) -> None:
    totals["num_train_documents"] += result.num_train_documents
    totals["num_val_documents"] += result.num_val_documents
    totals["num_documents"] += result.num_train_documents + result.num_val_documents
    totals["num_train_tokens"] += 0 if result.train is None else len(result.train)
    totals["num_val_tokens"] += 0 if result.val is None else len(result.val)
    totals["num_blank_records"] += result.num_blank_records
    totals["text_bytes"] += result.num_bytes
    totals["disk_bytes"] = result.disk_done
    totals["num_bad_records"] += result.num_bad_records
    totals["first_bad_record"] = totals["first_bad_record"] or result.first_bad_record
    totals["num_trained_tokens"] += result.num_trained_tokens
    totals["num_eos_inside"] += result.num_eos_inside


def _log_summary(root: Path, totals: dict, meta: dict, *, rate_mb_s: float) -> None:
    phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in meta["seconds"].items())
    num_shards = len(meta["shards"])
    log.info("prepared %s: %s documents (%s held out), %.1f MB of text -> %s train + %s val tokens in %d shard%s; "
             "%s (%.1f MB/s)", root, f"{totals['num_documents']:,}", f"{totals['num_val_documents']:,}",
             totals["text_bytes"] / 2**20, f"{meta['num_train_tokens']:,}", f"{meta['num_val_tokens']:,}",
             num_shards, "" if num_shards == 1 else "s", phases, rate_mb_s)
    if meta["format"] == "chat":
        num_tokens = meta["num_train_tokens"] + meta["num_val_tokens"]
        log.info("chat data (template: %s): %s of the %s tokens (%.0f%%) are the assistant's, trained on", meta[
            "chat_template"], f"{totals['num_trained_tokens']:,}", f"{num_tokens:,}",
                 100 * totals["num_trained_tokens"] / max(num_tokens, 1))
        if totals["num_eos_inside"]:
            log.warning("%d conversations hold the tokenizer's EOS before their end (the template ends turns with "
                        "it): document masking, which cuts documents at EOS, would cut them into turns",
                        totals["num_eos_inside"])
    if totals["num_bad_records"]:
        log.warning("skipped %d bad records (data.on_bad_record=skip); the first: %s",
                    totals["num_bad_records"], totals["first_bad_record"])


def _sound_prefix(shards: list[dict]) -> list[dict]:
    """The shards up to the first whose chunk number or running totals are not what this code writes."""
    kept: list[dict] = []
    for shard in shards:
        end, totals = shard.get("end_chunk"), shard.get("totals")
        previous = kept[-1]["end_chunk"] if kept else 0
        if (not isinstance(end, int) or isinstance(end, bool) or not previous < end < 2**63
                or not isinstance(totals, dict) or set(totals) != set(_zero_totals())
                or not all(isinstance(totals[k], int) and not isinstance(totals[k], bool) and totals[k] >= 0
                           for k in totals if k != "first_bad_record")
                or not isinstance(totals["first_bad_record"], (str, type(None)))):
            break
        kept.append(shard)
    return kept


def _resumable(root: Path, progress: dict) -> bool:
    """A progress record to continue from: its tokenizer intact, its fields of the expected kinds, its shards
    hashed in blocks of the size this code hashes them in."""
    vocab_size, name = progress.get("vocab_size"), progress.get("tokenizer_file")
    if (not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 0 < vocab_size < 2**32
            or progress.get("dtype") != token_dtype(vocab_size).name
            or progress.get("tokenizer_kind") not in ("hf", "sentencepiece") or not is_plain_name(name)
            or not isinstance(progress.get("files"), list) or progress.get("hash_block_bytes") != HASH_BLOCK_BYTES):
        return False
    path = root / name
    return (nofollow.check(path, folder_ok=name in FOLDER_NAMES)
            and tokenizer_sha256(path) == progress.get("tokenizer_sha256"))


def _replace_with(path: Path, write: Callable[[Path], object]) -> None:
    """Write a file or folder under a .tmp name (made anew: never through a link), then move it into place."""
    tmp = path.with_name(path.name + ".tmp")
    nofollow.remove(tmp, folder_ok=tmp.name in FOLDER_NAMES)
    write(tmp)
    nofollow.replace(tmp, path, folder_ok=path.name in FOLDER_NAMES)


def _copy_into(source: Path, target: Path) -> None:
    with nofollow.create(target) as dst:
        dst.write(read_tokenizer_file(source))  # bounded, and never a FIFO or a device


# ---------------------------------------------------------------- entry points


def prepare_data(dataset_dir: str | Path, settings: PrepareSettings, *, show_progress: bool = True,
                 max_input_mb: float = 0.0) -> PreparedData:
    """Prepare the corpus into dataset_dir, continue an interrupted preparation of it there, or reuse
    what an earlier identical call left. max_input_mb (> 0) refuses corpora larger than that on disk (as read,
    where a server does not give a file's size), or that read as more text.

    dataset_dir must be new, empty, or a folder this library prepared: one holding files its records
    do not name is refused (unless it is already prepared from the same inputs), never cleared. A second
    call on a folder being prepared waits for the first, then reuses its result or, when that was
    prepared from other inputs or settings, refuses."""
    corpus, source = _corpus_and_source(settings, max_input_mb=max_input_mb)
    return _prepare(Path(dataset_dir), settings, corpus, source, show_progress=show_progress,
                    max_input_mb=max_input_mb)


def _corpus_and_source(settings: PrepareSettings, *, max_input_mb: float) -> tuple[Corpus, Source]:
    """The corpus, checked, and what the folder prepared from it depends on (which may read a URL through: see
    RemoteFile.identity)."""
    if problems := settings.problems():
        raise DataError("; ".join(problems))
    corpus = Corpus.of(settings, max_input_mb=max_input_mb)
    if settings.tokenizer_model:  # missing, not a regular file, too large, damaged: one line before any work
        load_sentencepiece(Path(settings.tokenizer_model).expanduser())
    return corpus, Source.of(settings, corpus)


@refusals_as_data_errors()
def _prepare(root: Path, settings: PrepareSettings, corpus: Corpus, source: Source, *, show_progress: bool,
             max_input_mb: float) -> PreparedData:
    """prepare_data, once the corpus and its source are known."""
    if (prepared := _reuse(root, source)) is not None:
        return prepared
    if max_input_mb and corpus.disk_bytes > max_input_mb * 2**20:
        raise DataError(f"the corpus is {corpus.disk_bytes / 2**20:,.0f} MB, more than data.max_in_job_mb="
                        f"{max_input_mb:g} prepares inside a training job: {PREPARE_FIRST}")
    if not (is_ours(root) and nofollow.kind_at(root / LOCK_NAME) == "a file"):
        _refuse_foreign(root)  # before the marker and the lock: nothing is written into a folder that is not ours
    claim_folder(root)
    complete = bool(read_record(root / META_NAME))  # replaced only while nothing holds the folder's lock
    try:
        return _prepare_locked(root, settings, corpus, source, show_progress=show_progress, wait=not complete)
    except FolderInUse:
        if (prepared := _reuse(root, source)) is not None:  # another preparation finished it meanwhile
            return prepared
        if not complete:
            raise _just_prepared(root, source) from None
        found = read_record(root / META_NAME)
        other = f"holds data prepared from other inputs or settings ({source.difference(found)}) and " \
            if found.get("source_fingerprint") != source.fingerprint else ""
        raise DataError(f"{root} {other}is in use by another process (its {LOCK_NAME} is held: a training job "
                        "reads it, or a preparation writes it), and a folder in use is not prepared again; wait for it "
                        "to end, or give this preparation another data.dataset_dir") from None


def _just_prepared(root: Path, source: Source) -> DataError:
    """The refusal of a preparation that waited for another one of the same folder, which prepared other inputs."""
    return DataError(f"{root} was just prepared by another process from other inputs or settings "
                     f"({source.difference(read_record(root / META_NAME))}); give this preparation another "
                     "data.dataset_dir")


def _prepare_locked(root: Path, settings: PrepareSettings, corpus: Corpus, source: Source, *, show_progress: bool,
                    wait: bool) -> PreparedData:
    """_prepare under the folder's lock. Held by another process: with `wait` (the folder is not complete: another
    preparation writes it), wait until it is released or the folder complete; else FolderInUse."""
    said: list[str] = []

    def waiting(holder: str) -> bool:
        if not said:
            said.append(holder)
            log.info("waiting for another preparation of %s to finish (%s)", root, holder)
        return not read_record(root / META_NAME)

    with folder_lock(root, wait=waiting if wait else None) as waited:
        if waited:
            if (prepared := _reuse(root, source)) is not None:
                return prepared
            if read_record(root / META_NAME):
                raise _just_prepared(root, source)
        _refuse_foreign(root)
        num_workers = settings.processes(corpus.read_bytes)
        log.info("preparing %s into %s with %s", corpus.name, root,
                 f"{num_workers} worker processes" if num_workers else "no worker process (a small corpus)")
        with _worker_pool(settings, corpus, num_workers) as pool:
            try:
                return _Preparation(root, settings, corpus, source, pool, window=2 * num_workers + 2,
                                    show_progress=show_progress).run()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise


def _reuse(root: Path, source: Source) -> PreparedData | None:
    """The complete folder of these inputs and settings, or None (a damaged one is prepared again)."""
    if complete_fingerprint(root) != source.fingerprint:
        return None
    try:
        prepared = load_prepared(root)
    except DataError:
        return None
    log.info("using the data prepared earlier in %s", root)
    return prepared


def _refuse_foreign(root: Path) -> None:
    """Refuse a folder that holds files the library did not write, or a link or special file under one of the
    names it writes whatever its records say."""
    if is_ours(root):
        for name in (*FIXED_NAMES, MARKER_NAME):
            nofollow.check(root / name)
    if foreign := foreign_names(root):
        if is_marked(root) and nofollow.kind_at(root / META_NAME) == "a file" and not read_record(root / META_NAME):
            raise DataError(f"{root / META_NAME} is damaged or was edited, so which files in {root} this library "
                            f"wrote can no longer be proven and none is replaced: delete the folder and prepare "
                            f"again, or choose another data.dataset_dir")
        listed = ", ".join(map(shown, foreign[:3])) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DataError(f"{root} holds files this library did not write ({listed}): data.dataset_dir must be a new "
                        f"or empty folder, or one prepared by this library; nothing was changed there")


def prepare_for_training(dataset_dir: str | Path, settings: PrepareSettings, *, named_dir: bool,
                         max_input_mb: float) -> None:
    """Rank 0's share of train_fsdp.py: make sure dataset_dir holds the data to train on.

    A complete folder the user named (named_dir) that was prepared from other inputs or settings is trained on as it is
    when data.files and data.hf_dataset.path are empty (the `--data.dataset_dir=DIR` of a folder made by
    scripts/prepare_data.py), and is an error when either is set: it is never overwritten by a job. Otherwise the corpus
    is prepared (or an earlier preparation reused or continued), when no larger than max_input_mb."""
    root = Path(dataset_dir)
    found = read_record(root / META_NAME) if named_dir else {}
    if found and not settings.files and not settings.hf_dataset.path:
        log.info("training on the data prepared in %s (data.files is empty)", root)
        return
    corpus, source = _corpus_and_source(settings, max_input_mb=max_input_mb)  # once: it may hash URLs
    if found and found.get("source_fingerprint") != source.fingerprint:
        given = "data.hf_dataset.path" if settings.hf_dataset.path else "data.files"
        raise DataError(f"{root} already holds data prepared from other inputs or settings "
                        f"({source.difference(found)}); delete it to prepare {given} there, or leave "
                        f"{given} empty to train on it as it is")
    _prepare(root, settings, corpus, source, show_progress=True, max_input_mb=max_input_mb)
