"""The corpus readers on hostile input: decompression bombs, special files, links, deep JSON."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, load_config
from data import DataError, PrepareSettings, readers
from data.chat import ChatFields
from data.mixture import BLOCK as MIX_BLOCK, block_slots, source_problems
from tests.helpers import ROOT, failing_after
from tests.test_data import prep

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

BOMB_MB = 128  # what each bomb decompresses to
MiB = 1 << 20

# Reads each file named on the command line as preparation does (pieces, then their documents, with
# data.max_document_mb=1 and data.on_bad_record=skip) and prints, per file, how far the peak resident size
# rose above the resident size before reading it (Linux: writing 5 to clear_refs resets the peak), the
# documents read and the bad records.
READ_FILES = """
import json, re, sys
from pathlib import Path
import pyarrow.parquet  # imported before measuring: the import is no part of reading
from data import readers

def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))

for name in sys.argv[1:]:
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    bad, documents = [], 0
    for piece in readers.read_pieces(Path(name), piece_bytes=1 << 20, text_field="text", max_document_mb=1,
                                     skip_long=True):
        documents += sum(1 for _ in readers.piece_documents(piece, text_field="text", strict=True,
                                                             max_document_mb=1, bad_record=bad.append))
    rise = (status("VmHWM") - before) / 1024
    print(json.dumps({"file": name, "rise_mb": rise, "documents": documents, "bad": bad}), flush=True)
"""


def _zst_bomb(path: Path) -> None:
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as out:
        out.write(b'{"text": "')
        for _ in range(BOMB_MB):
            out.write(b"a" * MiB)
        out.write(b'"}\n{"text": "after"}\n')


def _gz_bomb(path: Path) -> None:
    with gzip.open(path, "wb", compresslevel=1) as out:
        out.write(b'{"text": "')
        for _ in range(BOMB_MB):
            out.write(b"a" * MiB)
        out.write(b'"}\n{"text": "after"}\n')


def _parquet_cell_bomb(path: Path) -> None:
    """One value of BOMB_MB MB between two small ones, in one row group."""
    table = pa.table({"text": ["before", "a" * (BOMB_MB * MiB), "after"]})
    pq.write_table(table, path, compression="zstd", write_statistics=False)  # statistics of it would take seconds


def _parquet_dictionary_bomb(path: Path) -> None:
    """A 2 MB value written once in the dictionary page and referenced by BOMB_MB / 2 rows: small pages,
    but BOMB_MB MB of text once the rows are decoded."""
    rows = pa.DictionaryArray.from_arrays(pa.array([0] * (BOMB_MB // 2), pa.int32()), pa.array(["a" * (2 * MiB)]))
    pq.write_table(pa.table({"text": rows}), path, compression="zstd", store_schema=False)


def _sparse(path: Path, head: bytes) -> None:
    """A file of BOMB_MB MB without a line end (sparse on disk: holes read as zero bytes)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(BOMB_MB * MiB)


