"""What each preparation worker process runs: a chunk of pieces -> documents -> split and tokens. A document's split
and its tokenizer-sample key come from a keyed hash of its text alone (and the seed), so equal documents always land
in the same split. A worker ends with the process that started it, however that one ends (a kill -9 included)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .chat import BadConversation, ChatFields, Conversation, TemplateUnusable, plain_text, render_plain
from .errors import DataError
from .readers import Piece, piece_conversations, piece_documents


@dataclass(frozen=True)
class WorkerSettings:
    text_field: str
    strict: bool  # False for the stdlib corpus: undecodable bytes are replaced
    skip_bad_records: bool
    max_document_mb: float
    val_fraction: float
    seed: int
    chat: ChatFields | None = None  # data.format=chat: where records keep their conversation
    chat_template: str = "plain"  # data.format=chat: "tokenizer" (an HF tokenizer's own) or "plain" (ours)


@dataclass
class Chunk:
    index: int
    pieces: list[Piece]
    disk_done: int  # bytes of the corpus on disk read once this chunk is done (for progress)


@dataclass
class ChunkResult:
    index: int
    disk_done: int
    num_train_documents: int = 0
    num_val_documents: int = 0
    num_bytes: int = 0  # UTF-8 bytes of the documents' text
    num_bad_records: int = 0
    first_bad_record: str | None = None
    num_blank_records: int = 0
    train: np.ndarray | None = None  # token ids, EOS after each document
    val: np.ndarray | None = None
    train_mask: np.ndarray | None = None  # data.format=chat: uint8, 1 where the token is trained on
    val_mask: np.ndarray | None = None
    num_trained_tokens: int = 0  # data.format=chat: tokens whose mask is 1 (train and val)
    num_eos_inside: int = 0  # data.format=chat: conversations whose rendering holds an EOS before its end
    sample: list[tuple[int, str]] = field(default_factory=list)  # (key, text) tokenizer-sample candidates


_settings: WorkerSettings | None = None
_tokenizer: tuple[tuple[str, str], object] | None = None  # ((kind, path), tokenizer), loaded on first use


def init(settings: WorkerSettings) -> None:
    global _settings, _tokenizer
    _settings = settings
    # A new preparation may have trained a new tokenizer at the same path: never encode with the last one's.
    _tokenizer = None


# prctl(2): the signal the kernel sends this process when its parent ends.
PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 1.0


def init_process(settings: WorkerSettings, parent_pid: int) -> None:
    """The initializer of a worker process started by the process parent_pid."""
    die_with_parent(parent_pid)
    init(settings)


def die_with_parent(parent_pid: int) -> None:
    """End this process when parent_pid ends: at once on Linux (the kernel's parent-death signal), else
    within PARENT_POLL_S (a thread that watches for this process being handed to another parent)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # no prctl in this C library: the thread below still watches
    if os.getppid() != parent_pid:  # the parent ended before the signal was asked for
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def document_keys(utf8: bytes, *, seed: int) -> tuple[int, int]:
    """Two independent 64-bit values from a keyed hash of the text: (split value, sample key)."""
    digest = hashlib.blake2b(utf8, digest_size=16, key=seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")


def is_held_out(split_value: int, val_fraction: float) -> bool:
    return split_value < val_fraction * 2.0**64


def _documents(chunk: Chunk, result: ChunkResult):
    """(document, held out?, sample key) of the chunk's non-blank documents (text, or a conversation's
    messages with data.format=chat); bad records per the setting."""
    s = _settings
    assert s is not None, "set by the pool's initializer"

    def bad_record(problem: str) -> None:
        if not s.skip_bad_records:
            raise DataError(f"{problem} (data.on_bad_record=skip skips such records)")
        result.num_bad_records += 1
        result.first_bad_record = result.first_bad_record or problem

    for piece in chunk.pieces:
        documents: Iterator[tuple[str | Conversation, bytes]]
        if s.chat is not None:
            documents = piece_conversations(piece, fields=s.chat, bad_record=bad_record)
        else:
            documents = piece_documents(piece, text_field=s.text_field, strict=s.strict,
                                        max_document_mb=s.max_document_mb, bad_record=bad_record)
        for document, utf8 in documents:
            if isinstance(document, str) and not document.strip():
                result.num_blank_records += 1
                continue
            split_value, sample_key = document_keys(utf8, seed=s.seed)
            held_out = is_held_out(split_value, s.val_fraction)
            result.num_bytes += len(utf8)
            result.num_val_documents += held_out
            result.num_train_documents += not held_out
            yield document, held_out, sample_key


def sample_chunk(chunk: Chunk, threshold: int) -> ChunkResult:
    """Pass 1: the chunk's training documents whose sample key is below threshold (tokenizer sample)."""
    result = ChunkResult(chunk.index, chunk.disk_done)
    result.sample = [(key, text if isinstance(text, str) else plain_text(text.messages))
                     for text, held_out, key in _documents(chunk, result) if not held_out and key < threshold]
    return result


def encode_chunk(chunk: Chunk, tokenizer: tuple[str, str], dtype: str) -> ChunkResult:
    """Pass 2: the chunk's documents as token ids, EOS after each, split into train and val (with
    data.format=chat, conversations, and a mask of the tokens to train on)."""
    result = ChunkResult(chunk.index, chunk.disk_done)
    documents = list(_documents(chunk, result))
    processor = _load(tokenizer)
    if _settings is not None and _settings.chat is not None:
        return _encode_conversations(documents, processor, result, dtype=np.dtype(dtype))
    # One thread: the worker processes are the parallelism (SentencePiece would use every core for a list).
    encoded = processor.encode([text for text, _, _ in documents], out_type=int, num_threads=1) if documents else []
    eos = processor.eos_id()
    for split, held_out in (("train", False), ("val", True)):
        ids = [doc_ids for doc_ids, (_, is_val, _) in zip(encoded, documents, strict=True) if is_val == held_out]
        setattr(result, split, _flatten(ids, eos=eos, dtype=np.dtype(dtype)))
    return result


def _encode_conversations(documents: list, processor, result: ChunkResult, *, dtype: np.dtype) -> ChunkResult:
    """Each conversation as ids and mask (data/chat.py), then EOS (untrained) unless it already ends with one."""
    s = _settings
    assert s is not None
    eos = processor.eos_id()
    rendered: dict[bool, list[tuple[list[int], list[int]]]] = {False: [], True: []}
    for conversation, held_out, _ in documents:
        try:
            ids, mask = render_conversation(processor, conversation.messages, template=s.chat_template)
        except TemplateUnusable as err:
            raise DataError(f"{err} (met at {conversation.where})") from None
        except BadConversation as err:
            problem = f"{conversation.where}: {err}"
            if not s.skip_bad_records:
                raise DataError(f"{problem} (data.on_bad_record=skip skips such records)") from None
            result.num_bad_records += 1
            result.first_bad_record = result.first_bad_record or problem
            result.num_train_documents -= not held_out
            result.num_val_documents -= held_out
            continue
        result.num_trained_tokens += sum(mask)
        result.num_eos_inside += eos in ids[:-1]
        if not ids or ids[-1] != eos:
            ids, mask = ids + [eos], mask + [0]
        rendered[held_out].append((ids, mask))
    for split, held_out in (("train", False), ("val", True)):
        pairs = rendered[held_out]
        setattr(result, split, np.array([i for ids, _ in pairs for i in ids], dtype=dtype))
        setattr(result, f"{split}_mask", np.array([m for _, mask in pairs for m in mask], dtype=np.uint8))
    return result


def render_conversation(processor, messages: list[dict[str, str]], *, template: str) -> tuple[list[int], list[int]]:
    """(ids, mask) of one conversation: the HF tokenizer's own template, or ours (PLAIN) with any tokenizer."""
    if template == "tokenizer":
        return processor.render_chat(messages)
    return render_plain(lambda texts: processor.encode(texts, out_type=int, num_threads=1), messages)


def _load(tokenizer: tuple[str, str]):
    global _tokenizer
    if _tokenizer is None or _tokenizer[0] != tokenizer:
        from .tokenizer import load_tokenizer

        _tokenizer = (tokenizer, load_tokenizer(tokenizer[0], Path(tokenizer[1])))
    return _tokenizer[1]


def _flatten(documents: list[list[int]], *, eos: int, dtype: np.dtype) -> np.ndarray:
    out = np.empty(sum(len(ids) + 1 for ids in documents), dtype=dtype)
    position = 0
    for ids in documents:
        out[position : position + len(ids)] = ids
        out[position + len(ids)] = eos
        position += len(ids) + 1
    return out
