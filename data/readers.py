"""Corpus formats: which files a `data.files` entry names, and how each format is read.

The parent process streams each file as *pieces*, a bounded amount of raw input cut where a record ends:
a block of JSON lines (plain, gzip or zstd), one document of a .txt file, or a batch of a parquet text
column. No piece holds more than data.max_document_mb of one line: a longer .txt line is cut into
documents of that size, and a longer JSON line is read through without being kept (a bad record).
Worker processes turn pieces into documents (`piece_documents`), so JSON parsing and UTF-8 decoding
run in parallel with everything else. pyarrow and zstandard are imported only when a parquet
or zstd file is read.
"""
from __future__ import annotations

import glob
import gzip
import importlib
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from .chat import BadConversation, ChatFields, Conversation, canonical_text, conversation
from .errors import DataError

# suffix -> (how records are laid out, compression). Longest suffixes first, so .jsonl.gz is not .gz.
FORMATS = {
    ".jsonl.gz": ("jsonl", "gz"), ".json.gz": ("jsonl", "gz"),
    ".jsonl.zst": ("jsonl", "zst"), ".json.zst": ("jsonl", "zst"),
    ".jsonl": ("jsonl", None), ".txt": ("text", None), ".parquet": ("parquet", None),
}
SUPPORTED = ", ".join(FORMATS)
# A .txt file is one document; a larger one is cut at the first line end past this size into several,
# so no process ever holds a whole big file.
TXT_DOCUMENT_BYTES = 1 << 20
PARQUET_BATCH_ROWS = 1024
READ_BLOCK_BYTES = 1 << 20


@dataclass
class Piece:
    # "jsonl": whole JSON lines; "text": one document; "rows": a pyarrow string array; "too_long": a JSON
    # line longer than data.max_document_mb, read through and dropped (data: the problem, for bad_record)
    kind: str
    path: str
    data: Any  # bytes, a pyarrow array for "rows" (pyarrow has no type hints), a message for "too_long"
    first: int  # number of the first line (jsonl, text; from 1) or row (rows; from 0) in its file
    num_bytes: int  # uncompressed input bytes
    disk_end: int  # bytes of the file on disk read once this piece is done (for progress)


def format_of(path: Path) -> tuple[str, str | None] | None:
    name = path.name.lower()
    return next((fmt for suffix, fmt in FORMATS.items() if name.endswith(suffix)), None)


def expand_inputs(entries: list[str]) -> list[Path]:
    """Files named by data.files entries: files, folders (every supported file below, sorted) and globs."""
    paths: list[Path] = []
    for entry in entries:
        path = Path(entry).expanduser()
        if glob.has_magic(str(path)):
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            found = [p for p in matches if format_of(p)]
            if not found:
                raise DataError(f"no {SUPPORTED} files match {entry}")
            paths.extend(found)
        elif not path.exists():
            raise DataError(f"data file not found: {path}")
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and format_of(p))
            if not found:
                raise DataError(f"no {SUPPORTED} files under directory {path}")
            paths.extend(found)
        elif format_of(path):
            paths.append(path)
        else:
            raise DataError(f"unsupported data file {path}: expected one of {SUPPORTED}, a folder or a glob of them")
    return paths