BOMBS = {
    "bomb.jsonl.zst": _zst_bomb,
    "bomb.jsonl.gz": _gz_bomb,
    "cell.parquet": _parquet_cell_bomb,
    "dictionary.parquet": _parquet_dictionary_bomb,
    "endless.jsonl": lambda p: _sparse(p, b'{"text": "'),
    "endless.txt": lambda p: _sparse(p, b"text"),
}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures the peak resident size on Linux")
def test_decompression_bombs_are_read_in_bounded_memory(tmp_path):
    for name, write in BOMBS.items():
        write(tmp_path / name)
    assert max((tmp_path / name).stat().st_blocks * 512 for name in BOMBS) < 4 * MiB  # small on disk
    out = subprocess.run([sys.executable, "-c", READ_FILES, *(str(tmp_path / name) for name in BOMBS)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    reports = {Path(r["file"]).name: r for r in map(json.loads, out.stdout.splitlines())}
    assert list(reports) == list(BOMBS)
    for name, report in reports.items():
        # Bounded by the settings, never by the bomb's size: pieces and documents of 1 MB, zstd's window, and
        # parquet batches of 16 MB (PARQUET_BATCH_BYTES), which pyarrow and the worker's Python strings hold
        # a few times over while decoding.
        assert report["rise_mb"] < 100, (name, report["rise_mb"])
    for name in ("bomb.jsonl.zst", "bomb.jsonl.gz"):  # the long line skipped, the next one read
        assert reports[name]["documents"] == 1
        assert reports[name]["bad"] == [f"{tmp_path / name} line 1: a record of more than data.max_document_mb=1 MB"]
    assert reports["cell.parquet"]["documents"] == 0
    assert reports["cell.parquet"]["bad"] == [
        f"{tmp_path / 'cell.parquet'} rows 0 to 2: a page of {BOMB_MB:.1f} MB in column 'text' could hold a record "
        f"of more than data.max_document_mb=1 MB"]
    assert reports["dictionary.parquet"]["documents"] == 0
    assert len(reports["dictionary.parquet"]["bad"]) == BOMB_MB // 2  # each row: a record of 2 MB
    assert reports["endless.jsonl"]["documents"] == 0 and len(reports["endless.jsonl"]["bad"]) == 1
    assert reports["endless.txt"]["documents"] == BOMB_MB  # cut into documents of 1 MB


def test_a_parquet_page_past_the_document_bound_is_a_bad_record_naming_the_rows(tmp_path):
    path = tmp_path / "c.parquet"
    big = "b" * (17 * MiB)  # past the document bound of 0.5 MB plus PARQUET_PAGE_SLACK
    pq.write_table(pa.table({"text": ["one", "two", big, "four", "five", "six"]}), path, row_group_size=3)
    with pytest.raises(DataError) as caught:
        prep(tmp_path, [str(path)], max_document_mb=0.5, num_workers=0)
    assert str(caught.value) == (f"{path} rows 0 to 2: a page of 17.0 MB in column 'text' could hold a record of "
                                 f"more than data.max_document_mb=0.5 MB (data.on_bad_record=skip skips such records)")
    pieces = list(readers.read_pieces(path, piece_bytes=MiB, text_field="text", max_document_mb=0.5, skip_long=True))
    assert [p.kind for p in pieces] == ["too_long", "rows"]
    assert pieces[1].first == 3 and pieces[1].data.to_pylist() == ["four", "five", "six"]


def test_the_first_bad_record_is_the_one_named(tmp_path, monkeypatch):
    """A record over the document bound is an error in its place: the worker process that reaches it says
    so, after the records before it, even while the reading process is many chunks ahead."""
    monkeypatch.setattr("data.prepare.CHUNK_BYTES", 4096)
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 8}) for i in range(3000)]
    lines[1] = "{not json"
    lines[80] = json.dumps({"text": "z" * 3000})  # two chunks on: within what the reading process reads ahead
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as caught:
        prep(tmp_path, [str(path)], max_document_mb=2000 / MiB, num_workers=1)
    assert str(caught.value).startswith(f"{path} line 2: invalid JSON")


@pytest.mark.parametrize("options", [{}, {"use_dictionary": False, "data_page_size": 4096},
                                     {"use_dictionary": False, "column_encoding": {"text": "DELTA_BYTE_ARRAY"}},
                                     {"data_page_version": "2.0", "compression": "zstd"}])
def test_parquet_pages_are_measured_in_every_layout(options, tmp_path):
    """The page headers are read for every encoding and page version pyarrow writes; the largest page bounds
    the batch, and every row comes through once, in order."""
    documents = [f"document {i} " * (1 + i % 40) for i in range(3000)]
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": list(range(len(documents))), "text": documents}), path, row_group_size=1000,
                   **options)
    pieces = list(readers.read_pieces(path, piece_bytes=MiB, text_field="text", max_document_mb=1, skip_long=False))
    assert [text for p in pieces for text in p.data.to_pylist()] == documents
    assert [p.first for p in pieces] == [sum(len(q.data) for q in pieces[:i]) for i in range(len(pieces))]


# ---------------------------------------------------------------- what a file reads as, against its size on disk


def _dictionary_rows(path: Path, *, num_rows: int, value_mb: float) -> None:
    """One value of value_mb MB in the dictionary page, referenced by num_rows rows; without pyarrow's own schema,
    so the column reads as plain text."""
    rows = pa.DictionaryArray.from_arrays(pa.array([0] * num_rows, pa.int32()), pa.array(["x" * int(value_mb * MiB)]))
    pq.write_table(pa.table({"text": rows}), path, compression="zstd", store_schema=False)


