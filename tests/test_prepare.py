"""The streaming preparation: formats, worker count, resuming, the tokenizer sample, caps, bad input, and
the rules of in-job preparation. Small generated corpora; the workers are real spawned processes."""
from __future__ import annotations

import gzip
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from config import ConfigError, load_config
from data import (
    DataError,
    PrepareSettings,
    default_dataset_dir,
    handoff,
    load_prepared,
    prepare_data,
    prepare_for_training,
    readers,
)
from data.prepare import Corpus, Source, python_source_files, stdlib_source_files
from data.settings import HFDatasetConfig
from data.store import ShardWriter, read_record
from data.tokenizer import TokenizerSample
from fsdp_utils.train.run_data import prepare_settings
from safe_io import nofollow
from tests.helpers import ROOT, alive, children, job_env, run_job
from tests.test_data import VOCAB_SIZE, decode_split, held_out, make_documents, prep, split_tokens

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

# Documents with what breaks readers: non-ASCII, blank lines inside, tabs, a one-character document.
DOCUMENTS = make_documents(60, seed=2) + ["ünïcödé ✓ 日本語\n\n\tindented\n", "x"]


def jsonl_lines(documents: list[str], field: str = "text") -> str:
    return "".join(json.dumps({field: text, "id": i}) + "\n" for i, text in enumerate(documents))


