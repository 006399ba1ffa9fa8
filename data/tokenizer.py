"""SentencePiece: training a vocabulary on a sample of the corpus, and loading one.

The sample is drawn across the whole corpus, not from its start: each training document carries a
pseudo-random key (from its hash, see data/worker.py), and the sample is the documents with the
smallest keys that fit in MAX_SAMPLE_CHARS characters. That set depends only on the corpus, not on the order
in which worker processes deliver documents, and it is kept in bounded memory while streaming."""
from __future__ import annotations

import heapq
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm

from safe_io.names import shown

from .errors import DataError, first_line
from .store import read_tokenizer_file

# Text SentencePiece learns from, at most: documents, then lines drawn from them.
MAX_SAMPLE_CHARS = 32 << 20
MAX_TOKENIZER_SENTENCES = 300_000
# Lines longer than this (bytes) are skipped by SentencePiece training, not by encoding.
MAX_SENTENCE_BYTES = 1 << 16


class TokenizerSample:
    """The documents with the smallest keys whose texts fit in max_chars characters, kept while streaming."""

    def __init__(self, max_chars: int | None = None):
        self.max_chars = max_chars or MAX_SAMPLE_CHARS
        self._heap: list[tuple[int, str]] = []  # (-key, text): the largest key on top, to evict first
        self._num_chars = 0
        # No document with a key at or above this can end up in the sample: pass it to the workers so
        # they send back only candidates.
        self.threshold = 1 << 64

    def offer(self, key: int, text: str) -> None:
        if key >= self.threshold:
            return
        heapq.heappush(self._heap, (-key, text))
        self._num_chars += len(text)
        while self._num_chars > self.max_chars and len(self._heap) > 1:
            neg_key, evicted = heapq.heappop(self._heap)
            self._num_chars -= len(evicted)
            self.threshold = min(self.threshold, -neg_key)

    def documents(self) -> list[str]:
        """The sampled documents, smallest key first."""
        return [text for _, text in sorted(self._heap, reverse=True)]


def _training_lines(documents: list[str]) -> Iterator[str]:
    # SentencePiece learns from lines; newlines themselves are covered by byte fallback.
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line


def sampled_training_lines(documents: list[str], *, max_lines: int, seed: int) -> Iterator[str]:
    """At most max_lines lines, drawn with our own seeded RNG.

    SentencePiece's shuffle_input_sentence sampling is not reproducible even with a fixed seed, so we
    sample here and let it use everything it is given."""
    num_lines = sum(1 for _ in _training_lines(documents))
    if num_lines <= max_lines:
        yield from _training_lines(documents)
        return
    keep = np.zeros(num_lines, dtype=bool)
    keep[np.random.default_rng(seed).choice(num_lines, size=max_lines, replace=False)] = True
    for line_index, line in enumerate(_training_lines(documents)):
        if keep[line_index]:
            yield line


def train_tokenizer(lines: Iterable[str], *, vocab_size: int, out_path: Path) -> None:
    model = _ProtoSink()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            # Already sampled; 0 tells SentencePiece to keep every line it gets.
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
        raise DataError(_training_failure(str(err), vocab_size)) from None
    out_path.write_bytes(model.data)


def _training_failure(message: str, vocab_size: int) -> str:
    """SentencePiece's refusal as advice that points the right way for its cause."""
    if found := re.search(r"smaller than required_chars\. \d+ vs (\d+)", message):
        # Every distinct character of the sample, plus the byte and special pieces, needs a piece of its own.
        return (f"data.vocab_size={vocab_size} is too small for this corpus: its characters plus the byte and "
                f"special pieces need {found[1]}; set data.vocab_size to at least {found[1]}")
    if found := re.search(r"too high \(\d+\)\. Please set it to a value <= (\d+)", message):
        return (f"data.vocab_size={vocab_size} is too large for this corpus, which yields at most {found[1]} "
                f"pieces; set data.vocab_size to at most {found[1]}, or add data")
    return f"SentencePiece could not train a vocabulary of {vocab_size} on this corpus: {message.splitlines()[0]}"


class _ProtoSink:
    """Collects the serialized model SentencePiece writes, so nothing is half-written on disk."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def load_sentencepiece(path: Path, *, need_eos: bool = True) -> spm.SentencePieceProcessor:
    """The SentencePiece model in the file `path` (read by read_tokenizer_file), every piece of it UTF-8 text (or
    decoding would fail on it); DataError in one line naming the file otherwise, and, with need_eos, for a model
    without an EOS piece."""
    try:
        data = read_tokenizer_file(path)
    except OSError as err:
        raise DataError(f"{shown(path)}: cannot read the SentencePiece model ({err.strerror or err})") from None
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(data)
        processor.id_to_piece(list(range(processor.get_piece_size())))
    except UnicodeDecodeError:  # a piece, or SentencePiece's message quoting one, that is not UTF-8
        raise DataError(f"cannot load SentencePiece model {shown(path)}: a piece of it is not valid UTF-8 text (a "
                        f"damaged file)") from None
    except (OSError, RuntimeError) as err:
        raise DataError(f"cannot load SentencePiece model {shown(path)}: {first_line(err)}") from None
    if need_eos and processor.eos_id() < 0:
        raise DataError(f"SentencePiece model {shown(path)} has no EOS piece; documents need one as separator")
    return processor


def load_tokenizer(kind: str, path: Path):
    """A tokenizer with encode(list[str]) / eos_id() / get_piece_size(): SentencePiece or a model's own."""
    if kind == "hf":
        from .hf_tokenizer import HFTokenizer

        try:
            return HFTokenizer(path)
        except (OSError, ValueError) as err:
            raise DataError(f"cannot load the tokenizer in {path}: {err}") from err
    return load_sentencepiece(path)


def prepared_eos_id(tokenizer_path: Path) -> int:
    """The EOS id of a prepared folder's tokenizer: the token that separates its documents. An HF tokenizer is
    saved there as a folder, a SentencePiece model as a file."""
    return load_tokenizer("hf" if tokenizer_path.is_dir() else "sentencepiece", tokenizer_path).eos_id()