def _short_lines_zst(path: Path, num_mb: int) -> None:
    """num_mb MB of one short JSON line repeated: every record a fine one, the file a few KB."""
    line = json.dumps({"text": "the same short document"}).encode() + b"\n"
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as out:
        out.write(line * (num_mb * MiB // len(line)))


def test_a_parquet_dictionary_bomb_is_one_line_naming_it(tmp_path):
    # The attack: 100,000 rows that all reference one 4 MB dictionary value, in a file of under 1 KB: 400 GB of
    # text to decode and tokenise, 4 rows (16 MB) at a time, in bounded memory, "forever".
    path = tmp_path / "bomb.parquet"
    _dictionary_rows(path, num_rows=100_000, value_mb=4)
    size = path.stat().st_size
    assert size < 1024
    with pytest.raises(DataError) as caught, failing_after(120):
        prep(tmp_path, [str(path)], num_workers=0)
    assert str(caught.value) == (
        f"{path} reads as more than 100 times its {size:,} bytes on disk (a compression bomb? a parquet dictionary "
        f"value repeated row after row, a compressed run of one byte): refused; to read it anyway, set "
        f"data.max_corpus_mb to bound what is read")
    assert not (tmp_path / "prepared" / "meta.json").exists()


def test_a_zstd_file_of_fine_short_lines_past_the_bound_is_refused_unless_max_corpus_mb_bounds_it(tmp_path,
                                                                                                 monkeypatch):
    # Every line is a good record, so no document bound applies: only what the file reads as in all.
    monkeypatch.setattr("data.prepare.EXPANSION_FLOOR_BYTES", MiB)  # instead of 16 MB: a test of seconds
    path = tmp_path / "c.jsonl.zst"
    _short_lines_zst(path, 4)
    assert path.stat().st_size * 100 < MiB  # so the floor decides: refused past the first 1 MB
    with pytest.raises(DataError, match=rf"^{path} reads as more than 100 times its \S+ bytes on disk"):
        prep(tmp_path, [str(path)], num_workers=0, dataset_dir=tmp_path / "refused")
    # data.max_corpus_mb bounds what is read: then the file is read up to it (the first line that reaches 2 MB).
    from tests.test_data import make_documents

    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in make_documents(200)))
    tokenizer = prep(tmp_path, [str(tmp_path / "t.jsonl")], num_workers=0, dataset_dir=tmp_path / "t").tokenizer_path
    prepared = prep(tmp_path, [str(path)], num_workers=0, max_corpus_mb=2, dataset_dir=tmp_path / "bounded",
                    tokenizer_model=str(tokenizer))
    meta = json.loads((prepared.root / "meta.json").read_text())
    line = len(json.dumps({"text": "the same short document"})) + 1
    assert 2 * MiB <= (meta["num_train_documents"] + meta["num_val_documents"]) * line < 2 * MiB + line

def test_a_training_job_prepares_no_more_text_than_max_in_job_mb(tmp_path):
    # 2 MB of ordinary text in a .jsonl.gz of under 1 MB: within data.max_in_job_mb=1 on disk, past it as text.
    from data import prepare_for_training
    from tests.test_data import make_documents

    path = tmp_path / "c.jsonl.gz"
    documents = make_documents(12_000, seed=1)
    with gzip.open(path, "wt") as out:
        out.writelines(json.dumps({"text": text}) + "\n" for text in documents)
    assert path.stat().st_size < MiB and sum(len(json.dumps({"text": t})) + 1 for t in documents) > 2 * MiB
    settings = PrepareSettings(files=(str(path),), vocab_size=320, num_workers=0)
    with pytest.raises(DataError) as caught:
        prepare_for_training(tmp_path / "job", settings, named_dir=False, max_input_mb=1)
    assert str(caught.value) == (
        f"{path}: the corpus reads as more than data.max_in_job_mb=1 MB of text ({path.stat().st_size / MiB:,.1f} MB "
        f"on disk), more than a training job prepares itself: prepare it first with `python scripts/prepare_data.py "
        f"CONFIG --data.dataset_dir=DIR`, then train with --data.dataset_dir=DIR")
    assert not (tmp_path / "job" / "meta.json").exists()
    prepare_for_training(tmp_path / "job", settings, named_dir=False, max_input_mb=3)  # within 3 MB: prepared
    assert (tmp_path / "job" / "meta.json").exists()
    # data.max_corpus_mb=1 stops reading at the line that reaches 1 MB, within data.max_in_job_mb=1: prepared.
    capped = PrepareSettings(files=(str(path),), vocab_size=320, num_workers=0, max_corpus_mb=1)
    prepare_for_training(tmp_path / "capped", capped, named_dir=False, max_input_mb=1)
    assert json.loads((tmp_path / "capped" / "meta.json").read_text())["text_bytes"] < MiB


