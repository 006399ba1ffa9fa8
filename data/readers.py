"""Corpus formats: which files a `data.files` entry names, and how each format is read.

The parent process streams each file as *pieces*, a bounded amount of raw input cut where a record ends (a block of
JSON lines, plain, gzip or zstd; one document of a .txt file; a batch of a parquet text column), none holding more
than data.max_document_mb of one line; compressed input is decompressed a bounded amount at a time. Worker processes
turn pieces into documents (`piece_documents`). pyarrow and zstandard are imported only when such a file is read."""
from __future__ import annotations

import glob
import gzip
import importlib
import json
import stat
import zlib
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from safe_io.names import shown
from safe_io.urls import is_url

from .chat import BadConversation, ChatFields, Conversation, canonical_text, conversation
from .errors import DataError, first_line
from .remote import TIMEOUT_S, RemoteFile, expand_url

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
# A parquet batch has at most as many rows as this over the largest page keeps it to.
PARQUET_BATCH_BYTES = 16 << 20
# A parquet page is read when it is at most this much larger than data.max_document_mb: a page of several
# records is larger than any of them, and pyarrow writes pages of about 1 MB (or of 1,024 values, where
# those are larger).
PARQUET_PAGE_SLACK = 16 << 20
READ_BLOCK_BYTES = 1 << 20
ZSTD_FEED_BYTES = 256


@dataclass
class Piece:
    # "jsonl": whole JSON lines; "text": one document; "rows": a pyarrow string array; "records": a pyarrow table
    # of conversations (data/hf_datasets.py); "too_long": a JSON line longer than data.max_document_mb, read
    # through and dropped (data: the problem, for bad_record)
    kind: str
    path: str
    data: Any  # bytes, a pyarrow array for "rows" (pyarrow has no type hints), a message for "too_long"
    first: int  # number of the first line (jsonl, text; from 1) or row (rows; from 0) in its file
    num_bytes: int  # uncompressed input bytes
    disk_end: int  # bytes of the file on disk read once this piece is done (for progress)


# A file of the corpus: on a local disk, or a URL's (data/remote.py).
InputFile = Path | RemoteFile


def format_of(path: InputFile) -> tuple[str, str | None] | None:
    name = path.name.lower()
    return next((fmt for suffix, fmt in FORMATS.items() if name.endswith(suffix)), None)


def expand_inputs(entries: list[str], *, timeout_s: float = TIMEOUT_S) -> list[InputFile]:
    """Files named by data.files entries: files, folders (every supported file below, sorted) and globs, local
    or URLs (data/remote.py; a request that gets no answer for timeout_s is a network error).

    Only regular files are read (a FIFO or device would block reading or never end): any other file an entry
    names or matches is an error. Symbolic links to directories are not followed below a folder or a `**`
    (a link to a directory above it would repeat the tree without end), and each file is read once, however
    many entries or links name it: the first name is kept."""
    paths: list[InputFile] = []
    for entry in entries:
        if is_url(entry):
            paths.extend(expand_url(entry, lambda name: format_of(Path(name)) is not None, SUPPORTED,
                                    timeout_s=timeout_s))
            continue
        path = Path(entry).expanduser()
        if glob.has_magic(str(path)):
            found = [p for p in sorted(_glob(path)) if format_of(p) and _regular_file(p)]
            if not found:
                raise DataError(f"no {SUPPORTED} files match {shown(entry)}")
            paths.extend(found)
        elif not path.exists():
            raise DataError(f"data file not found: {shown(path)}")
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if format_of(p) and _regular_file(p))
            if not found:
                raise DataError(f"no {SUPPORTED} files under directory {shown(path)}")
            paths.extend(found)
        elif not format_of(path):
            raise DataError(f"unsupported data file {shown(path)}: expected one of {SUPPORTED}, a folder or a glob of "
                            f"them")
        elif _regular_file(path):
            paths.append(path)
    return _once_each(paths)


def _glob(pattern: Path) -> Iterator[Path]:
    """pathlib's glob from the pattern's first wildcard: unlike glob.glob, its `**` does not follow links."""
    parts = pattern.parts if pattern.name != "**" else (*pattern.parts, "*")  # glob.glob's `**` matches files too
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    return Path(*parts[:first]).glob(str(Path(*parts[first:]))) if first else Path().glob(str(Path(*parts)))