def write_format(folder: Path, kind: str, documents: list[str] = DOCUMENTS) -> list[str]:
    """The documents in one format; returns the data.files entries naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    half = len(documents) // 2
    if kind == "jsonl":
        (folder / "c.jsonl").write_text(jsonl_lines(documents))
    elif kind == "json.gz":
        with gzip.open(folder / "c.json.gz", "wt") as f:
            f.write(jsonl_lines(documents))
    elif kind == "jsonl.zst":
        # Two zstd frames back to back, as streaming compressors write them.
        frames = [zstandard.ZstdCompressor().compress(jsonl_lines(part).encode())
                  for part in (documents[:half], documents[half:])]
        (folder / "c.jsonl.zst").write_bytes(b"".join(frames))
    elif kind == "parquet":
        table = pa.table({"id": list(range(len(documents))), "body": documents})
        pq.write_table(table, folder / "c.parquet", row_group_size=7)
    elif kind == "txt folder":
        for i, text in enumerate(documents):
            (folder / f"doc{i:03d}.txt").write_text(text)
    elif kind == "glob of parts":
        with gzip.open(folder / "part-0.jsonl.gz", "wt") as f:
            f.write(jsonl_lines(documents[:half]))
        with gzip.open(folder / "part-1.jsonl.gz", "wt") as f:
            f.write(jsonl_lines(documents[half:]))
        (folder / "notes.md").write_text("not data")
        return [str(folder / "part-*.jsonl.gz")]
    return [str(folder)]


def store_files(prepared) -> dict[str, bytes]:
    """Every file the training reads, by name: the tokenizer and each shard."""
    files = [prepared.tokenizer_path, *prepared.train_files, *prepared.val_files]
    return {path.name: path.read_bytes() for path in files}


# ---------------------------------------------------------------- formats


@pytest.fixture(scope="module")
def jsonl_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("jsonl")
    return prep(root, write_format(root / "in", "jsonl"))


@pytest.mark.parametrize("kind", ["json.gz", "jsonl.zst", "parquet", "txt folder", "glob of parts"])
@pytest.mark.slow
def test_every_format_gives_the_tokens_of_the_plain_jsonl(kind, jsonl_reference, tmp_path):
    extra = {"text_field": "body"} if kind == "parquet" else {}
    prepared = prep(tmp_path, write_format(tmp_path / "in", kind), **extra)
    assert store_files(prepared) == store_files(jsonl_reference)
    # And the reference holds what it should: every document, whole, in order within its split.
    assert sorted(decode_split(jsonl_reference, "train") + decode_split(jsonl_reference, "val")) == sorted(DOCUMENTS)


@pytest.mark.parametrize("kind", ["jsonl", "json.gz", "jsonl.zst"])
def test_pieces_do_not_depend_on_read_sizes(kind, tmp_path, monkeypatch):
    # Cut at the first line end past 500 bytes, whatever sizes reads return; a 2 KB line stays whole.
    documents = DOCUMENTS[:20] + ["y" * 2000] + DOCUMENTS[20:40]
    (path,) = write_format(tmp_path, kind, documents)
    path = next(Path(path).iterdir())

    def pieces(block_bytes: int, max_line: int = 1 << 20) -> list[tuple[int, bytes]]:
        monkeypatch.setattr(readers, "READ_BLOCK_BYTES", block_bytes)
        return [(piece.first, piece.data) for piece in readers.read_pieces(
            path, piece_bytes=500, text_field="text", max_document_mb=max_line / 2**20, skip_long=True)]

    expected = pieces(1 << 20)
    assert pieces(7) == pieces(499) == expected
    lines = b"".join(data for _, data in expected).split(b"\n")[:-1]
    assert [json.loads(line)["text"] for line in lines] == documents
    assert all(len(data) >= 500 and data.endswith(b"\n") for _, data in expected[:-1])
    assert [first for first, _ in expected] == [1 + sum(data.count(b"\n") for _, data in expected[:i])
                                                for i in range(len(expected))]
    assert any(len(data) > 2000 for _, data in expected)
    # With a 1,500-byte limit the 2 KB line (line 21) is dropped in place, the same for any read size.
    short = pieces(1 << 20, max_line=1500)
    assert pieces(7, max_line=1500) == pieces(499, max_line=1500) == short
    dropped = [(first, data) for first, data in short if isinstance(data, str)]
    assert dropped == [(21, f"{path} line 21: a record of more than data.max_document_mb={1500 / 2**20:g} MB")]
    kept = b"".join(data for _, data in short if isinstance(data, bytes)).split(b"\n")[:-1]
    assert [json.loads(line)["text"] for line in kept] == documents[:20] + documents[21:]


def test_jsonl_text_field(tmp_path, jsonl_reference):
    (tmp_path / "c.jsonl").write_text(jsonl_lines(DOCUMENTS, field="content"))
    prepared = prep(tmp_path, [str(tmp_path / "c.jsonl")], text_field="content")
    assert store_files(prepared) == store_files(jsonl_reference)


# ---------------------------------------------------------------- workers, shards, resuming


@pytest.fixture
def small_chunks(monkeypatch):
    """Work units of 4 KB: the 2 MB corpus below becomes ~500 chunks and, at 20k tokens, ~25 shards."""
    monkeypatch.setattr("data.prepare.CHUNK_BYTES", 4096)


@contextmanager
def stopped_after(num_shards: int) -> Iterator[None]:
    """A preparation inside stops with KeyboardInterrupt, as at Ctrl-C, once num_shards shards are finished."""
    finish_shard = ShardWriter.finish_shard

    def stop(self, **kwargs):
        if len(self.shards) == num_shards:
            raise KeyboardInterrupt
        finish_shard(self, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ShardWriter, "finish_shard", stop)
        with pytest.raises(KeyboardInterrupt):
            yield


@pytest.fixture(scope="module")
def corpus_2mb(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    path.write_text(jsonl_lines(make_documents(8000, seed=5)))
    return path


@pytest.mark.parametrize("change", [{"text_field": "body"}, {"max_document_mb": 1.0}, {"on_bad_record": "skip"},
                                    {"shard_tokens": 1000}])
def test_settings_that_change_the_output_get_their_own_default_folder(change):
    base = PrepareSettings(files=("corpus.jsonl",), vocab_size=320)
    changed = PrepareSettings(**{**vars(base), **change})
    assert default_dataset_dir(changed) != default_dataset_dir(base)
    assert default_dataset_dir(PrepareSettings(**{**vars(base), **change})) == default_dataset_dir(changed)
    assert default_dataset_dir(PrepareSettings(**{**vars(base), "num_workers": 3})) == default_dataset_dir(base)


def test_default_folders_of_default_settings_keep_their_names():
    """The names given before data.text_field, max_document_mb, on_bad_record and shard_tokens were part of them."""
    assert default_dataset_dir(PrepareSettings()) == "data/cache/stdlib-a1fce57cb6"
    assert default_dataset_dir(PrepareSettings(files=("a.jsonl",), text_field="text", max_document_mb=64,
                                               on_bad_record="error", shard_tokens=100_000_000)) == \
        "data/cache/custom-cd0367a213"
    assert default_dataset_dir(PrepareSettings(files=("a.jsonl",), vocab_size=320, format="chat")) == \
        "data/cache/custom-7c809fffea"


# The identity of a prepared folder for the settings a config gives (the overrides): its record in meta.json, its
# folder under data/cache when data.dataset_dir is empty, and the fingerprint of those settings over no input file.
# A change to any of them prepares every existing folder again.
IDENTITIES = [
    ([], '{"files": null, "tokenizer_model": "", "hf_tokenizer": "", "vocab_size": 4096, "val_fraction": 0.02, '
         '"max_corpus_mb": 0.0, "max_document_mb": 64.0, "seed": 1234, "text_field": "text", "on_bad_record": "error", '
         '"shard_tokens": 100000000, "num_workers": null}',
     "data/cache/stdlib-a1fce57cb6", "398d99dbea39d83bb6a9cc7fb1440b9caa6447b17a76fffe64068051fcb4f158"),
    (["--data.files=[a.jsonl,b.txt]", "--data.format=chat", "--data.chat_template=plain", "--data.max_corpus_mb=3",
      "--run.seed=7", "--data.vocab_size=320", "--data.shard_tokens=1000", "--data.text_field=body",
      "--data.num_workers=3"],
     '{"files": null, "tokenizer_model": "", "hf_tokenizer": "", "vocab_size": 320, "val_fraction": 0.02, '
     '"max_corpus_mb": 3.0, "max_document_mb": 64.0, "seed": 7, "text_field": "body", "on_bad_record": "error", '
     '"shard_tokens": 1000, "num_workers": null, "format": "chat", "messages_field": "messages", "prompt_field": '
     '"prompt", "response_field": "response", "chat_template": "plain"}',
     "data/cache/custom-c2e64e2655", "0b138ee854de77201ad2f26f9c7effc8d147dd633b51a35ee02a45d9670c4558"),
    (["--data.hf_dataset.path=org/ds", "--data.hf_dataset.name=cfg", "--data.hf_dataset.split=val",
      "--data.hf_dataset.streaming=false", "--data.on_bad_record=skip", "--data.max_document_mb=2",
      "--data.remote_timeout_s=5"],
     '{"files": null, "tokenizer_model": "", "hf_tokenizer": "", "vocab_size": 4096, "val_fraction": 0.02, '
     '"max_corpus_mb": 0.0, "max_document_mb": 2.0, "seed": 1234, "text_field": "text", "on_bad_record": "skip", '
     '"shard_tokens": 100000000, "num_workers": null, "hf_dataset": {"path": "org/ds", "name": "cfg", "split": "val"}}',
     "data/cache/custom-14efe44059", "76f492fde0521099e16ce76bc92df17d8836f022f113ca3f5a10c331b9496e75"),
    (["--data.builtin_corpus=python", "--data.max_corpus_mb=100"],
     '{"files": null, "tokenizer_model": "", "hf_tokenizer": "", "vocab_size": 4096, "val_fraction": 0.02, '
     '"max_corpus_mb": 100.0, "max_document_mb": 64.0, "seed": 1234, "text_field": "text", "on_bad_record": "error", '
     '"shard_tokens": 100000000, "num_workers": null, "builtin_corpus": "python"}',
     "data/cache/python-8d72248148", "a66e0146eb4fa129e2627a2ac11c59b9310c02f53140a797552126afafafbbcc"),
]


@pytest.mark.parametrize(("overrides", "record", "folder", "fingerprint"), IDENTITIES,
                         ids=["default", "chat", "hf", "python"])
def test_the_identity_of_a_prepared_folder_is_unchanged(overrides, record, folder, fingerprint):
    settings = prepare_settings(load_config(None, overrides))  # as train_fsdp.py and scripts/prepare_data.py make them
    no_files = Corpus([], "no files", strict=True, max_mb=settings.max_corpus_mb,
                      max_document_mb=settings.max_document_mb)
    assert json.dumps(settings.record()) == record
    assert default_dataset_dir(settings) == settings.folder == folder
    assert Source.of(settings, no_files).fingerprint == fingerprint
    if not overrides:  # the library's own defaults are the config's
        assert PrepareSettings().record() == settings.record()


def test_the_python_corpus_is_capped_by_max_corpus_mb_into_a_folder_of_its_own(tmp_path, caplog):
    common = dict(vocab_size=512, val_fraction=0.1, max_corpus_mb=0.2, num_workers=0)
    stdlib_settings, python_settings = PrepareSettings(**common), PrepareSettings(**common, builtin_corpus="python")
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        stdlib = prepare_data(tmp_path / "stdlib", stdlib_settings, show_progress=False)
        python = prepare_data(tmp_path / "python", python_settings, show_progress=False)
    files = python_source_files()
    megabytes = sum(path.stat().st_size for path in files) / 2**20
    assert (f"preparing the Python sources of the stdlib and the installed packages ({len(files):,} .py files, "
            f"{megabytes:,.1f} MB) into {tmp_path / 'python'}") in caplog.text
    assert f"preparing the Python stdlib ({len(stdlib_source_files()):,} .py files, " in caplog.text
    assert caplog.text.count("data.max_corpus_mb=0.2: read the first") == 2
    metas = [read_record(prepared.root / "meta.json") for prepared in (stdlib, python)]
    # Reading stops after the .py file (a document of at most TXT_DOCUMENT_BYTES) that reaches the cap.
    assert all(0.2 * 2**20 <= meta["text_bytes"] <= 0.2 * 2**20 + readers.TXT_DOCUMENT_BYTES for meta in metas)
    assert python.num_train_tokens > 10_000
    assert [meta["inputs"] for meta in metas] == ["python-stdlib", "python-stdlib-and-packages"]
    assert metas[0]["source_fingerprint"] != metas[1]["source_fingerprint"]
    assert default_dataset_dir(stdlib_settings).startswith("data/cache/stdlib-")
    assert default_dataset_dir(python_settings).startswith("data/cache/python-")
    python_source = Source.of(python_settings, Corpus.of(python_settings))
    assert python_source.difference(metas[0]).startswith("data.builtin_corpus 'stdlib' there, 'python' here; other "
                                                         "input files")
    assert python_source.difference(metas[1]) == "the same inputs and settings"


def test_the_built_in_corpus_is_chosen_only_without_a_corpus_named(tmp_path):
    line = ("data.builtin_corpus=python is the corpus only when data.files, data.sources and data.hf_dataset.path are "
            "empty: leave it at stdlib, or empty them")
    for named in ("--data.files=[c.jsonl]", "--data.hf_dataset.path=org/ds"):
        with pytest.raises(ConfigError) as caught:
            load_config(None, [named, "--data.builtin_corpus=python"])
        assert caught.value.problems == [line]
    with pytest.raises(DataError, match=re.escape(line)):
        prepare_data(tmp_path / "out", PrepareSettings(files=("c.jsonl",), builtin_corpus="python"),
                     show_progress=False)
    assert not (tmp_path / "out").exists()


def test_the_tokenizer_folder_is_data_hf_tokenizer_else_model_hf_path(tmp_path):
    model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
    model.mkdir()
    tokenizer.mkdir()
    hf_model = ["--model.type=hf", f"--model.hf_path={model}"]

    def recorded(*overrides: str) -> str:
        return prepare_settings(load_config(None, [*hf_model, *overrides])).record()["hf_tokenizer"]

    assert recorded("--data.tokenizer=hf") == str(model)
    assert recorded("--data.tokenizer=hf", f"--data.hf_tokenizer={tokenizer}") == str(tokenizer)
    assert recorded(f"--data.hf_tokenizer={tokenizer}") == ""  # data.tokenizer=sentencepiece trains one


def test_bad_data_settings_are_the_same_lines_for_the_config_and_for_prepare_data(tmp_path):
    # Every problem at once, by one check: the training run reads them from the config, prepare_data raises them.
    bad = {"val_fraction": 0.0, "vocab_size": 8, "num_workers": -1, "shard_tokens": 0, "max_document_mb": 1e-7,
           "text_field": "", "remote_timeout_s": 0.0}
    lines = ["data.val_fraction must be between 0 and 1, got 0.0", "data.vocab_size must be at least 16, got 8",
             "data.num_workers must not be negative, got -1", "data.shard_tokens must be positive, got 0",
             "data.max_document_mb must be at least one byte (9.54e-07 MB), got 1e-07",
             "data.text_field must name the field or column holding the text",
             "data.hf_dataset.path and data.files (or data.sources) both name a corpus: give one of them",
             "data.remote_timeout_s must be in (0, 10**9] seconds, got 0.0"]
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"--data.{name}={value}" for name, value in bad.items()]
                    + ["--data.files=[c.jsonl]", "--data.hf_dataset.path=org/ds"])
    assert caught.value.problems == lines
    with pytest.raises(DataError) as raised:
        prepare_data(tmp_path / "out", PrepareSettings(**bad, files=["c.jsonl"], hf_dataset=HFDatasetConfig("org/ds")),
                     show_progress=False)
    assert str(raised.value).split("; ") == lines
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_worker_count_does_not_change_the_output(small_chunks, corpus_2mb, tmp_path, caplog):
    one = prep(tmp_path / "one", [str(corpus_2mb)], num_workers=1, shard_tokens=20_000)
    two = prep(tmp_path / "two", [str(corpus_2mb)], num_workers=2, shard_tokens=20_000)
    again = prep(tmp_path / "again", [str(corpus_2mb)], num_workers=2, shard_tokens=20_000)
    with caplog.at_level(logging.INFO, logger="data.prepare"):  # the default for a small corpus: no process
        none = prep(tmp_path / "none", [str(corpus_2mb)], num_workers=0, shard_tokens=20_000)
    assert "with no worker process (a small corpus)" in caplog.text
    assert len(one.train_files) > 10
    assert store_files(one) == store_files(two) == store_files(again) == store_files(none)
    # Shards close at the first work unit past shard_tokens: bounded by it plus one unit (~1k tokens).
    sizes = [path.stat().st_size // 2 for path in one.train_files]
    assert all(20_000 <= size < 22_000 for size in sizes[:-1]), sizes


@pytest.mark.slow  # prepares a 2 MB corpus several times
def test_interrupted_preparation_resumes_to_the_same_result(small_chunks, corpus_2mb, tmp_path, monkeypatch, caplog):
    clean = prep(tmp_path / "clean", [str(corpus_2mb)], shard_tokens=20_000)
    finish_shard = ShardWriter.finish_shard

    def fail_after_three(self, **kwargs):
        if len(self.shards) == 3:
            raise KeyboardInterrupt  # as if stopped with Ctrl-C while the fourth shard was being written
        finish_shard(self, **kwargs)

    monkeypatch.setattr(ShardWriter, "finish_shard", fail_after_three)
    root = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        prep(tmp_path, [str(corpus_2mb)], dataset_dir=root, shard_tokens=20_000)
    assert not (root / "meta.json").exists()  # a half-prepared folder never claims to be complete
    assert len(json.loads((root / "progress.json").read_text())["shards"]) == 3
    assert not list(root.glob("*.tmp"))
    with pytest.raises(DataError, match="no prepared data"):
        load_prepared(root)
    first_shard = (root / "train-00000.bin").stat()

    monkeypatch.setattr(ShardWriter, "finish_shard", finish_shard)
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        resumed = prep(tmp_path, [str(corpus_2mb)], dataset_dir=root, shard_tokens=20_000)
    assert "continuing an interrupted preparation after its 3 finished shards" in caplog.text
    assert (root / "train-00000.bin").stat().st_mtime_ns == first_shard.st_mtime_ns  # kept, not redone
    assert store_files(resumed) == store_files(clean)
    assert not (root / "progress.json").exists()


@pytest.mark.slow
def test_killed_prepare_script_resumes_to_the_same_result(corpus_2mb, tmp_path):
    # A real interruption: SIGKILL the prepare script (and its workers) once it has finished a shard.
    big = tmp_path / "big.jsonl"
    big.write_text(corpus_2mb.read_text() * 3)  # 6 MB: 6 work units of 1 MB, a shard after each
    args = [sys.executable, str(ROOT / "scripts/prepare_data.py"), str(ROOT / "config/train_tiny_fsdp.yaml"),
            f"--data.files=[{big}]", "--data.vocab_size=320", "--data.max_corpus_mb=0", "--data.num_workers=1",
            "--data.shard_tokens=50000"]
    job = subprocess.Popen([*args, f"--data.dataset_dir={tmp_path / 'killed'}"], cwd=ROOT, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    progress = tmp_path / "killed" / "progress.json"
    deadline = time.monotonic() + 120
    while not (progress.is_file() and json.loads(progress.read_text())["shards"]):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert not (tmp_path / "killed" / "meta.json").exists()

    # The runs after it fork (helpers.run_job): the same script, without a new interpreter's start-up.
    resumed = run_job([*args[1:], f"--data.dataset_dir={tmp_path / 'killed'}"], env=job_env())
    assert resumed.returncode == 0, resumed.stderr
    assert "continuing an interrupted preparation after its" in resumed.stderr
    clean = run_job([*args[1:], f"--data.dataset_dir={tmp_path / 'clean'}"], env=job_env())
    assert clean.returncode == 0, clean.stderr
    assert store_files(load_prepared(tmp_path / "killed")) == store_files(load_prepared(tmp_path / "clean"))
    assert len(load_prepared(tmp_path / "clean").train_files) >= 4


@pytest.mark.slow
def test_two_preparations_of_one_folder_wait_for_each_other(corpus_2mb, tmp_path):
    # Before the lock, two jobs started together on a fresh folder collided ("No such file or directory:
    # train-00000.bin.tmp"), and with other settings the loser left an unreferenced shard behind.
    root = tmp_path / "prepared"
    args = [sys.executable, str(ROOT / "scripts/prepare_data.py"), str(ROOT / "config/train_tiny_fsdp.yaml"),
            f"--data.files=[{corpus_2mb}]", f"--data.dataset_dir={root}", "--data.num_workers=1"]

    def start(name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            return subprocess.Popen([*args, *extra], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True), log

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    first, first_log = start("first", "--data.vocab_size=320")
    lock = root / "prepare.lock"
    wait_for(lambda: lock.is_file() and "pid" in lock.read_text(), "the first preparation never took the lock")
    os.killpg(first.pid, signal.SIGSTOP)  # frozen holding the lock, so that the others surely find it held
    try:
        same, same_log = start("same", "--data.vocab_size=320")
        other, other_log = start("other", "--data.vocab_size=360")
        for log in (same_log, other_log):
            wait_for(lambda: "waiting for another preparation of" in log.read_text(), f"{log.name}: never waited")
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert first.wait(timeout=300) == 0, first_log.read_text()
    assert same.wait(timeout=300) == 0 and "using the data prepared earlier in" in same_log.read_text()
    assert other.wait(timeout=300) == 1
    errors = [line for line in other_log.read_text().splitlines() if line.startswith("error:")]
    assert errors == [f"error: {root} was just prepared by another process from other inputs or settings "
                      f"(data.vocab_size 320 there, 360 here); give this preparation another data.dataset_dir"]
    prepared = load_prepared(root)
    assert prepared.vocab_size == 320
    assert sorted(path.name for path in root.iterdir()) == sorted(
        ["data-folder.json", "meta.json", "prepare.lock", "tokenizer.model",
         *(p.name for p in prepared.train_files + prepared.val_files)])


@pytest.mark.slow  # starts the prepare command and its worker processes
def test_workers_end_with_a_killed_prepare_command(corpus_2mb, tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_text(corpus_2mb.read_text() * 4)
    job = subprocess.Popen([sys.executable, str(ROOT / "scripts/prepare_data.py"),
                            str(ROOT / "config/train_tiny_fsdp.yaml"), f"--data.files=[{big}]", "--data.vocab_size=320",
                            "--data.max_corpus_mb=0", "--data.num_workers=2",
                            f"--data.dataset_dir={tmp_path / 'prepared'}"], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(kids := children(job.pid)) < 3:  # the two workers and multiprocessing's resource tracker
            assert job.poll() is None and time.monotonic() < deadline, "the workers never started"
            time.sleep(0.02)
        job.kill()  # SIGKILL: nothing of the command's own runs after it
        job.wait()
        deadline = time.monotonic() + 5
        while (left := [pid for pid in kids if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"still running 5 s after the prepare command was killed: {left}"
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # whatever is left of the command's session
        except ProcessLookupError:
            pass


@pytest.mark.slow  # prepares chat data twice
def test_interrupted_chat_preparation_keeps_its_masks(tmp_path, monkeypatch):
    from tests.test_chat import chat_settings, make_conversations, write_jsonl

    monkeypatch.setattr("data.prepare.CHUNK_BYTES", 2048)
    path = write_jsonl(tmp_path / "c.jsonl", make_conversations(200, seed=2))
    clean = prepare_data(tmp_path / "clean", chat_settings(path, shard_tokens=3000), show_progress=False)
    with stopped_after(2):
        prepare_data(tmp_path / "resumed", chat_settings(path, shard_tokens=3000), show_progress=False)
    resumed = prepare_data(tmp_path / "resumed", chat_settings(path, shard_tokens=3000), show_progress=False)

    def files(prepared) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in prepared.root.iterdir() if p.suffix in (".bin", ".mask")}

    assert len(clean.train_mask_files) >= 3 and files(resumed) == files(clean)


# ---------------------------------------------------------------- tokenizer sample, cap


def test_tokenizer_is_trained_on_the_whole_corpus(tmp_path, monkeypatch):
    # The first half of the corpus speaks one vocabulary, the second another. With a sample of a tenth
    # of the corpus, pieces of both must be learned: the sample spans the whole corpus.
    monkeypatch.setattr("data.tokenizer.MAX_SAMPLE_CHARS", 6_000)
    first = [f"alphaword{i % 7} betaword{i % 5} gammaword\n" * 8 for i in range(60)]
    second = [f"zulufrag{i % 7} yankeefrag{i % 5} xrayfrag\n" * 8 for i in range(60)]
    (tmp_path / "c.jsonl").write_text(jsonl_lines(first + second))
    prepared = prep(tmp_path, [str(tmp_path / "c.jsonl")], vocab_size=300)
    processor = spm.SentencePieceProcessor(model_file=str(prepared.tokenizer_path))
    pieces = [processor.id_to_piece(i).replace("▁", " ") for i in range(processor.get_piece_size())]
    merged = [piece for piece in pieces if len(piece) >= 3 and not piece.startswith("<")]
    text1, text2 = "".join(first), "".join(second)
    # A sample from the start (the first 6 KB are all first-half documents) would learn no second-half piece.
    assert [piece for piece in merged if piece in text1 and piece not in text2], merged
    assert [piece for piece in merged if piece in text2 and piece not in text1], merged


def test_tokenizer_training_shows_its_elapsed_time(tmp_path, monkeypatch, capsys):
    """SentencePiece's training is one call that gives no count to show: its progress line is its elapsed time,
    redrawn while it runs (as on a terminal here: every 0.1 s), like the bars of the passes around it."""
    import data.prepare

    train = data.prepare.train_tokenizer

    def slow_training(*args, **kwargs) -> None:
        time.sleep(1.2)  # a real corpus's training takes minutes
        train(*args, **kwargs)

    monkeypatch.setattr(data.prepare, "train_tokenizer", slow_training)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    (tmp_path / "c.jsonl").write_text(jsonl_lines(DOCUMENTS))
    prepare_data(tmp_path / "out", PrepareSettings(files=(str(tmp_path / "c.jsonl"),), vocab_size=VOCAB_SIZE,
                                                   num_workers=0), show_progress=True)
    err = capsys.readouterr().err
    shown = re.findall(rf"training the tokenizer \({VOCAB_SIZE:,} pieces\): (\d\d):(\d\d) elapsed", err)
    assert len(shown) >= 4, err  # drawn at the start, redrawn while it runs, and at the end
    assert int(shown[-1][0]) * 60 + int(shown[-1][1]) >= 1, err
    assert err.index("sampling for the tokenizer") < err.index("training the tokenizer") < err.index("tokenising")


def test_tokenizer_sample_does_not_depend_on_arrival_order():
    rng = np.random.default_rng(0)
    keys, sizes = rng.integers(0, 2**63, 500), rng.integers(1, 300, 500)
    documents = [(int(key), "d" * int(size)) for key, size in zip(keys, sizes, strict=True)]
    samples = []
    for order in (documents, documents[::-1], [documents[i] for i in rng.permutation(500)]):
        sample = TokenizerSample(max_chars=5_000)
        for key, text in order:
            sample.offer(key, text)
        samples.append(sample.documents())
    # The smallest keys whose texts fit in 5,000 characters, smallest first.
    by_key = sorted(documents)
    fits = next(n for n in range(len(by_key) + 1)
                if n == len(by_key) or sum(len(t) for _, t in by_key[: n + 1]) > 5_000)
    assert samples[0] == samples[1] == samples[2] == [text for _, text in by_key[:fits]]


@pytest.mark.slow
def test_max_corpus_mb_cuts_at_a_record_and_says_so(tmp_path, caplog):
    documents = make_documents(400, seed=9)
    (tmp_path / "c.jsonl").write_text(jsonl_lines(documents))
    cap_mb = 0.02  # about 21 KB of the ~75 KB file
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        prepared = prep(tmp_path, [str(tmp_path / "c.jsonl")], max_corpus_mb=cap_mb)
    assert "data.max_corpus_mb=0.02: read the first" in caplog.text and str(tmp_path / "c.jsonl") in caplog.text
    read = decode_split(prepared, "train") + decode_split(prepared, "val")
    # The documents of whole lines up to the first line that reaches the cap, and none after.
    lines = jsonl_lines(documents).encode().split(b"\n")
    ends = np.cumsum([len(line) + 1 for line in lines])
    num_read = int(np.searchsorted(ends, cap_mb * 2**20)) + 1
    assert sorted(read) == sorted(documents[:num_read])

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        prep(tmp_path / "all", [str(tmp_path / "c.jsonl")])  # no cap: nothing said
    assert "data.max_corpus_mb=" not in caplog.text


# ---------------------------------------------------------------- memory bounded by data.max_document_mb


def test_a_json_line_longer_than_max_document_mb_is_a_bad_record(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(jsonl_lines(DOCUMENTS[:2]) + json.dumps({"text": "z" * 30_000}) + "\n" + jsonl_lines(DOCUMENTS[2:]))
    with pytest.raises(DataError) as caught:
        prep(tmp_path, [str(path)], max_document_mb=0.02)  # 20,971 bytes
    assert str(caught.value) == (f"{path} line 3: a record of more than data.max_document_mb=0.02 MB "
                                 f"(data.on_bad_record=skip skips such records)")
    prepared = prep(tmp_path, [str(path)], max_document_mb=0.02, on_bad_record="skip")
    assert sorted(decode_split(prepared, "train") + decode_split(prepared, "val")) == sorted(DOCUMENTS)
    assert json.loads((prepared.root / "meta.json").read_text())["num_skipped_records"] == 1


@pytest.mark.slow
def test_a_txt_line_longer_than_max_document_mb_is_cut(tmp_path, jsonl_reference):
    text = "".join(f"word{i} é " for i in range(20_000))  # ~180 KB on one line, with 2-byte characters
    (tmp_path / "one.txt").write_text(text)
    prepared = prep(tmp_path, [str(tmp_path / "one.txt")], max_document_mb=0.05,
                    tokenizer_model=str(jsonl_reference.tokenizer_path))
    # Too few documents for one to be held out: the split is by tokens, so decode the two as one stream.
    processor = spm.SentencePieceProcessor(model_file=str(prepared.tokenizer_path))
    ids = np.concatenate([split_tokens(prepared, "train"), split_tokens(prepared, "val")]).tolist()
    ends = [i for i, token in enumerate(ids) if token == processor.eos_id()]
    documents = [processor.decode(ids[a + 1 : b]) for a, b in pairwise([-1, *ends])]
    assert len(documents) >= 4 and all(len(doc.encode()) <= 0.05 * 2**20 for doc in documents)
    assert sorted(documents) == sorted(text.encode()[i:j].decode() for i, j in _cuts(text.encode(), int(0.05 * 2**20)))


def _cuts(data: bytes, size: int) -> list[tuple[int, int]]:
    """The reference cuts of a line without line ends: every `size` bytes, moved back to a character start."""
    cuts, start = [], 0
    while len(data) - start > size:
        end = start + size
        while data[end] & 0xC0 == 0x80:
            end -= 1
        cuts.append((start, end))
        start = end
    return [*cuts, (start, len(data))]


@pytest.mark.slow
def test_a_gzip_bomb_is_read_in_bounded_memory_and_max_corpus_mb_stops_it(tmp_path, monkeypatch):
    import tracemalloc

    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:  # one 48 MB line in about 50 KB
        f.write(b'{"text": "')
        for _ in range(48):
            f.write(b"all work and no play " * 49932)
        f.write(b'"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(DataError,
                           match=r"no text found in .*bomb\.jsonl\.gz: of the 1 records read .* 1 skipped as "
                                            r"bad .*line 1: a record of more than data\.max_document_mb=1 MB"):
            # data.max_corpus_mb bounds what is read, which lets a file read as far more than its size on disk.
            prep(tmp_path, [str(path)], max_document_mb=1, on_bad_record="skip", max_corpus_mb=100)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MB held for a 48 MB line with data.max_document_mb=1"
    # data.max_corpus_mb stops reading inside the line, rather than after it.
    read = []
    read_block = readers._read_block
    monkeypatch.setattr(readers, "_read_block", lambda *args: read.append(len(block := read_block(*args))) or block)
    with pytest.raises(DataError, match="1 skipped as bad"):
        prep(tmp_path, [str(path)], max_document_mb=1, on_bad_record="skip", max_corpus_mb=2)
    assert 2 * 2**20 <= sum(read) <= 4 * 2**20


# ---------------------------------------------------------------- bad input


def corrupt_gzip(path: Path) -> None:
    path.write_bytes(gzip.compress(jsonl_lines(DOCUMENTS).encode())[:300])


BAD_INPUTS = {
    "truncated gzip": ("c.jsonl.gz", corrupt_gzip, r"c\.jsonl\.gz: corrupt or truncated gzip file"),
    "not gzip": ("c.json.gz", lambda p: p.write_bytes(b"plain text, not gzip\n" * 9),
                 r"c\.json\.gz: corrupt or truncated gzip"),
    "not zstd": ("c.jsonl.zst", lambda p: p.write_bytes(os.urandom(500)), r"c\.jsonl\.zst: corrupt or truncated zstd"),
    "truncated zstd": ("c.jsonl.zst", lambda p: p.write_bytes(zstandard.ZstdCompressor().compress(
        jsonl_lines(DOCUMENTS).encode())[:-40]), r"c\.jsonl\.zst: corrupt or truncated zstd"),
    "not parquet": ("c.parquet", lambda p: p.write_bytes(b"PAR1" + os.urandom(200)),
                    r"c\.parquet: not a readable parquet file"),
    "parquet without text": ("c.parquet", lambda p: pq.write_table(pa.table({"body": DOCUMENTS}), p),
                             r"c\.parquet has no column 'text' \(it has body\); set data.text_field"),
    "parquet null": ("c.parquet", lambda p: pq.write_table(pa.table({"text": DOCUMENTS[:5] + [None]}), p),
                     r"c\.parquet row 5: 'text' is empty \(null\)"),
    "invalid json": ("c.jsonl", lambda p: p.write_text(jsonl_lines(DOCUMENTS[:3]) + "{not json\n"),
                     r"c\.jsonl line 4: invalid JSON"),
    "missing field": ("c.jsonl", lambda p: p.write_text(jsonl_lines(DOCUMENTS[:3]) + '{"body": "x"}\n'),
                      r"c\.jsonl line 4: expected an object with a string 'text' field"),
    "jsonl not utf-8": ("c.jsonl",
                        lambda p: p.write_bytes(jsonl_lines(DOCUMENTS[:2]).encode() + b'{"text": "caf\xe9"}\n'),
                        r"c\.jsonl line 3: not valid UTF-8"),
    "txt not utf-8": ("c.txt", lambda p: p.write_bytes(b"fine\nline two\nbad \xff byte\n"),
                      r"c\.txt line 3: not valid UTF-8"),
    "unpaired surrogate": ("c.jsonl", lambda p: p.write_text(jsonl_lines(DOCUMENTS[:2]) + '{"text": "a \\ud800 b"}\n'),
                           r"c\.jsonl line 3: text holds an unpaired surrogate"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_naming_the_file(case, tmp_path):
    name, write, message = BAD_INPUTS[case]
    write(tmp_path / name)
    with pytest.raises(DataError, match=message) as caught:
        prep(tmp_path, [str(tmp_path / name)])
    assert "\n" not in str(caught.value) and str(tmp_path / name) in str(caught.value)
    assert not (tmp_path / "prepared" / "meta.json").exists()


def test_bad_records_skipped_and_counted(tmp_path, caplog):
    bad = '{"body": "no text"}\n{not json\n"a string, not an object"\n'
    (tmp_path / "c.jsonl").write_text(jsonl_lines(DOCUMENTS[:30]) + bad + jsonl_lines(DOCUMENTS[30:]))
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        prepared = prep(tmp_path, [str(tmp_path / "c.jsonl")], on_bad_record="skip")
    meta = json.loads((prepared.root / "meta.json").read_text())
    assert meta["num_skipped_records"] == 3
    assert meta["first_skipped_record"].endswith("c.jsonl line 31: expected an object with a string 'text' field")
    assert "skipped 3 bad records (data.on_bad_record=skip); the first:" in caplog.text
    assert sorted(decode_split(prepared, "train") + decode_split(prepared, "val")) == sorted(DOCUMENTS)


def test_all_records_skipped_says_how_many_and_why(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"body": "x"}\n' * 3 + "{not json\n" + json.dumps({"text": "  "}) + "\n")
    with pytest.raises(DataError) as caught:
        prep(tmp_path, [str(path)], on_bad_record="skip")
    assert str(caught.value) == (f"no text found in {path}: of the 5 records read (lines, rows or documents), 1 blank, "
                                 f"4 skipped as bad (data.on_bad_record=skip; the first: {path} line 1: expected an "
                                 f"object with a string 'text' field)")


def test_missing_format_package_names_it(tmp_path, monkeypatch):
    write_format(tmp_path, "jsonl.zst")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    with pytest.raises(DataError, match="c.jsonl.zst needs the zstandard package: pip install zstandard"):
        prep(tmp_path, [str(tmp_path / "c.jsonl.zst")])


def test_unsupported_and_unmatched_inputs(tmp_path):
    with pytest.raises(DataError, match=r"no .*files match .*\*\.jsonl"):
        prep(tmp_path, [str(tmp_path / "*.jsonl")])
    (tmp_path / "c.json").write_text("[]")
    with pytest.raises(DataError, match=r"unsupported data file .*c\.json: expected one of \.jsonl\.gz"):
        prep(tmp_path, [str(tmp_path / "c.json")])


@pytest.mark.slow
def test_disk_full_while_writing_a_shard(small_chunks, corpus_2mb, tmp_path, monkeypatch):
    # The fifth shard's file is created, but written to /dev/full, where every write fails with ENOSPC, as on a
    # full disk.
    create = nofollow.create

    def fifth_shard_on_a_full_disk(path):
        if path.name != "train-00004.bin.tmp":
            return create(path)
        create(path).close()
        return open("/dev/full", "wb")

    monkeypatch.setattr(nofollow, "create", fifth_shard_on_a_full_disk)
    root = tmp_path / "prepared"
    with pytest.raises(DataError) as caught:
        prep(tmp_path, [str(corpus_2mb)], shard_tokens=20_000)
    assert str(caught.value) == (f"disk full while writing {root / 'train-00004.bin.tmp'}; free some space and "
                                 f"rerun to continue after the 4 finished shards")
    assert not (root / "meta.json").exists() and not list(root.glob("*.tmp"))
    assert len(json.loads((root / "progress.json").read_text())["shards"]) == 4


# ---------------------------------------------------------------- whose files are whose


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def test_a_folder_of_the_users_files_is_refused_and_left_as_it_was(tmp_path):
    # The corpus folder itself as data.dataset_dir. Its files carry names a preparation might take for its own
    # (Hugging Face names its files train-00000-of-00001.parquet): only the files it recorded are its own.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pq.write_table(pa.table({"text": DOCUMENTS}), corpus / "train-00000-of-00001.parquet")
    (corpus / "val-notes.txt").write_text("my notes\n")
    (corpus / "tokenizer.model.bak").write_bytes(b"an old tokenizer")
    before = snapshot(corpus)
    with pytest.raises(DataError) as caught:
        prep(tmp_path, [str(corpus)], dataset_dir=corpus)
    assert str(caught.value) == (f"{corpus} holds files this library did not write (tokenizer.model.bak, "
                                 f"train-00000-of-00001.parquet, val-notes.txt): data.dataset_dir must be a new or "
                                 f"empty folder, or one prepared by this library; nothing was changed there")
    assert snapshot(corpus) == before  # not even a lock file


@pytest.mark.parametrize("name", ["meta.json", "progress.json", "meta.json.tmp", "progress.json.tmp", "prepare.lock"])
@pytest.mark.parametrize("caller", ["prepare_data", "training job"])
def test_a_folder_of_only_the_librarys_file_names_is_refused(name, caller, tmp_path):
    # Names the library writes prove nothing: a folder is the library's only when its marker (or a sealed
    # record) says so. Here the user's own file of that name is the only thing there.
    (tmp_path / "c.jsonl").write_text(jsonl_lines(DOCUMENTS))
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / name).write_text('{"format_version": 4, "my": "notes"}\n')
    before = snapshot(folder)
    settings = PrepareSettings(files=(str(tmp_path / "c.jsonl"),), vocab_size=VOCAB_SIZE, num_workers=0)
    with pytest.raises(DataError) as caught:
        if caller == "prepare_data":
            prepare_data(folder, settings, show_progress=False)
        else:
            prepare_for_training(folder, settings, named_dir=True, max_input_mb=1)
    assert str(caught.value) == (f"{folder} holds files this library did not write ({name}): data.dataset_dir "
                                 f"must be a new or empty folder, or one prepared by this library; nothing was "
                                 f"changed there")
    assert snapshot(folder) == before


def _as_format_3(root: Path) -> None:
    """The folder as format 3 of the store holds it: no marker, no hashes or largest ids in meta.json, which
    stays sealed, and another source fingerprint (the format version is part of it)."""
    from data.store import MARKER_NAME, write_record

    (root / MARKER_NAME).unlink()
    meta = json.loads((root / "meta.json").read_text())
    for shard in meta["shards"]:
        del shard["sha256"], shard["max_token_id"]
    del meta["hash_block_bytes"], meta["record_sha256"]
    write_record(root / "meta.json", {**meta, "format_version": 3, "source_fingerprint": "0" * 64})


def test_a_sealed_folder_without_the_marker_is_recognised(tmp_path, caplog):
    (tmp_path / "c.jsonl").write_text(jsonl_lines(DOCUMENTS))
    root = tmp_path / "prepared"
    prep(tmp_path, [str(tmp_path / "c.jsonl")])
    _as_format_3(root)
    with pytest.raises(DataError, match=r"prepared by another version of this library \(format 3, expected 4\); "
                                        "prepare it again"):
        load_prepared(root)
    settings = PrepareSettings(files=(str(tmp_path / "c.jsonl"),), vocab_size=VOCAB_SIZE, val_fraction=0.1, seed=7)
    with pytest.raises(DataError, match=r"already holds data prepared from other inputs or settings \(prepared by "
                                        r"another version of this library\); delete it"):
        prepare_for_training(root, settings, named_dir=True, max_input_mb=1)
    # Its sealed meta.json shows it is the library's: prepared again in place, and marked.
    again = prep(tmp_path, [str(tmp_path / "c.jsonl")])
    assert sorted(p.name for p in root.iterdir()) == ["data-folder.json", "meta.json", "prepare.lock",
                                                     "tokenizer.model", "train-00000.bin", "val-00000.bin"]
    assert load_prepared(root) == again
    # One of this version without its marker is reused as it is.
    (root / "data-folder.json").unlink()
    before = snapshot(root)
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        assert prep(tmp_path, [str(tmp_path / "c.jsonl")]) == again
    assert "using the data prepared earlier in" in caplog.text and snapshot(root) == before


@pytest.mark.slow
def test_only_recorded_files_are_replaced(tmp_path):
    (tmp_path / "c.jsonl").write_text(jsonl_lines(DOCUMENTS))
    root = tmp_path / "prepared"
    first = prep(tmp_path, [str(tmp_path / "c.jsonl")])
    # Another vocabulary: everything the first preparation recorded is replaced, in place.
    second = prep(tmp_path, [str(tmp_path / "c.jsonl")], vocab_size=VOCAB_SIZE + 40)
    assert second.vocab_size == VOCAB_SIZE + 40 and first.tokenizer_path == second.tokenizer_path
    # A file of the user's in the prepared folder: still reused as it is for the same inputs ...
    (root / "train-notes.txt").write_text("mine")
    assert prep(tmp_path, [str(tmp_path / "c.jsonl")], vocab_size=VOCAB_SIZE + 40) == second
    # ... never overwritten for others, and never deleted.
    before = snapshot(root)
    with pytest.raises(DataError, match=r"prepared holds files this library did not write \(train-notes\.txt\)"):
        prep(tmp_path, [str(tmp_path / "c.jsonl")])
    assert snapshot(root) == before
    # A meta.json edited to claim the user's file is not trusted (its checksum no longer matches).
    (root / "train-notes.txt").unlink()
    meta = json.loads((root / "meta.json").read_text())
    meta["files"].append("c.jsonl")
    (root / "meta.json").write_text(json.dumps(meta))
    (root / "c.jsonl").write_text("the user's")
    with pytest.raises(DataError, match=r"meta\.json is damaged or was edited, so which files in .* this library "
                                        r"wrote can no longer be proven and none is replaced"):
        prep(tmp_path, [str(tmp_path / "c.jsonl")])
    assert (root / "c.jsonl").read_text() == "the user's"


@pytest.mark.slow
def test_interrupted_tokenizer_leaves_recorded_names(tmp_path, monkeypatch):
    # Killed while the tokenizer is written: its .tmp file is recorded, so the rerun may replace it.
    (tmp_path / "c.jsonl").write_text(jsonl_lines(DOCUMENTS))

    def killed(lines, *, vocab_size, out_path):
        out_path.write_bytes(b"half a model")
        raise KeyboardInterrupt

    monkeypatch.setattr("data.prepare.train_tokenizer", killed)
    with pytest.raises(KeyboardInterrupt):
        prep(tmp_path, [str(tmp_path / "c.jsonl")])
    assert (tmp_path / "prepared" / "tokenizer.model.tmp").exists()
    monkeypatch.undo()
    prepared = prep(tmp_path, [str(tmp_path / "c.jsonl")])
    assert sorted(p.name for p in prepared.root.iterdir()) == ["data-folder.json", "meta.json", "prepare.lock",
                                                                "tokenizer.model", "train-00000.bin", "val-00000.bin"]


def test_unwritable_dataset_dir_is_one_line(tmp_path):
    (tmp_path / "c.jsonl").write_text(jsonl_lines(DOCUMENTS))
    (tmp_path / "a_file").write_text("in the way")
    with pytest.raises(DataError, match=f"cannot create {tmp_path / 'a_file' / 'sub'}: Not a directory"):
        prep(tmp_path, [str(tmp_path / "c.jsonl")], dataset_dir=tmp_path / "a_file" / "sub")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        if os.access(tmp_path / "ro", os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(DataError, match=f"cannot write in {tmp_path / 'ro'}: Permission denied"):
            prep(tmp_path, [str(tmp_path / "c.jsonl")], dataset_dir=tmp_path / "ro")
        with pytest.raises(DataError, match=f"cannot create {tmp_path / 'ro' / 'sub'}: Permission denied"):
            prep(tmp_path, [str(tmp_path / "c.jsonl")], dataset_dir=tmp_path / "ro" / "sub")
    finally:
        (tmp_path / "ro").chmod(0o755)


# ---------------------------------------------------------------- in-job preparation


@pytest.mark.slow
def test_in_job_preparation_rules(tmp_path, caplog):
    (tmp_path / "a.jsonl").write_text(jsonl_lines(DOCUMENTS))
    (tmp_path / "b.jsonl").write_text(jsonl_lines(DOCUMENTS[::-1]))
    settings = PrepareSettings(files=(str(tmp_path / "a.jsonl"),), vocab_size=VOCAB_SIZE, num_workers=1)
    with pytest.raises(DataError, match=r"more than data\.max_in_job_mb=0\.001 .* scripts/prepare_data\.py"):
        prepare_for_training(tmp_path / "big", settings, named_dir=False, max_input_mb=0.001)
    assert not (tmp_path / "big").exists()

    named = tmp_path / "named"
    prepare_for_training(named, settings, named_dir=True, max_input_mb=1)
    before = store_files(load_prepared(named))
    other = PrepareSettings(files=(str(tmp_path / "b.jsonl"),), vocab_size=VOCAB_SIZE, num_workers=1)
    # A named folder of other data is never overwritten by a job ...
    with pytest.raises(DataError, match="already holds data prepared from other inputs or settings"):
        prepare_for_training(named, other, named_dir=True, max_input_mb=1)
    # ... and is trained on as it is when data.files is empty (a folder from scripts/prepare_data.py).
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        prepare_for_training(named, PrepareSettings(), named_dir=True, max_input_mb=1)
    assert "training on the data prepared in" in caplog.text
    assert store_files(load_prepared(named)) == before
    # The default cache folder is a cache: other settings prepare again.
    prepare_for_training(named, other, named_dir=False, max_input_mb=1)
    assert store_files(load_prepared(named)) != before


def test_handoff_between_ranks(tmp_path):
    path = handoff.outcome_path(tmp_path / "out", "job1")

    def wait(**kwargs) -> str | None:
        return handoff.wait_for(path, dataset_dir=tmp_path / "ds", **{"timeout_s": 1, "stop_requested": str, **kwargs})

    with pytest.raises(DataError,
                       match="rank 0 did not finish preparing the data in .*ds within data.prepare_wait_s=0.2 s"):
        wait(timeout_s=0.2, poll_s=0.05)
    # A stop signal ends the wait at once, however long it may last.
    signals = iter(["", "", "SIGTERM"])
    start = time.monotonic()
    with pytest.raises(DataError,
                       match=f"SIGTERM received while waiting for rank 0 to prepare the data in {tmp_path / 'ds'}"):
        wait(timeout_s=3600, poll_s=0.05, stop_requested=lambda: next(signals))
    assert time.monotonic() - start < 5
    handoff.publish(path, None)
    assert wait() is None
    handoff.publish(path, "data file not found: x.txt")
    assert wait() == "data file not found: x.txt"
    assert handoff.outcome_path(tmp_path / "out", "job2") != path
    assert not (tmp_path / "ds").exists()  # nothing is written into the dataset folder
    # Another name of a file of the user's where the outcome was once staged (a copied output directory): untouched.
    (tmp_path / "users.txt").write_text("the user's own file")
    staged = handoff.outcome_path(tmp_path / "out", "job3")
    os.link(tmp_path / "users.txt", staged.with_name(staged.name + ".tmp"))
    handoff.publish(staged, None)
    assert (tmp_path / "users.txt").read_text() == "the user's own file" and staged.read_text() == "ok"


# ---------------------------------------------------------------- the command and the HF tokenizer


@pytest.mark.slow
def test_prepare_script_errors_are_one_line(tmp_path):
    (tmp_path / "c.jsonl").write_text(jsonl_lines(DOCUMENTS[:40]) + "{not json\n")
    script = [str(ROOT / "scripts/prepare_data.py"), str(ROOT / "config/train_tiny_fsdp.yaml")]  # forked: run_job
    # Raised in a worker process: reaches the user as one line, not a multiprocessing traceback.
    proc = run_job([*script, f"--data.files=[{tmp_path / 'c.jsonl'}]", f"--data.dataset_dir={tmp_path / 'o'}",
                    "--data.vocab_size=320"], env=job_env())
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and errors == [f"error: {tmp_path / 'c.jsonl'} line 41: invalid JSON (Expecting "
                                               f"property name enclosed in double quotes) (data.on_bad_record=skip "
                                               f"skips such records)"], proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_job([*script, "--data.num_workers=-2", "--data.shard_tokens=0"], env=job_env())
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: data.num_workers must not be negative, got -2", "error: data.shard_tokens must be positive, got 0"]


@pytest.mark.slow
def test_hf_tokenizer_in_the_workers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.test_hf import save_tokenizer

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(jsonl_lines(DOCUMENTS))
    save_tokenizer(tmp_path / "hf", corpus)
    prepared = prep(tmp_path, [str(corpus)], tokenizer="hf", hf_tokenizer=str(tmp_path / "hf"), num_workers=2)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")

    def tokens(documents: list[str]) -> list[int]:
        return [t for doc in documents for t in (*tok.encode(doc, add_special_tokens=False), tok.eos_token_id)]

    assert split_tokens(prepared, "train").tolist() == tokens([d for d in DOCUMENTS if not held_out(d)])
    assert split_tokens(prepared, "val").tolist() == tokens([d for d in DOCUMENTS if held_out(d)])
    assert prepared.tokenizer_path.name == "hf_tokenizer" and prepared.vocab_size == len(tok)


# ---------------------------------------------------------------- damaged records: a fuzz


HOSTILE = ["../outside.bin", "/etc/hostname", "", ".", "..", "a/b", "x\0y", "train-00000.bin", "meta.json", -1, 0,
           2**70, 1.5, None, True, [], {}, "uint64", "hf", float("nan")]


def _leaves(value, path=()):
    """Every (path, value) inside a JSON value, containers included."""
    yield path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from _leaves(item, (*path, key))


def _mutated(data: bytes, rng, *, reseal: bool) -> bytes:
    """data (a JSON record) truncated, bit-flipped, or with one field replaced, removed or added."""
    from data.store import _record_digest

    kind = rng.choice(["truncate", "flip", "field", "field"])
    if kind == "truncate":
        return data[: rng.randrange(len(data))]
    if kind == "flip":
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return bytes(flipped)
    record = json.loads(data)
    path, _ = rng.choice([leaf for leaf in _leaves(record) if leaf[0]])
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    action = rng.choice(["replace", "replace", "delete", "add"])
    if action == "delete":
        del parent[path[-1]]
    elif action == "add" and isinstance(parent, list):
        parent.append(rng.choice(HOSTILE))
    else:
        parent[path[-1]] = rng.choice(HOSTILE)
    if reseal:  # as if written by a buggy or hostile program that knows the checksum: the fields must hold up
        record["record_sha256"] = _record_digest(record)
    return json.dumps(record).encode()


class _Opens:
    """Paths opened under a sandbox folder (an audit hook: it sees every open, whoever calls it)."""

    def __init__(self):
        self.sandbox: Path | None = None
        self.paths: list[Path] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if event == "open" and self.sandbox is not None and isinstance(args[0], (str, bytes, os.PathLike)):
            path = Path(os.fsdecode(args[0])).resolve()
            if path.is_relative_to(self.sandbox):
                self.paths.append(path)


@pytest.fixture(scope="module")
def opens() -> _Opens:
    return _Opens()


@pytest.fixture(scope="module")
def fuzz_folders(tmp_path_factory):
    """A complete prepared folder of several shards, an interrupted one of the same settings (2 shards
    finished), and the settings, in a sandbox with a file outside the folders that damage must not reach."""
    sandbox = tmp_path_factory.mktemp("fuzz")
    corpus = sandbox / "c.jsonl"
    corpus.write_text(jsonl_lines(make_documents(300, seed=3)))
    tokenizer = prep(sandbox / "t", [str(corpus)]).tokenizer_path
    settings = dict(tokenizer_model=str(tokenizer), shard_tokens=1500, num_workers=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("data.prepare.CHUNK_BYTES", 4096)
        complete = prep(sandbox, [str(corpus)], dataset_dir=sandbox / "complete", **settings)
        with stopped_after(2):
            prep(sandbox, [str(corpus)], dataset_dir=sandbox / "interrupted", **settings)
    assert len(complete.train_files) >= 4
    (sandbox / "outside.bin").write_bytes(b"not the library's")
    return sandbox, corpus, settings, complete


def _copy_folder(source: Path, target: Path) -> None:
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())


def _outcome(call) -> str:
    """'ok', or the DataError's message (which must be one line); any other exception fails the test."""
    try:
        call()
    except DataError as err:
        assert "\n" not in str(err), str(err)
        return str(err)
    return "ok"