# ---------------------------------------------------------------- which files are read


def test_only_regular_files_are_read(tmp_path):
    (tmp_path / "ok.jsonl").write_text('{"text": "x"}\n')
    os.mkfifo(tmp_path / "pipe.jsonl")
    (tmp_path / "device.jsonl").symlink_to("/dev/zero")
    for entry in ("pipe.jsonl", "device.jsonl"):
        with pytest.raises(DataError) as caught:
            readers.expand_inputs([str(tmp_path / entry)])
        assert str(caught.value) == (f"data file {tmp_path / entry} is not a regular file (a FIFO, device or socket): "
                                     f"data.files takes files, folders and globs of them")
    for entry in (str(tmp_path), str(tmp_path / "*.jsonl"), str(tmp_path / "**")):  # found by a folder or a glob
        with pytest.raises(DataError, match=r"device\.jsonl is not a regular file"):
            readers.expand_inputs([entry])
    (tmp_path / "device.jsonl").unlink()
    with pytest.raises(DataError, match=r"pipe\.jsonl is not a regular file"):
        readers.expand_inputs([str(tmp_path)])
    (tmp_path / "pipe.jsonl").unlink()
    (tmp_path / "folder.jsonl").mkdir()  # a folder whose name looks like a file is not one
    assert readers.expand_inputs([str(tmp_path / "*.jsonl")]) == [tmp_path / "ok.jsonl"]


def test_each_file_is_read_once_and_link_loops_are_not_followed(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "a" / "x.jsonl").write_text('{"text": "x"}\n')
    (corpus / "b.jsonl").write_text('{"text": "b"}\n')
    (corpus / "a" / "up").symlink_to("..")  # a loop: corpus/a/up/a/up/...
    (corpus / "link-to-b.jsonl").symlink_to("b.jsonl")  # after b.jsonl in sorted order: b.jsonl is kept
    expected = [corpus / "a" / "x.jsonl", corpus / "b.jsonl"]
    assert readers.expand_inputs([str(corpus / "**" / "*.jsonl")]) == expected
    assert readers.expand_inputs([str(corpus)]) == expected
    assert readers.expand_inputs([str(corpus / "b.jsonl"), str(corpus), str(corpus / "*.jsonl")]) == [
        corpus / "b.jsonl", corpus / "a" / "x.jsonl"]


# ---------------------------------------------------------------- settings


def test_a_document_bound_below_one_byte_is_refused(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["--data.max_document_mb=1e-7"])
    assert caught.value.problems == ["data.max_document_mb must be at least one byte (9.54e-07 MB), got 1e-07"]
    with pytest.raises(DataError, match=r"^data.max_document_mb must be at least one byte \(9.54e-07 MB\), got 1e-07$"):
        prep(tmp_path, [str(tmp_path / "c.jsonl")], max_document_mb=1e-7)
    load_config(None, [f"--data.max_document_mb={1 / 2**20}"])  # one byte is a bound


def test_worker_processes_are_at_most_the_usable_cpus():
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert PrepareSettings(num_workers=100_000).processes(1 << 30) == cpus
    assert PrepareSettings(num_workers=1).processes(1 << 30) == 1
    assert PrepareSettings().processes(1 << 30) == cpus


def test_weights_whose_sum_overflows_are_relative_weights_like_any(tmp_path):
    assert block_slots([1e308, 1e308]) == [MIX_BLOCK // 2, MIX_BLOCK // 2]
    assert block_slots([1.5e308, 1e308, 1e308, 0.5e308]) == block_slots([3, 2, 2, 1])
    assert block_slots([1e308, 1e-10]) == [MIX_BLOCK, 0]  # a share too small for a slot, said by the config check
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps({"format": "text", "tokenizer_sha256": "t", "vocab_size": 320,
                                                      "dtype": "uint16"}))
    assert source_problems([(str(folders[0]), 1e308), (str(folders[1]), 1e308)]) == []