def _regular_file(path: Path) -> bool:
    """True for a regular file (or a link to one), False for a directory; DataError for anything else."""
    try:
        mode = path.stat().st_mode
    except OSError as err:
        raise DataError(f"cannot read data file {shown(path)}: {err.strerror or err}") from None
    if stat.S_ISDIR(mode):
        return False
    if not stat.S_ISREG(mode):
        raise DataError(f"data file {shown(path)} is not a regular file (a FIFO, device or socket): data.files takes "
                        f"files, folders and globs of them")
    return True


def _once_each(paths: list[InputFile]) -> list[InputFile]:
    """The paths without a second name for the same file (the same device and inode, or the same URL)."""
    seen: set[tuple[int, int] | str] = set()
    unique = []
    for path in paths:
        identity = path.url if isinstance(path, RemoteFile) else (path.stat().st_dev, path.stat().st_ino)
        if identity not in seen:
            seen.add(identity)
            unique.append(path)
    return unique


def input_size(path: InputFile) -> int:
    """The file's size in bytes, as stored (compressed)."""
    return path.size if isinstance(path, RemoteFile) else path.stat().st_size


def open_input(path: InputFile) -> BinaryIO:
    """The file for reading as a binary stream (a URL's is fetched as it is read, never downloaded first)."""
    return path.open() if isinstance(path, RemoteFile) else open(path, "rb")  # type: ignore[return-value]