@pytest.mark.slow  # a few hundred cases: the slow tier
def test_damaged_meta_json_is_one_line_or_loads_correctly(fuzz_folders, opens, tmp_path):
    import random

    sandbox, _, _, complete = fuzz_folders
    reference = (complete.train_files, complete.val_files, complete.tokenizer_path, complete.vocab_size,
                 complete.num_train_tokens, complete.num_val_tokens)
    outcomes = []
    for case in range(160):
        rng = random.Random(case)
        root = tmp_path / f"case{case}"
        _copy_folder(complete.root, root)
        reseal = case % 2 == 1
        (root / "meta.json").write_bytes(_mutated((complete.root / "meta.json").read_bytes(), rng, reseal=reseal))
        loaded = []
        opens.sandbox, opens.paths = sandbox.resolve(), []
        try:
            outcome = _outcome(lambda: loaded.append(load_prepared(root)))
        finally:
            opens.sandbox = None
        assert all(path.is_relative_to(root.resolve()) for path in opens.paths), (case, opens.paths)
        if loaded:  # then it is the data that is there, all of it inside the folder
            got = loaded[0]
            assert all(path.parent == root for path in [*got.train_files, *got.val_files, got.tokenizer_path]), case
            if not reseal:  # an unsealed change never loads as something else
                assert (got.train_files, got.val_files, got.tokenizer_path, got.vocab_size, got.num_train_tokens,
                        got.num_val_tokens) == tuple(
                    [root / p.name for p in x] if isinstance(x, list) else root / x.name if isinstance(x, Path) else x
                    for x in reference), case
            assert all(path.is_file() for path in got.train_files + got.val_files), case
        outcomes.append(outcome)
    assert (sandbox / "outside.bin").read_bytes() == b"not the library's"
    # The fuzz reached both ends: damage refused, and harmless changes loaded.
    assert 5 < outcomes.count("ok") < 150, outcomes