# ---------------------------------------------------------------- records


def test_json_nested_too_deeply_is_a_bad_record(tmp_path):
    lines = b'{"text": "before"}\n' + b"[" * 100_000 + b"\n" + b'{"text": "after"}\n'
    piece = readers.Piece("jsonl", "c.jsonl", lines, 1, len(lines), len(lines))
    bad: list[str] = []
    documents = list(readers.piece_documents(piece, text_field="text", strict=True, max_document_mb=1,
                                             bad_record=bad.append))
    assert [text for text, _ in documents] == ["before", "after"]
    assert bad == ["c.jsonl line 2: JSON nested too deeply to read"]
    assert list(readers.piece_conversations(piece, fields=ChatFields(), bad_record=bad.append)) == []
    assert bad[1:] == ["c.jsonl line 1: expected a list 'messages', or string fields 'prompt' and 'response'",
                       "c.jsonl line 2: JSON nested too deeply to read",
                       "c.jsonl line 3: expected a list 'messages', or string fields 'prompt' and 'response'"]


# ---------------------------------------------------------------- parquet footers, dictionary columns, file names


@pytest.mark.parametrize("damage", ["magic", "footer length", "footer"])
def test_a_parquet_file_with_a_damaged_footer_is_one_line(tmp_path, damage):
    """pyarrow's message for a footer that does not deserialize ends in a line break: it made two lines."""
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["some text"] * 50}), path)
    data = path.read_bytes()
    path.write_bytes({"magic": data[:-4] + b"XXXX", "footer length": data[:-8] + b"\xff\xff\x00\x00PAR1",
                      "footer": data[:-40] + b"\x07" * 32 + data[-8:]}[damage])
    with pytest.raises(DataError) as caught:
        list(readers.read_pieces(path, piece_bytes=MiB, text_field="text", max_document_mb=1, skip_long=True))
    assert str(caught.value).startswith(f"{path}: not a readable parquet file (") and "\n" not in str(caught.value)
    assert str(caught.value).endswith(")")


def test_a_dictionary_text_column_is_read_as_its_text(tmp_path):
    """A pandas Categorical saves as parquet dictionary<values=string>: text, each distinct value once. It was
    refused as "not text"; its documents are those of the same column saved as plain strings."""
    texts = [f"document {i % 7} of the corpus, said again" for i in range(300)]
    plain, categorical = tmp_path / "plain.parquet", tmp_path / "categorical.parquet"
    pq.write_table(pa.table({"text": texts}), plain)
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), categorical)
    assert pa.types.is_dictionary(pq.ParquetFile(categorical).schema_arrow.field("text").type)  # the premise

    def documents(path: Path) -> list[str]:
        out = []
        for piece in readers.read_pieces(path, piece_bytes=MiB, text_field="text", max_document_mb=1, skip_long=True):
            out += [text for text, _ in readers.piece_documents(piece, text_field="text", strict=True,
                                                                max_document_mb=1, bad_record=pytest.fail)]
        return out

    assert documents(categorical) == documents(plain) == texts
    assert prep(tmp_path, [str(categorical)], dataset_dir=tmp_path / "a").num_train_tokens == prep(
        tmp_path, [str(plain)], dataset_dir=tmp_path / "b").num_train_tokens > 0


def test_a_line_break_in_a_file_name_cannot_split_or_forge_an_error_line(tmp_path):
    """A data file named 'x\\nerror: forged' gave an error line that ended at its name, and a second that looked
    like the project's own. Names that do not print as they are are quoted as Python writes a string."""
    path = tmp_path / "bad\nerror: all checkpoints deleted\n.jsonl"
    path.write_text('{"text": "fine"}\n{"no text": 1}\n')
    with pytest.raises(DataError) as caught:
        prep(tmp_path, [str(path)], on_bad_record="error")
    assert str(caught.value).startswith(repr(str(path)) + " line 2: ") and "\n" not in str(caught.value), caught.value
    with pytest.raises(DataError) as caught:
        readers.expand_inputs([str(tmp_path / "gone\n.jsonl")])
    assert str(caught.value) == "data file not found: " + repr(str(tmp_path / "gone\n.jsonl"))