def optional_import(module: str, package: str, path: InputFile):
    """Import a format's library on first need, or say in one line which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {shown(path)} needs the {package} package: pip install {package}") from None


# ---------------------------------------------------------------- parent side: files -> pieces


def read_pieces(path: InputFile, *, piece_bytes: int, text_field: str, max_document_mb: float, skip_long: bool,
                max_read_bytes: int = 0) -> Iterator[Piece]:
    """The file's content as pieces of about piece_bytes (one document each for .txt and .py files).

    A line longer than max_document_mb: a .txt line is cut into documents of at most that size; a JSON line is given as
    a "too_long" piece, after reading through it without keeping it (skip_long), or at once, as the file's last piece
    (the record is an error: the worker that reaches it raises it, after the records before it, so the first bad record
    of the file is the one named). With max_read_bytes (> 0), reading stops after the piece that reaches it."""
    layout, compression = format_of(path) or ("text", None)  # the stdlib corpus's .py files are text
    max_document_bytes = int(max_document_mb * 2**20)
    if layout == "parquet":
        yield from _parquet_pieces(path, text_field, max_document_bytes=max_document_bytes, skip_long=skip_long)
        return
    size = min(TXT_DOCUMENT_BYTES if layout == "text" else piece_bytes, max_document_bytes)
    line_number, name = 1, shown(path)  # name: as error lines name the file

    def long_line() -> str:
        problem = f"{name} line {line_number}: a record of more than data.max_document_mb={max_document_mb:g} MB"
        if not skip_long:
            raise _LongRecord(problem)
        return problem

    with open_input(path) as raw:
        stream = _decompressed(raw, compression, path)
        lines = _cut_after_lines(stream, size, path=path, compression=compression, max_line=max_document_bytes,
                                 cut_long=layout == "text", limit=max_read_bytes, on_long_line=long_line)
        try:
            for data in lines:
                if isinstance(data, tuple):
                    problem, num_bytes = data
                    yield Piece("too_long", name, problem, line_number, num_bytes, raw.tell())
                    line_number += 1
                    continue
                yield Piece(layout, name, data, line_number, len(data), raw.tell())
                line_number += data.count(b"\n")
        except _LongRecord as stop:
            yield Piece("too_long", name, str(stop), line_number, 0, raw.tell())


class _LongRecord(Exception):
    """Stops reading a file at a record over the document bound that is an error (data.on_bad_record)."""


class _Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


def _decompressed(raw: BinaryIO, compression: str | None, path: InputFile) -> _Readable:
    if compression == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zst":
        return _ZstdFrames(raw, optional_import("zstandard", "zstandard", path))
    return raw


class _ZstdFrames:
    """A readable stream of zstd frames written back to back, whose reads return at most `size` bytes.

    zstandard's own stream_reader ends quietly at a truncated frame (this raises EOFError there), and its decompressobj
    returns everything a block of input holds: a zstd block of a few bytes can stand for 128 KB, so input is fed
    ZSTD_FEED_BYTES at a time, which bounds what one call can give to about ZSTD_FEED_BYTES / 4 blocks."""

    def __init__(self, raw: BinaryIO, zstandard):
        self.raw = raw
        self.zstd = zstandard.ZstdDecompressor()
        self.frame: Any = None  # the decompressor of the current frame (zstandard has no type hints)
        self.pending = b""  # compressed input read from the file, fed from self.fed on
        self.fed = 0
        self.out = bytearray()  # decompressed output not yet returned

    def read(self, size: int) -> bytes:
        while len(self.out) < size and self._feed():
            pass
        data = bytes(self.out[:size])
        del self.out[:size]
        return data

    def _feed(self) -> bool:
        """Decompress the next few bytes of input into self.out; False at the end of the input."""
        if self.fed == len(self.pending):
            self.pending, self.fed = self.raw.read(READ_BLOCK_BYTES), 0
            if not self.pending:
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("the last zstd frame ends early")
                return False
        block = self.pending[self.fed : self.fed + ZSTD_FEED_BYTES]
        self.fed += len(block)
        while block:
            if self.frame is None or self.frame.eof:
                self.frame = self.zstd.decompressobj()
            self.out += self.frame.decompress(block)
            block = self.frame.unused_data if self.frame.eof else b""
        return True


def _cut_after_lines(stream: _Readable, size: int, *, path: InputFile, compression: str | None, max_line: int,
                     cut_long: bool, limit: int, on_long_line: Callable[[], str]) -> Iterator[bytes | tuple[str, int]]:
    """Blocks of whole lines, each cut at the first line end at or after `size` bytes (size <= max_line).

    No more than max_line bytes of one line are ever held: with cut_long a block is cut at max_line (at a UTF-8
    character boundary); else on_long_line() is called (it may raise), the rest of the line is read through and dropped,
    and (on_long_line's message, the line's length) is given in its place. With limit (> 0), reading stops after the
    block that reaches it. Cuts depend only on the content, never on how reads happened to return, so the pieces (and
    everything derived from them) are the same on every run. Only the line across `size` can be longer than max_line, so
    that is the one line checked."""
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
                dropped, rest = _read_past_line_end(stream, path, compression, dropped=dropped,
                                                    until=limit - done - line_start if limit else None)
                buffer += rest
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


def _read_past_line_end(stream: _Readable, path: InputFile, compression: str | None, *, dropped: int,
                        until: int | None) -> tuple[int, bytes]:
    """Reads through the end of a line of which `dropped` bytes are already gone, holding one block at a
    time: (the line's bytes dropped in all, what the last block held after the line end). Stops early at
    the end of the stream, or once `until` bytes of the line are dropped (the reading limit)."""
    while until is None or dropped < until:
        block = _read_block(stream, path, compression)
        if (newline := block.find(b"\n")) >= 0 or not block:
            return dropped + newline + 1, block[newline + 1 :]
        dropped += len(block)
    return dropped, b""


def _utf8_boundary(data: bytearray, position: int) -> int:
    """The cut at or up to 3 bytes before position that does not split a UTF-8 character (position itself
    in text that is not UTF-8 there, which decoding reports)."""
    for cut in range(position, max(position - 4, 0), -1):
        if data[cut] & 0xC0 != 0x80:
            return cut
    return position


def _read_block(stream: _Readable, path: InputFile, compression: str | None) -> bytes:
    try:
        return stream.read(READ_BLOCK_BYTES)
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        if compression is None:
            raise DataError(f"cannot read {shown(path)}: {first_line(err)}") from None
        kind = {"gz": "gzip", "zst": "zstd"}[compression]
        raise DataError(f"{shown(path)}: corrupt or truncated {kind} file ({first_line(err)})") from None
    except Exception as err:
        if type(err).__name__ == "ZstdError":  # zstandard's own error type, without importing it here
            raise DataError(f"{shown(path)}: corrupt or truncated zstd file ({first_line(err)})") from None
        raise


def _parquet_pieces(path: InputFile, field: str, *, max_document_bytes: int, skip_long: bool) -> Iterator[Piece]:
    """The text column, row group after row group. What a row group's pages hold is checked in their headers
    first (see _largest_page): a row group whose largest page could hold a value past the document bound is
    a bad record as a whole, never decoded, and batches have as few rows as keeps them to PARQUET_BATCH_BYTES."""
    with open_input(path) as raw, (open_input(path) if isinstance(path, RemoteFile) else nullcontext()) as source:
        parquet, column = _open_parquet(path, field, source)
        num_rows, disk_size, row, name = parquet.metadata.num_rows, input_size(path), 0, shown(path)
        for group in range(parquet.num_row_groups):
            group_rows = parquet.metadata.row_group(group).num_rows
            largest = _largest_page(raw, parquet.metadata.row_group(group).column(column), path, group)
            done = disk_size * (row + group_rows) // max(num_rows, 1)
            if largest > max_document_bytes + PARQUET_PAGE_SLACK:
                problem = (f"{name} rows {row} to {row + group_rows - 1}: a page of {largest / 2**20:.1f} MB in column "
                           f"'{field}' could hold a record of more than data.max_document_mb="
                           f"{max_document_bytes / 2**20:g} MB")
                yield Piece("too_long", name, problem, row, 0, done)
                if not skip_long:  # an error, raised by the worker that reaches it (see read_pieces)
                    return
            else:
                batch_rows = max(1, min(PARQUET_BATCH_ROWS, PARQUET_BATCH_BYTES // max(largest, 1)))
                yield from _row_group_pieces(parquet, group, field, path, batch_rows=batch_rows, first=row, done=done)
            row += group_rows


def _open_parquet(path: InputFile, field: str, source: BinaryIO | None):
    """The ParquetFile (of source, a file object, else of the local path) and the index of its text column, checked."""
    pq = optional_import("pyarrow.parquet", "pyarrow", path)
    import pyarrow as pa

    try:
        parquet = pq.ParquetFile(path if source is None else source)
    except (pa.ArrowException, OSError) as err:  # a damaged footer's message may end in a line break
        raise DataError(f"{shown(path)}: not a readable parquet file ({first_line(err)})") from None
    names = parquet.schema_arrow.names
    if field not in names:
        raise DataError(f"{shown(path)} has no column '{field}' (it has {', '.join(names)}); set data.text_field")
    column_type = parquet.schema_arrow.field(field).type
    if pa.types.is_dictionary(column_type):  # a pandas Categorical: text, each value once in a dictionary
        column_type = column_type.value_type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{shown(path)}: column '{field}' holds {column_type}, not text")
    schema = parquet.metadata.schema
    return parquet, next(i for i in range(len(schema)) if schema.column(i).path == field)


def _row_group_pieces(parquet, group: int, field: str, path: InputFile, *, batch_rows: int, first: int,
                      done: int) -> Iterator[Piece]:
    import pyarrow as pa

    row = first
    try:
        for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=[group], columns=[field]):
            column = batch.column(0)
            if pa.types.is_dictionary(column.type):  # decoded: what is read is the text, as for any string column
                column = column.dictionary_decode()
            yield Piece("rows", shown(path), column, row, column.nbytes, done)
            row += len(column)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{shown(path)} row {row}: cannot read parquet ({first_line(err)})") from None


def _largest_page(raw: BinaryIO, chunk, path: InputFile, group: int) -> int:
    """The largest uncompressed page of a column chunk, read from the page headers alone (the file's metadata
    has only the chunk's total). Every value of the chunk fits in one page: a plain value in its data page, a
    dictionary value in the dictionary page, and a DELTA_BYTE_ARRAY value, built from the suffixes before it
    in its page, is no longer than that page."""
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and chunk.dictionary_page_offset:
        start = min(start, chunk.dictionary_page_offset)
    end, largest = start + chunk.total_compressed_size, 0
    try:
        raw.seek(start)
        while raw.tell() < end:
            header = _ThriftCompact(raw, end).struct()
            uncompressed, compressed = header.get(2, -1), header.get(3, -1)
            if uncompressed < 0 or compressed < 0:
                raise ValueError("a page header without its sizes")
            largest = max(largest, uncompressed)
            raw.seek(compressed, 1)
    except DataError:  # a URL that could not be read: its own line
        raise
    except (ValueError, EOFError, OSError) as err:
        raise DataError(f"{shown(path)}: not a readable parquet file (row group {group}: {first_line(err)})") from None
    return largest


class _ThriftCompact:
    """As much of Thrift's compact protocol as reading a parquet page header's integer fields takes."""

    MAX_DEPTH = 32  # nesting a page header never comes near: deeper is a damaged file, not a recursion

    def __init__(self, raw: BinaryIO, end: int):
        self.raw = raw
        self.end = end  # where the column chunk ends: no length in a header may reach past it

    def struct(self, depth: int = 0) -> dict[int, int]:
        """The struct's integer fields by id; everything else is read past."""
        if depth > self.MAX_DEPTH:
            raise ValueError("page header nested too deeply")
        fields: dict[int, int] = {}
        field = 0
        while (head := self._byte()) != 0:
            delta, kind = head >> 4, head & 0x0F
            field = field + delta if delta else self._zigzag()
            if kind in (4, 5, 6):
                fields[field] = self._zigzag()
            else:
                self._skip(kind, depth, in_collection=False)
        return fields

    def _skip(self, kind: int, depth: int, *, in_collection: bool) -> None:
        if kind in (1, 2):  # a boolean: in its field header, but a byte of its own inside a list or map
            self._read(1 if in_collection else 0)
        elif kind == 3:
            self._read(1)
        elif kind in (4, 5, 6):
            self._varint()
        elif kind == 7:
            self._read(8)
        elif kind == 8:
            self.raw.seek(self._length(), 1)
        elif kind in (9, 10):
            head = self._byte()
            size = head >> 4 if head >> 4 != 15 else self._length()
            for _ in range(size):
                self._skip(head & 0x0F, depth + 1, in_collection=True)
        elif kind == 11:
            size = self._length()
            kinds = self._byte() if size else 0
            for _ in range(size):
                self._skip(kinds >> 4, depth + 1, in_collection=True)
                self._skip(kinds & 0x0F, depth + 1, in_collection=True)
        elif kind == 12:
            self.struct(depth + 1)
        else:
            raise ValueError(f"page header holds an unknown Thrift type {kind}")

    def _read(self, size: int) -> bytes:
        data = self.raw.read(size)
        if len(data) < size:
            raise EOFError("the file ends inside a page header")
        return data

    def _byte(self) -> int:
        return self._read(1)[0]

    def _varint(self) -> int:
        value = shift = 0
        while (byte := self._byte()) & 0x80:
            value |= (byte & 0x7F) << shift
            shift += 7
            if shift > 63:
                raise ValueError("a page header integer of more than 64 bits")
        return value | byte << shift

    def _length(self) -> int:
        """A byte or element count, each at least a byte: at most what is left of the column chunk."""
        if (size := self._varint()) > self.end - self.raw.tell():
            raise ValueError("a page header length runs past its column chunk")
        return size

    def _zigzag(self) -> int:
        value = self._varint()
        return (value >> 1) ^ -(value & 1)


def truncate(piece: Piece, max_bytes: int) -> Piece:
    """The start of a piece holding at least max_bytes: whole lines or rows. A "text" piece is one
    document and is kept whole, as is a "records" piece (its rows have no one size to count)."""
    if piece.num_bytes <= max_bytes or piece.kind in ("text", "too_long", "records"):
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
        except RecursionError:  # json.loads recurses once per nesting level
            bad_record(f"{where}: JSON nested too deeply to read")


def piece_conversations(piece: Piece, *, fields: ChatFields,
                        bad_record: Callable[[str], None]) -> Iterator[tuple[Conversation, bytes]]:
    """data.format=chat: the conversations of a piece of JSON lines, each with its canonical bytes (see
    data/chat.py); a record that is not one is handed to bad_record."""
    if piece.kind == "too_long":
        bad_record(piece.data)
        return
    if piece.kind not in ("jsonl", "records"):
        raise DataError(f"{piece.path}: data.format=chat reads .jsonl files (also .gz, .zst) of conversations")
    records = _jsonl_records(piece, bad_record=bad_record) if piece.kind == "jsonl" else _table_records(piece)
    for where, record in records:
        try:
            messages = conversation(record, fields)
        except BadConversation as err:
            bad_record(f"{where}: {err}")
            continue
        if (utf8 := _utf8(canonical_text(messages), where, bad_record)) is not None:
            yield Conversation(messages, where), utf8


def _table_records(piece: Piece) -> Iterator[tuple[str, dict]]:
    """(where, record) of each row of a "records" piece (a pyarrow table); a null column is a field the row lacks,
    as in a JSON line."""
    for offset, row in enumerate(piece.data.to_pylist()):
        yield f"{piece.path} row {piece.first + offset}", {key: val for key, val in row.items() if val is not None}


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