@pytest.mark.slow  # a few hundred cases: the slow tier
def test_damaged_progress_json_is_one_line_or_resumes_correctly(fuzz_folders, opens, tmp_path):
    import random

    sandbox, corpus, settings, complete = fuzz_folders
    expected = store_files(complete)
    outcomes = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("data.prepare.CHUNK_BYTES", 4096)
        for case in range(60):
            rng = random.Random(1000 + case)
            root = tmp_path / f"case{case}"
            _copy_folder(sandbox / "interrupted", root)
            progress = (sandbox / "interrupted" / "progress.json").read_bytes()
            (root / "progress.json").write_bytes(_mutated(progress, rng, reseal=case % 2 == 1))
            opens.sandbox, opens.paths = sandbox.resolve(), []
            try:
                outcome = _outcome(lambda: prep(sandbox, [str(corpus)], dataset_dir=root, **settings))
            finally:
                opens.sandbox = None
            allowed = (root.resolve(), corpus.resolve(), Path(settings["tokenizer_model"]).resolve())
            assert all(path == corpus.resolve() or path == allowed[2] or path.is_relative_to(root.resolve())
                       for path in opens.paths), (case, opens.paths)
            if outcome == "ok":
                assert store_files(load_prepared(root)) == expected, case
            else:  # refused: what the interrupted preparation wrote is all still there
                left = {p.name for p in (sandbox / "interrupted").iterdir()}
                assert left <= {p.name for p in root.iterdir()}, (case, outcome)
            outcomes.append(outcome)
    assert (sandbox / "outside.bin").read_bytes() == b"not the library's"
    assert 10 < outcomes.count("ok") < 60, outcomes