def optional_import(module: str, package: str, path: Path):
    """Import a format's library on first need, or say in one line which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {path} needs the {package} package: pip install {package}") from None


# ---------------------------------------------------------------- parent side: files -> pieces


def read_pieces(path: Path, *, piece_bytes: int, text_field: str, max_document_mb: float, skip_long: bool,
                max_read_bytes: int = 0) -> Iterator[Piece]:
    """The file's content as pieces of about piece_bytes (one document each for .txt and .py files).

    A line longer than max_document_mb: a .txt line is cut into documents of at most that size; a JSON
    line is read through without being kept, then given as a "too_long" piece (skip_long), or is an error
    at once. With max_read_bytes (> 0), reading stops after the piece that reaches it.
    """
    layout, compression = format_of(path) or ("text", None)  # the stdlib corpus's .py files are text
    if layout == "parquet":
        yield from _parquet_pieces(path, text_field)
        return
    max_document_bytes = int(max_document_mb * 2**20)
    size = min(TXT_DOCUMENT_BYTES if layout == "text" else piece_bytes, max_document_bytes)
    first_line = 1

    def long_line() -> str:
        problem = f"{path} line {first_line}: a record of more than data.max_document_mb={max_document_mb:g} MB"
        if not skip_long:  # said at once, rather than after reading the whole line
            raise DataError(f"{problem} (data.on_bad_record=skip skips such records)")
        return problem

    with open(path, "rb") as raw:
        stream = _decompressed(raw, compression, path)
        lines = _cut_after_lines(stream, size, path=path, compression=compression, max_line=max_document_bytes,
                                 cut_long=layout == "text", limit=max_read_bytes, on_long_line=long_line)
        for data in lines:
            if isinstance(data, tuple):
                problem, num_bytes = data
                yield Piece("too_long", str(path), problem, first_line, num_bytes, raw.tell())
                first_line += 1
                continue
            yield Piece(layout, str(path), data, first_line, len(data), raw.tell())
            first_line += data.count(b"\n")


class _Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


def _decompressed(raw: BinaryIO, compression: str | None, path: Path) -> _Readable:
    if compression == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zst":
        return _ZstdFrames(raw, optional_import("zstandard", "zstandard", path))
    return raw


class _ZstdFrames:
    """A readable stream of zstd frames written back to back. zstandard's own stream_reader ends quietly
    at a truncated frame; this raises EOFError there."""

    def __init__(self, raw: BinaryIO, zstandard):
        self.raw = raw
        self.zstd = zstandard.ZstdDecompressor()
        self.frame: Any = None  # the decompressor of the current frame (zstandard has no type hints)

    def read(self, size: int) -> bytes:
        while True:
            # A small compressed block keeps the output of even a very compressible one bounded.
            block = self.raw.read(max(size // 16, 1))
            if not block:
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("the last zstd frame ends early")
                return b""
            out = []
            while block:
                if self.frame is None or self.frame.eof:
                    self.frame = self.zstd.decompressobj()
                out.append(self.frame.decompress(block))
                block = self.frame.unused_data if self.frame.eof else b""
            if any(out):
                return b"".join(out)


def _cut_after_lines(stream: _Readable, size: int, *, path: Path, compression: str | None, max_line: int,
                     cut_long: bool, limit: int, on_long_line: Callable[[], str]) -> Iterator[bytes | tuple[str, int]]:
    """Blocks of whole lines, each cut at the first line end at or after `size` bytes (size <= max_line).

    No more than max_line bytes of one line are ever held: with cut_long a block is cut at max_line (at
    a UTF-8 character boundary); else on_long_line() is called (it may raise), the rest of the line is
    read through and dropped, and (on_long_line's message, the line's length) is given in its place.
    With limit (> 0), reading stops after the block that reaches it.
    Cuts depend only on the content, never on how reads happened to return, so the pieces (and
    everything derived from them) are the same on every run. Only the line across `size` can be longer
    than max_line, so that is the one line checked.
    """
    buffer = bytearray()
    searched = size - 1  # no line end in buffer[size - 1 : searched]: a long line is scanned once
    done = 0  # bytes of the stream given out or dropped
    while True:
        block = _read_block(stream, path, compression)
        buffer += block
        while len(buffer) >= size:
            end = buffer.find(b"\n", searched, max_line if cut_long else len(buffer))
            if end < 0 and not (cut_long and len(buffer) > max_line):
                searched = len(buffer)
                if cut_long or len(buffer) - (line_start := buffer.rfind(b"\n", 0, size - 1) + 1) <= max_line:
                    break
                # The line across `size` is already too long: drop it without waiting for its end.
                if line_start:
                    yield bytes(buffer[:line_start])
                problem, dropped = on_long_line(), len(buffer) - line_start
                del buffer[:]
                while not limit or done + line_start + dropped < limit:
                    block = _read_block(stream, path, compression)
                    if (newline := block.find(b"\n")) >= 0 or not block:
                        dropped += newline + 1
                        buffer += block[newline + 1 :] if block else b""
                        break
                    dropped += len(block)
                yield problem, dropped
                cut = line_start + dropped
            elif end < 0:  # cut_long: a document of max_line bytes
                cut = _utf8_boundary(buffer, max_line)
                yield bytes(buffer[:cut])
                del buffer[:cut]
            elif not cut_long and end + 1 - (line_start := buffer.rfind(b"\n", 0, end) + 1) > max_line:
                if line_start:  # the long line came whole with one read: dropped all the same
                    yield bytes(buffer[:line_start])
                yield on_long_line(), end + 1 - line_start
                cut = end + 1
                del buffer[:cut]
            else:
                cut = end + 1
                yield bytes(buffer[:cut])
                del buffer[:cut]
            done += cut
            searched = size - 1
            if limit and done >= limit:
                return
            block = block or b"-"  # what a dropped line's read left in buffer is still to be cut
        if not block:
            if buffer:
                yield bytes(buffer)
            return


def _utf8_boundary(data: bytearray, position: int) -> int:
    """The cut at or up to 3 bytes before position that does not split a UTF-8 character (position itself
    in text that is not UTF-8 there, which decoding reports)."""
    for cut in range(position, max(position - 4, 0), -1):
        if data[cut] & 0xC0 != 0x80:
            return cut
    return position


def _read_block(stream: _Readable, path: Path, compression: str | None) -> bytes:
    try:
        return stream.read(READ_BLOCK_BYTES)
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        if compression is None:
            raise DataError(f"cannot read {path}: {err}") from None
        kind = {"gz": "gzip", "zst": "zstd"}[compression]
        raise DataError(f"{path}: corrupt or truncated {kind} file ({err})") from None
    except Exception as err:
        if type(err).__name__ == "ZstdError":  # zstandard's own error type, without importing it here
            raise DataError(f"{path}: corrupt or truncated zstd file ({err})") from None
        raise


def _parquet_pieces(path: Path, field: str) -> Iterator[Piece]:
    pq = optional_import("pyarrow.parquet", "pyarrow", path)
    import pyarrow as pa

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    names = parquet.schema_arrow.names
    if field not in names:
        raise DataError(f"{path} has no column '{field}' (it has {', '.join(names)}); set data.text_field")
    column_type = parquet.schema_arrow.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column '{field}' holds {column_type}, not text")
    num_rows, disk_size, row = parquet.metadata.num_rows, path.stat().st_size, 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            column = batch.column(0)
            done = disk_size * (row + len(column)) // max(num_rows, 1)
            yield Piece("rows", str(path), column, row, column.nbytes, done)
            row += len(column)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path} row {row}: cannot read parquet ({err})") from None


def truncate(piece: Piece, max_bytes: int) -> Piece:
    """The start of a piece holding at least max_bytes: whole lines or rows. A "text" piece is one
    document and is kept whole."""
    if piece.num_bytes <= max_bytes or piece.kind in ("text", "too_long"):
        return piece
    if piece.kind == "jsonl":
        end = piece.data.find(b"\n", max_bytes - 1)
        data = piece.data if end < 0 else piece.data[: end + 1]
        return Piece(piece.kind, piece.path, data, piece.first, len(data), piece.disk_end)
    import numpy as np
    import pyarrow.compute as pc

    lengths = np.cumsum(pc.binary_length(piece.data).fill_null(0).to_numpy(zero_copy_only=False))
    num_rows = int(np.searchsorted(lengths, max_bytes)) + 1
    rows = piece.data.slice(0, num_rows)
    return Piece(piece.kind, piece.path, rows, piece.first, rows.nbytes, piece.disk_end)


# ---------------------------------------------------------------- worker side: pieces -> documents

Document = tuple[str, bytes]  # the text and its UTF-8 bytes


def piece_documents(piece: Piece, *, text_field: str, strict: bool, max_document_mb: float,
                    bad_record: Callable[[str], None]) -> Iterator[Document]:
    """The documents of a piece, in order. A record that cannot be read is handed to bad_record (which
    raises, or counts it and returns so the record is skipped), with the file and line or row."""
    if piece.kind == "too_long":
        bad_record(piece.data)
    elif piece.kind == "text":
        yield from _text_document(piece, strict=strict, bad_record=bad_record)
    elif piece.kind == "jsonl":
        yield from _jsonl_documents(piece, text_field=text_field, bad_record=bad_record)
    else:
        for offset, text in enumerate(piece.data.to_pylist()):
            where = f"{piece.path} row {piece.first + offset}"
            if not isinstance(text, str):
                bad_record(f"{where}: '{text_field}' is empty (null)")
            elif (utf8 := _utf8(text, where, bad_record)) is None:
                continue
            elif len(utf8) > max_document_mb * 2**20:
                bad_record(f"{where}: a record of more than data.max_document_mb={max_document_mb:g} MB")
            else:
                yield text, utf8


def _text_document(piece: Piece, *, strict: bool, bad_record: Callable[[str], None]) -> Iterator[Document]:
    if not strict:  # the stdlib corpus is not ours to fix: undecodable bytes there are replaced, not fatal
        text = piece.data.decode("utf-8", errors="replace")
        yield text, text.encode("utf-8")
        return
    try:
        yield piece.data.decode("utf-8"), piece.data
    except UnicodeDecodeError as err:
        line = piece.first + piece.data.count(b"\n", 0, err.start)
        bad_record(f"{piece.path} line {line}: not valid UTF-8 ({err.reason} at byte {err.start})")


def _jsonl_records(piece: Piece, *, bad_record: Callable[[str], None]) -> Iterator[tuple[str, Any]]:
    """(where, parsed JSON value) of each non-blank line of a "jsonl" piece."""
    for offset, line in enumerate(piece.data.split(b"\n")):
        if not line.strip():
            continue
        where = f"{piece.path} line {piece.first + offset}"
        try:
            yield where, json.loads(line)
        except UnicodeDecodeError as err:
            bad_record(f"{where}: not valid UTF-8 ({err.reason})")
        except json.JSONDecodeError as err:
            bad_record(f"{where}: invalid JSON ({err.msg})")


def piece_conversations(piece: Piece, *, fields: ChatFields,
                        bad_record: Callable[[str], None]) -> Iterator[tuple[Conversation, bytes]]:
    """data.format=chat: the conversations of a piece of JSON lines, each with its canonical bytes (see
    data/chat.py); a record that is not one is handed to bad_record."""
    if piece.kind == "too_long":
        bad_record(piece.data)
        return
    if piece.kind != "jsonl":
        raise DataError(f"{piece.path}: data.format=chat reads .jsonl files (also .gz, .zst) of conversations")
    for where, record in _jsonl_records(piece, bad_record=bad_record):
        try:
            messages = conversation(record, fields)
        except BadConversation as err:
            bad_record(f"{where}: {err}")
            continue
        if (utf8 := _utf8(canonical_text(messages), where, bad_record)) is not None:
            yield Conversation(messages, where), utf8


def _jsonl_documents(piece: Piece, *, text_field: str, bad_record: Callable[[str], None]) -> Iterator[Document]:
    for where, record in _jsonl_records(piece, bad_record=bad_record):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            bad_record(f"{where}: expected an object with a string '{text_field}' field")
        elif (utf8 := _utf8(text, where, bad_record)) is not None:
            yield text, utf8


def _utf8(text: str, where: str, bad_record: Callable[[str], None]) -> bytes | None:
    """JSON and parquet can carry unpaired surrogates (\\ud800), which no tokenizer can encode."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        bad_record(f"{where}: text holds an unpaired surrogate, not valid Unicode")
        return None
