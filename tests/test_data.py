"""Tests for data/: preparation, caching, errors, deterministic windows, prefetching."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import (  # noqa: E402
    BatchPrefetcher,
    DataError,
    PreparedData,
    TokenDataset,
    load_prepared,
    prepare_data,
    stdlib_source_files,
)

VOCAB_SIZE = 320
WORDS = "alpha beta gamma delta epsilon zeta theta lambda sigma omega return yield class def".split()


def make_documents(num_docs: int = 40, *, seed: int = 0) -> list[str]:
    """Short code-ish documents with indentation, newlines, digits and a non-ASCII character."""
    rng = np.random.default_rng(seed)
    documents = []
    for doc_id in range(num_docs):
        lines = [f"def f{doc_id}(x):"]
        for _ in range(int(rng.integers(2, 6))):
            words = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 7))))
            lines.append(f"    {words} = {int(rng.integers(0, 1000))}  # é")
        documents.append("\n".join(lines) + "\n")
    return documents


def prep(tmp_path: Path, files: list[str], **overrides) -> PreparedData:
    args = dict(
        dataset_dir=str(tmp_path / "prepared"),
        files=files,
        tokenizer_model=None,
        vocab_size=VOCAB_SIZE,
        val_fraction=0.1,
        max_corpus_mb=0,
        seed=7,
        show_progress=False,
    )
    args.update(overrides)
    return prepare_data(**args)


def decode_documents(prepared: PreparedData) -> list[str]:
    """Decode train.bin + val.bin back into documents, splitting at EOS."""
    processor = spm.SentencePieceProcessor(model_file=str(prepared.tokenizer_path))
    eos = processor.eos_id()
    documents = []
    for path in (prepared.train_path, prepared.val_path):
        ids = np.fromfile(path, dtype=prepared.dtype).tolist()
        assert ids[-1] == eos
        current: list[int] = []
        for token in ids:
            if token == eos:
                documents.append(processor.decode(current))
                current = []
            else:
                current.append(token)
    return documents


def check_token_counts(prepared: PreparedData) -> None:
    meta = json.loads((prepared.train_path.parent / "meta.json").read_text())
    itemsize = np.dtype(prepared.dtype).itemsize
    assert meta["num_train_tokens"] == prepared.num_train_tokens
    assert meta["num_val_tokens"] == prepared.num_val_tokens
    assert prepared.train_path.stat().st_size == prepared.num_train_tokens * itemsize
    assert prepared.val_path.stat().st_size == prepared.num_val_tokens * itemsize
    assert prepared.num_val_tokens > 0 and prepared.num_train_tokens > prepared.num_val_tokens


@pytest.fixture(scope="module")
def txt_prepared(tmp_path_factory) -> tuple[PreparedData, list[str], Path]:
    root = tmp_path_factory.mktemp("txt")
    documents = make_documents()
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(documents):
        (corpus / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    prepared = prep(root, [str(corpus)])
    return prepared, documents, root


# ---------------------------------------------------------------- preparation


def test_txt_directory_roundtrip(txt_prepared):
    prepared, documents, _ = txt_prepared
    assert prepared.dtype == np.uint16
    assert prepared.vocab_size == VOCAB_SIZE
    assert prepared.tokenizer_path == prepared.train_path.parent / "tokenizer.model"
    check_token_counts(prepared)
    decoded = decode_documents(prepared)
    assert sorted(decoded) == sorted(documents)
    # 40 documents at val_fraction 0.1 -> 4 held out, all whole documents.
    processor = spm.SentencePieceProcessor(model_file=str(prepared.tokenizer_path))
    val_ids = np.fromfile(prepared.val_path, dtype=prepared.dtype)
    assert int((val_ids == processor.eos_id()).sum()) == 4


def test_jsonl_roundtrip(tmp_path):
    documents = make_documents(30, seed=1)
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": text, "id": i}) for i, text in enumerate(documents)]
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    prepared = prep(tmp_path, [str(path)])
    assert prepared.dtype == np.uint16
    check_token_counts(prepared)
    assert sorted(decode_documents(prepared)) == sorted(documents)
    assert load_prepared(str(tmp_path / "prepared")) == prepared


def test_preparation_is_deterministic(tmp_path, monkeypatch):
    # A small line cap forces the tokenizer's training-line sampling path.
    monkeypatch.setattr("data.prepare.MAX_TOKENIZER_SENTENCES", 60)
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in make_documents(30)), encoding="utf-8")
    first = prep(tmp_path / "a", [str(path)])
    second = prep(tmp_path / "b", [str(path)])
    assert first.tokenizer_path.read_bytes() == second.tokenizer_path.read_bytes()
    assert first.val_path.read_bytes() == second.val_path.read_bytes()
    assert first.train_path.read_bytes() == second.train_path.read_bytes()


def test_single_document_split_by_characters(tmp_path):
    text = "".join(make_documents(20))
    path = tmp_path / "one.txt"
    path.write_text(text, encoding="utf-8")
    prepared = prep(tmp_path, [str(path)], val_fraction=0.25)
    train_text, val_text = decode_documents(prepared)
    assert train_text + val_text == text
    assert len(val_text) == len(text) - int(len(text) * 0.75)


def test_reuse_and_reprepare(tmp_path):
    # Own directory: re-preparing must not disturb the shared module fixture.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(make_documents(12)), encoding="utf-8")
    root = tmp_path
    prepared = prep(root, [str(corpus)])
    meta_path = prepared.train_path.parent / "meta.json"
    before = meta_path.stat().st_mtime_ns
    time.sleep(0.01)
    again = prep(root, [str(corpus)])
    assert again == prepared
    assert meta_path.stat().st_mtime_ns == before

    bigger = prep(root, [str(corpus)], vocab_size=VOCAB_SIZE + 40)
    assert bigger.vocab_size == VOCAB_SIZE + 40
    assert meta_path.stat().st_mtime_ns != before
    assert json.loads(meta_path.read_text())["vocab_size"] == VOCAB_SIZE + 40


def test_given_tokenizer_model(txt_prepared, tmp_path):
    prepared, _, _ = txt_prepared
    path = tmp_path / "more.txt"
    path.write_text("".join(make_documents(10, seed=3)), encoding="utf-8")
    # vocab_size is ignored in favour of the model's own size.
    reused = prep(tmp_path, [str(path)], tokenizer_model=str(prepared.tokenizer_path), vocab_size=999)
    assert reused.vocab_size == VOCAB_SIZE
    assert reused.tokenizer_path.read_bytes() == prepared.tokenizer_path.read_bytes()
    with pytest.raises(DataError, match="missing.model"):
        prep(tmp_path, [str(path)], tokenizer_model=str(tmp_path / "missing.model"))


# ---------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=f"data file not found: {missing}"):
        prep(tmp_path, [str(missing)])


def test_empty_and_whitespace_corpus(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=f"no text found in .*{empty}"):
        prep(tmp_path, [str(empty)])
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": "  \n\t "}) + "\n")
    with pytest.raises(DataError, match=f"no text found in .*{empty}.*{blank}"):
        prep(tmp_path, [str(empty), str(blank)])


def test_jsonl_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=f"{path} line 2"):
        prep(tmp_path, [str(path)])
    path.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(DataError, match=f"{path} line 2"):
        prep(tmp_path, [str(path)])


def test_unknown_extension(tmp_path):
    path = tmp_path / "corpus.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match=str(path)):
        prep(tmp_path, [str(path)])


def test_vocab_too_large(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("".join(make_documents(3)))
    with pytest.raises(DataError, match="vocab_size"):
        prep(tmp_path, [str(path)], vocab_size=5000)


def test_load_prepared_errors(txt_prepared, tmp_path):
    with pytest.raises(DataError, match="meta.json"):
        load_prepared(str(tmp_path))
    prepared, _, _ = txt_prepared
    (tmp_path / "meta.json").write_text((prepared.train_path.parent / "meta.json").read_text())
    (tmp_path / "tokenizer.model").write_bytes(prepared.tokenizer_path.read_bytes())
    with pytest.raises(DataError, match="train.bin"):
        load_prepared(str(tmp_path))


# ---------------------------------------------------------------- TokenDataset


def write_tokens(path: Path, num_tokens: int) -> np.ndarray:
    tokens = (np.arange(num_tokens, dtype=np.int64) * 7919 % 60000).astype(np.uint16)
    tokens.tofile(path)
    return tokens


@pytest.fixture
def token_file(tmp_path) -> tuple[Path, np.ndarray]:
    path = tmp_path / "tokens.bin"
    return path, write_tokens(path, 1000)


def test_window_matches_raw_slices(token_file):
    path, tokens = token_file
    seq_len = 16
    dataset = TokenDataset(path, dtype=np.uint16, seq_len=seq_len, seed=3, shuffle=False)
    assert dataset.num_windows == 999 // 16
    for index in (0, 1, 61, 62, 62 + 5):
        position = index % dataset.num_windows
        expected = tokens[position * seq_len : position * seq_len + seq_len + 1].astype(np.int64)
        window = dataset.window(index)
        assert window.dtype == np.int64
        np.testing.assert_array_equal(window, expected)


def test_shuffled_epochs(token_file):
    path, tokens = token_file
    seq_len = 10
    dataset = TokenDataset(path, dtype=np.uint16, seq_len=seq_len, seed=5)
    num_windows = dataset.num_windows
    assert num_windows == 99

    def starts(first: int) -> list[int]:
        return [dataset.window_start(i) for i in range(first, first + num_windows)]

    epoch0, epoch1 = starts(0), starts(num_windows)
    assert sorted(epoch0) == [w * seq_len for w in range(num_windows)]
    assert sorted(epoch1) == sorted(epoch0) and epoch1 != epoch0
    # Independent re-derivation of the documented order.
    for epoch, found in ((0, epoch0), (1, epoch1)):
        perm = np.random.default_rng([5, epoch]).permutation(num_windows)
        assert found == (perm * seq_len).tolist()
    k = 4
    start = int(np.random.default_rng([5, 1]).permutation(num_windows)[k]) * seq_len
    np.testing.assert_array_equal(dataset.window(num_windows + k), tokens[start : start + seq_len + 1])


def test_order_depends_only_on_seed(token_file):
    path, _ = token_file
    a = TokenDataset(path, dtype=np.uint16, seq_len=8, seed=1)
    b = TokenDataset(path, dtype="uint16", seq_len=8, seed=1)
    c = TokenDataset(path, dtype=np.uint16, seq_len=8, seed=2)
    indices = [5, 300, 0, 124, 125, 999]  # out of order and across epochs, like a resume
    order_a = [a.window_start(i) for i in indices]
    assert order_a == [b.window_start(i) for i in reversed(indices)][::-1]
    assert [a.window_start(i) for i in range(100)] != [c.window_start(i) for i in range(100)]


def test_batch_shapes_and_shift(token_file):
    path, _ = token_file
    dataset = TokenDataset(path, dtype=np.uint16, seq_len=12, seed=0)
    inputs, targets = dataset.batch(80, 6)  # crosses the epoch boundary at 83
    assert inputs.shape == targets.shape == (6, 12)
    assert inputs.dtype == targets.dtype == torch.int64
    for row, index in enumerate(range(80, 86)):
        window = torch.from_numpy(dataset.window(index))
        assert torch.equal(inputs[row], window[:-1])
        assert torch.equal(targets[row], window[1:])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_world_size_invariance(token_file, world_size):
    path, _ = token_file
    dataset = TokenDataset(path, dtype=np.uint16, seq_len=9, seed=11)
    micro_batch, start = 4, 205
    full_inputs, full_targets = dataset.batch(start, world_size * micro_batch)
    parts = [dataset.batch(start + rank * micro_batch, micro_batch) for rank in range(world_size)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_inputs)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_targets)


def test_too_short_file(tmp_path):
    path = tmp_path / "short.bin"
    write_tokens(path, 10)
    with pytest.raises(DataError, match=r"holds 10 tokens, fewer than seq_len\+1=11"):
        TokenDataset(path, dtype=np.uint16, seq_len=10, seed=0)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="holds 0 tokens"):
        TokenDataset(empty, dtype=np.uint16, seq_len=4, seed=0)


def test_dataset_on_prepared_data(txt_prepared):
    prepared, _, _ = txt_prepared
    dataset = TokenDataset(prepared.val_path, dtype=prepared.dtype, seq_len=8, seed=0)
    raw = np.fromfile(prepared.val_path, dtype=prepared.dtype)
    assert dataset.num_windows == (len(raw) - 1) // 8
    inputs, _ = dataset.batch(0, 2)
    assert int(inputs.max()) < prepared.vocab_size


# ---------------------------------------------------------------- prefetcher


def test_prefetcher_matches_direct_batches(token_file):
    path, _ = token_file
    dataset = TokenDataset(path, dtype=np.uint16, seq_len=7, seed=2)
    firsts = list(range(0, 300, 12))
    prefetcher = BatchPrefetcher(dataset, firsts, num_samples=12, device=torch.device("cpu"), depth=2)
    got = list(prefetcher)
    prefetcher.close()
    assert len(got) == len(firsts)
    for (inputs, targets), first in zip(got, firsts):
        want_inputs, want_targets = dataset.batch(first, 12)
        assert torch.equal(inputs, want_inputs) and torch.equal(targets, want_targets)


class _FailingDataset:
    def batch(self, first_index: int, num_samples: int):
        if first_index >= 2:
            raise RuntimeError(f"broken at {first_index}")
        return torch.zeros(num_samples, 3, dtype=torch.int64), torch.ones(num_samples, 3, dtype=torch.int64)


def test_prefetcher_propagates_errors():
    prefetcher = BatchPrefetcher(_FailingDataset(), range(5), num_samples=2, device=torch.device("cpu"))
    assert next(prefetcher)[0].shape == (2, 3)
    next(prefetcher)
    with pytest.raises(RuntimeError, match="broken at 2"):
        next(prefetcher)
    with pytest.raises(StopIteration):
        next(prefetcher)
    prefetcher.close()


def test_prefetcher_close_stops_thread(token_file):
    path, _ = token_file
    dataset = TokenDataset(path, dtype=np.uint16, seq_len=4, seed=0)
    endless = iter(lambda: 0, 1)  # never ends; the producer must block on the full queue
    prefetcher = BatchPrefetcher(dataset, endless, num_samples=2, device=torch.device("cpu"), depth=1)
    next(prefetcher)
    prefetcher.close()
    assert not prefetcher._thread.is_alive()


# ---------------------------------------------------------------- stdlib corpus


def test_stdlib_source_files():
    files = stdlib_source_files()
    assert len(files) > 200
    assert files == sorted(files)
    assert all(path.suffix == ".py" and path.is_file() for path in files)
    banned = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    assert not any(banned & set(path.parts) for path in files)
    names = {path.name for path in files}
    assert {"os.py", "json", "argparse.py"} & names >= {"os.py", "argparse.py"}