@pytest.mark.slow  # uses the fuzz's folders
def test_progress_without_its_hash_block_size_is_prepared_again(fuzz_folders, tmp_path):
    from data.store import write_record

    sandbox, corpus, settings, complete = fuzz_folders
    root = tmp_path / "no_block_size"
    _copy_folder(sandbox / "interrupted", root)
    progress = json.loads((root / "progress.json").read_text())
    del progress["record_sha256"], progress["hash_block_bytes"]
    write_record(root / "progress.json", progress)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("data.prepare.CHUNK_BYTES", 4096)
        prepared = prep(sandbox, [str(corpus)], dataset_dir=root, **settings)
    assert store_files(prepared) == store_files(complete)


def test_preparing_again_in_one_process_encodes_with_the_new_tokenizer(tmp_path):
    # Small corpora are prepared in the calling process (num_workers=0). A second preparation of the same folder
    # with another vocabulary trains a new tokenizer.model at the same path: its shards must be what a fresh
    # process writes with that tokenizer, not the first tokenizer's ids.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(make_documents(60)))
    prep(tmp_path, [str(corpus)], dataset_dir=tmp_path / "again", num_workers=0)
    again = prep(tmp_path, [str(corpus)], dataset_dir=tmp_path / "again", num_workers=0, vocab_size=VOCAB_SIZE + 40)
    fresh = prep(tmp_path, [str(corpus)], dataset_dir=tmp_path / "fresh", num_workers=0, vocab_size=VOCAB_SIZE + 40)
    assert again.vocab_size == fresh.vocab_size == VOCAB_SIZE + 40
    for split in ("train", "val"):
        assert np.array_equal(split_tokens(again, split), split_tokens(fresh, split))


def test_an_edited_meta_json_says_to_delete_the_folder_and_nothing_is_replaced(tmp_path):
    # Once meta.json's checksum fails, the library cannot prove which files in the folder it wrote: training says
    # so, preparing again refuses without touching anything, and both tell the user the one way on.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(make_documents(30)))
    folder = tmp_path / "prepared"
    prep(tmp_path, [str(corpus)], dataset_dir=folder, num_workers=0)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "vocab_size": meta["vocab_size"] + 1}))
    before = {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
    with pytest.raises(DataError, match="delete .* and prepare it again, or choose another data.dataset_dir"):
        load_prepared(folder)
    with pytest.raises(DataError, match=r"meta.json is damaged or was edited, so which files in .* this library wrote "
                                        r"can no longer be proven and none is replaced: delete the folder"):
        prep(tmp_path, [str(corpus)], dataset_dir=folder, num_workers=0)
    assert {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()} == before


def test_a_folder_a_job_reads_is_not_prepared_again_and_a_replacement_is_logged(tmp_path, caplog):
    """A folder of other inputs is prepared again in its place, with a warning saying so; but not while a training job
    reads it (its shared lock, data.store.hold_for_reading, held here by another process): one line, nothing
    changed, and the job's data stays as it was."""
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text(jsonl_lines(make_documents(60, seed=1)))
    second.write_text(jsonl_lines(make_documents(60, seed=2)))
    root = tmp_path / "prepared"
    prep(tmp_path, [str(first)], dataset_dir=root, num_workers=0)
    before = {path.name: path.read_bytes() for path in root.iterdir()}
    reader = subprocess.Popen([sys.executable, "-c", "import sys; from data.store import hold_for_reading; "
                               "hold_for_reading(sys.argv[1]); print('reading', flush=True); sys.stdin.read()",
                               str(root)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline() == "reading\n"
        with pytest.raises(DataError) as refused:
            prep(tmp_path, [str(second)], dataset_dir=root, num_workers=0)
    finally:
        reader.communicate(timeout=30)
    assert str(refused.value) == (
        f"{root} holds data prepared from other inputs or settings (other input files (names, sizes, modification "
        "times, ETags or content hashes)) and is in use by another process (its prepare.lock is held: a training job "
        "reads it, or a preparation writes it), and a folder in use is not prepared again; wait for it to end, or "
        "give this preparation another data.dataset_dir")
    assert {path.name: path.read_bytes() for path in root.iterdir()} == before
    with caplog.at_level(logging.WARNING, logger="data.prepare"):
        prepared = prep(tmp_path, [str(second)], dataset_dir=root, num_workers=0)
    assert [r.getMessage() for r in caplog.records if "preparing it again" in r.getMessage()] == [
        f"{root} holds data prepared from other inputs or settings (other input files (names, sizes, modification "
        "times, ETags or content hashes)): preparing it again in its place"]
    assert prepared.num_train_tokens > 0 and (root / "train-00000.bin").read_bytes() != before["train-00000.bin"]
