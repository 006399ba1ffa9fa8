"""Tests for data/: preparation, caching, errors, deterministic windows, prefetching.

Formats, workers, resuming and bad input of the streaming preparation: tests/test_prepare.py."""

from __future__ import annotations

import hashlib
import json
import sysconfig
import time
import tracemalloc
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
import yaml

from config import ConfigError, load_config
from data import (
    BatchPrefetcher,
    DataError,
    Mixture,
    PreparedData,
    PrepareSettings,
    TokenDataset,
    load_prepared,
    open_datasets,
    prepare_data,
    stdlib_source_files,
)
from data.loader import RandomPermutation
from data.mixture import BLOCK as MIX_BLOCK
from data.prepare import python_source_files

ROOT = Path(__file__).resolve().parents[1]

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


def prep(tmp_path: Path, files: list[str], *, dataset_dir: Path | None = None, **settings) -> PreparedData:
    settings = dict(files=tuple(files), vocab_size=VOCAB_SIZE, val_fraction=0.1, seed=7, num_workers=1) | settings
    return prepare_data(dataset_dir or tmp_path / "prepared", PrepareSettings(**settings), show_progress=False)


def split_tokens(prepared: PreparedData, split: str) -> np.ndarray:
    """All tokens of one split, shard after shard."""
    files = prepared.train_files if split == "train" else prepared.val_files
    return np.concatenate([np.fromfile(path, dtype=prepared.dtype) for path in files])


def decode_split(prepared: PreparedData, split: str) -> list[str]:
    """Decode one split back into documents, splitting at EOS."""
    processor = spm.SentencePieceProcessor(model_file=str(prepared.tokenizer_path))
    eos = processor.eos_id()
    ids = split_tokens(prepared, split).tolist()
    assert ids[-1] == eos
    documents, current = [], []
    for token in ids:
        if token == eos:
            documents.append(processor.decode(current))
            current = []
        else:
            current.append(token)
    return documents


def decode_documents(prepared: PreparedData) -> list[str]:
    return decode_split(prepared, "train") + decode_split(prepared, "val")


def held_out(text: str, *, seed: int = 7, val_fraction: float = 0.1) -> bool:
    """The documented split rule, derived again: the first 8 bytes of blake2b-128 keyed by the seed."""
    digest = hashlib.blake2b(text.encode(), digest_size=16, key=seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest[:8], "little") < val_fraction * 2**64


def check_token_counts(prepared: PreparedData) -> None:
    meta = json.loads((prepared.root / "meta.json").read_text())
    assert meta["num_train_tokens"] == prepared.num_train_tokens == len(split_tokens(prepared, "train"))
    assert meta["num_val_tokens"] == prepared.num_val_tokens == len(split_tokens(prepared, "val"))
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
    assert prepared.tokenizer_path == prepared.root / "tokenizer.model"
    check_token_counts(prepared)
    # Whole documents, in corpus order within each split; held out by the hash of their text.
    expected_val = [doc for doc in documents if held_out(doc)]
    assert 1 <= len(expected_val) <= 8  # 40 documents at val_fraction 0.1: 4 expected
    assert decode_split(prepared, "val") == expected_val
    assert decode_split(prepared, "train") == [doc for doc in documents if not held_out(doc)]


def test_jsonl_roundtrip(tmp_path):
    documents = make_documents(30, seed=1)
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": text, "id": i}) for i, text in enumerate(documents)]
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    prepared = prep(tmp_path, [str(path)])
    assert prepared.dtype == np.uint16
    check_token_counts(prepared)
    assert decode_split(prepared, "train") == [doc for doc in documents if not held_out(doc)]
    assert decode_split(prepared, "val") == [doc for doc in documents if held_out(doc)]
    assert load_prepared(str(tmp_path / "prepared")) == prepared


@pytest.mark.slow
def test_preparation_is_deterministic(tmp_path, monkeypatch):
    # A small line cap forces the tokenizer's training-line sampling path.
    monkeypatch.setattr("data.prepare.MAX_TOKENIZER_SENTENCES", 60)
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in make_documents(30)), encoding="utf-8")
    first = prep(tmp_path / "a", [str(path)])
    second = prep(tmp_path / "b", [str(path)])
    assert first.tokenizer_path.read_bytes() == second.tokenizer_path.read_bytes()
    for a, b in zip(first.train_files + first.val_files, second.train_files + second.val_files, strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_single_document_split_by_tokens(tmp_path):
    # One document cannot be held out whole: the last val_fraction of its tokens is the validation split.
    text = "".join(make_documents(20))
    path = tmp_path / "one.txt"
    path.write_text(text, encoding="utf-8")
    prepared = prep(tmp_path, [str(path)], val_fraction=0.25)
    train, val = split_tokens(prepared, "train"), split_tokens(prepared, "val")
    processor = spm.SentencePieceProcessor(model_file=str(prepared.tokenizer_path))
    assert val[-1] == processor.eos_id() and processor.eos_id() not in train
    assert processor.decode(train.tolist() + val[:-1].tolist()) == text
    num_tokens = len(train) + len(val)
    assert len(val) == num_tokens - int(num_tokens * 0.75)


@pytest.mark.slow
def test_reuse_and_reprepare(tmp_path):
    # Own directory: re-preparing must not disturb the shared module fixture.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(make_documents(12)), encoding="utf-8")
    root = tmp_path
    prepared = prep(root, [str(corpus)])
    meta_path = prepared.root / "meta.json"
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
    assert reused.tokenizer_sha256 == prepared.tokenizer_sha256
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_vocab_size_advice_points_the_right_way(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("".join(make_documents(3)))
    with pytest.raises(DataError, match=r"^data\.vocab_size=5000 is too large for this corpus, which yields at most "
                                        r"(\d+) pieces; set data\.vocab_size to at most \1, or add data$"):
        prep(tmp_path, [str(path)], vocab_size=5000)
    # Too small for the characters: the advice is to grow it, to the size SentencePiece asks for
    # (256 byte pieces, 3 special pieces, and each distinct character).
    chars = "".join(chr(0x4E00 + i) for i in range(100))  # 100 distinct CJK characters
    text = next(text for k in range(20) if not held_out(text := (chars + "\n") * (20 + k)))  # a training document
    path.write_text(text)
    needed = 256 + 3 + len(set(chars))
    with pytest.raises(DataError) as caught:
        prep(tmp_path, [str(path)], vocab_size=300)
    assert str(caught.value) == (f"data.vocab_size=300 is too small for this corpus: its characters plus the byte and "
                                 f"special pieces need {needed}; set data.vocab_size to at least {needed}")
    assert prep(tmp_path, [str(path)], vocab_size=needed).vocab_size == needed


def test_load_prepared_errors(txt_prepared, tmp_path):
    with pytest.raises(DataError, match="meta.json"):
        load_prepared(str(tmp_path))
    prepared, _, _ = txt_prepared
    (tmp_path / "meta.json").write_text((prepared.root / "meta.json").read_text())
    (tmp_path / "tokenizer.model").write_bytes(prepared.tokenizer_path.read_bytes())
    with pytest.raises(DataError, match="token file missing: .*train-00000.bin"):
        load_prepared(str(tmp_path))
    (tmp_path / "train-00000.bin").write_bytes(prepared.train_files[0].read_bytes()[:-2])
    with pytest.raises(DataError, match="train-00000.bin is .* bytes but meta.json says"):
        load_prepared(str(tmp_path))


# ---------------------------------------------------------------- damaged data


def reseal(meta_path: Path, change) -> None:
    """Edit meta.json and seal it again, as a program that knows the checksum would."""
    from data.store import write_record

    meta = json.loads(meta_path.read_text())
    del meta["record_sha256"]
    change(meta)
    write_record(meta_path, meta)


@pytest.fixture
def hashed_in_small_blocks(tmp_path, monkeypatch) -> PreparedData:
    """A folder whose training shard spans several hash blocks of 4 KB."""
    monkeypatch.setattr("data.prepare.HASH_BLOCK_BYTES", 4096, raising=False)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in make_documents(600, seed=3)))
    prepared = prep(tmp_path, [str(tmp_path / "c.jsonl")])
    assert prepared.train_files[0].stat().st_size > 4 * 4096
    return prepared


def test_a_shard_changed_in_place_stops_at_the_first_read_of_the_change(hashed_in_small_blocks):
    prepared = hashed_in_small_blocks
    shard = prepared.train_files[0]
    original = np.fromfile(shard, dtype=prepared.dtype)
    damaged = original.copy()
    # In-range garbage over the fourth block (tokens 6144 to 8191 at 2 bytes a token), the file's size unchanged.
    damaged[3 * 2048 : 4 * 2048] = np.random.default_rng(0).integers(0, prepared.vocab_size, 2048)
    damaged.tofile(shard)
    train, _ = open_datasets([(load_prepared(prepared.root), 1.0)], seq_len=64, seed=0)  # opening reads no shard
    assert np.array_equal(train.tokens(0, 3 * 2048), original[: 3 * 2048])  # the blocks before it read as they were
    with pytest.raises(DataError) as caught:
        train.tokens(3 * 2048 + 100, 8)
    assert str(caught.value) == (f"{shard}: bytes 12,288 to 16,384 do not match the hash meta.json recorded when the "
                                 f"data was prepared (the file was changed or damaged); prepare {prepared.root} again")


def copy_of(prepared: PreparedData, root: Path) -> Path:
    """A copy of a prepared folder (the module's folder is shared by its tests, so damage goes to a copy)."""
    root.mkdir()
    for path in prepared.root.iterdir():
        (root / path.name).write_bytes(path.read_bytes())
    return root


def test_out_of_range_token_ids_never_reach_a_batch(txt_prepared, tmp_path):
    prepared, _, _ = txt_prepared
    root = copy_of(prepared, tmp_path / "copy")
    # Ids past the vocabulary, as garbage of the right size: the first batch is refused, naming the file.
    shard = root / prepared.train_files[0].name
    np.full(shard.stat().st_size // 2, 65535, dtype=np.uint16).tofile(shard)
    train, _ = open_datasets([(load_prepared(root), 1.0)], seq_len=16, seed=0)
    with pytest.raises(DataError, match=f"^{shard}: bytes 0 to .* do not match the hash meta.json recorded"):
        train.batch(0, 4)
    # The largest id is recorded at preparation ...
    meta = json.loads((prepared.root / "meta.json").read_text())
    files = prepared.train_files + prepared.val_files
    largest = max(int(np.fromfile(path, dtype=prepared.dtype).max()) for path in files)
    assert prepared.max_token_id == largest == max(shard["max_token_id"] for shard in meta["shards"])
    # ... and a meta.json that records one past the vocabulary is refused when the folder is opened.
    reseal(root / "meta.json", lambda meta: meta["shards"][0].update(max_token_id=meta["vocab_size"]))
    with pytest.raises(DataError) as caught:
        load_prepared(root)
    assert str(caught.value) == (f"{root / 'meta.json'}: shard train-00000.bin holds token id {VOCAB_SIZE}, outside "
                                 f"the tokenizer's vocabulary of {VOCAB_SIZE}; prepare {root} again")


def rewrite_tokens(prepared: PreparedData, name: str, position: int, token: int) -> Path:
    """Put `token` at `position` of shard file `name`, then rehash the file and seal meta.json again with its
    largest id left as it was: records that hold for every check made when the folder is opened."""
    from data.store import scan_file

    shard = prepared.root / name
    tokens = np.fromfile(shard, dtype=prepared.dtype)
    tokens[position] = token
    tokens.tofile(shard)

    def rehash(meta: dict) -> None:
        for record in meta["shards"]:
            for key in ("train", "val"):
                if record[key] == name:
                    record["sha256"][key] = scan_file(shard, block_bytes=meta["hash_block_bytes"])[0]

    reseal(prepared.root / "meta.json", rehash)
    return shard


def test_token_ids_past_the_vocabulary_are_refused_where_a_resealed_record_hides_them(txt_prepared, tmp_path):
    prepared, _, _ = txt_prepared
    root = copy_of(prepared, tmp_path / "copy")
    copy = load_prepared(root)
    shard = rewrite_tokens(copy, copy.train_files[0].name, 3, VOCAB_SIZE + 5)
    assert load_prepared(root).max_token_id < VOCAB_SIZE  # what the record says
    train, _ = open_datasets([(load_prepared(root), 1.0)], seq_len=16, seed=0)
    with pytest.raises(DataError) as caught:
        train.batch(0, len(train))  # every window, the one holding position 3 among them
    size = shard.stat().st_size
    assert str(caught.value) == (f"{shard}: bytes 0 to {size:,} hold token id {VOCAB_SIZE + 5}, outside the "
                                 f"tokenizer's vocabulary of {VOCAB_SIZE}; prepare {root} again")


def test_an_id_past_the_vocabulary_stops_at_the_first_read_of_its_block(hashed_in_small_blocks):
    # The largest id a uint16 holds, in the validation shard's last block (a partial one, past two of 4 KB): the
    # blocks before it read as they were.
    prepared = hashed_in_small_blocks
    size = prepared.val_files[0].stat().st_size
    assert 2 * 4096 < size < 3 * 4096
    original = np.fromfile(prepared.val_files[0], dtype=prepared.dtype)
    shard = rewrite_tokens(prepared, prepared.val_files[0].name, 2 * 2048 + 7, 65535)
    _, val = open_datasets([(load_prepared(prepared.root), 1.0)], seq_len=64, seed=0)
    assert np.array_equal(val.tokens(0, 2 * 2048), original[: 2 * 2048])
    with pytest.raises(DataError) as caught:
        val.tokens(2 * 2048, 4)
    assert str(caught.value) == (f"{shard}: bytes 8,192 to {size:,} hold token id 65535, outside the tokenizer's "
                                 f"vocabulary of {prepared.vocab_size}; prepare {prepared.root} again")

def test_a_swapped_tokenizer_is_refused_when_the_folder_is_opened(txt_prepared, tmp_path):
    prepared, _, root = txt_prepared
    other = prep(tmp_path, [str(root / "corpus")], vocab_size=VOCAB_SIZE + 8)
    (other.root / "tokenizer.model").write_bytes(prepared.tokenizer_path.read_bytes())
    with pytest.raises(DataError) as caught:
        load_prepared(other.root)
    assert str(caught.value) == (f"{other.tokenizer_path} is not the tokenizer the data in {other.root} was made with "
                                 f"(its sha256 differs from the one meta.json records); put the original back or "
                                 f"prepare {other.root} again")


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
    # The documented order: epoch e is RandomPermutation keyed by "windows:<seed>:<e>".
    for epoch, found in ((0, epoch0), (1, epoch1)):
        perm = RandomPermutation(num_windows, key=f"windows:5:{epoch}")
        assert found == [perm(i) * seq_len for i in range(num_windows)]
    k = 4
    start = epoch1[k]
    np.testing.assert_array_equal(dataset.window(num_windows + k), tokens[start : start + seq_len + 1])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 1000, 4097])
def test_random_permutation_is_a_bijection(n):
    perm = RandomPermutation(n, key="k")
    assert sorted(perm(i) for i in range(n)) == list(range(n))
    with pytest.raises(IndexError):
        perm(n)


def test_random_permutation_looks_shuffled():
    n = 10_000
    values = [RandomPermutation(n, key="a")(i) for i in range(n)]
    # A uniform random permutation has 1 fixed point and n/2 ascents on average; the identity, a
    # rotation or a stride would be far off.
    assert sum(v == i for i, v in enumerate(values)) < 10
    ascents = sum(b > a for a, b in pairwise(values))
    assert abs(ascents - n / 2) < 0.03 * n
    other = [RandomPermutation(n, key="b")(i) for i in range(n)]
    assert sum(a == b for a, b in zip(values, other, strict=True)) < 10
    # At the scale of 100B tokens: values stay in range and distinct, computed without any table.
    huge = RandomPermutation(10**12, key="a")
    sample = [huge(i) for i in range(0, 10**12, 10**8)]
    assert len(set(sample)) == len(sample) and all(0 <= v < 10**12 for v in sample)


def test_windows_span_shard_boundaries(tmp_path, token_file):
    path, tokens = token_file
    # The same 1000 tokens cut into shards of 333, 0 (an empty val part, say), 400 and 267 tokens.
    bounds = [0, 333, 333, 733, 1000]
    shards = []
    for i, (lo, hi) in enumerate(pairwise(bounds)):
        shards.append(tmp_path / f"shard{i}.bin")
        tokens[lo:hi].tofile(shards[-1])
    whole = TokenDataset(path, dtype=np.uint16, seq_len=16, seed=3)
    sharded = TokenDataset(shards, dtype=np.uint16, seq_len=16, seed=3)
    assert sharded.num_tokens == 1000 and sharded.num_windows == whole.num_windows
    for index in range(2 * whole.num_windows):
        np.testing.assert_array_equal(sharded.window(index), whole.window(index))
    np.testing.assert_array_equal(sharded.tokens(330, 410), tokens[330:740])


def test_loader_memory_does_not_grow_with_the_dataset(tmp_path):
    # 3 sparse shards of 2**31 tokens each (12 GiB on paper, nothing on disk): 6.4e9 tokens, 25M windows
    # of 256. A permutation array of the windows would take 200 MB; the loader must not allocate one.
    shards = []
    for i in range(3):
        shards.append(tmp_path / f"big{i}.bin")
        with open(shards[-1], "wb") as f:
            f.truncate(2**32)
    tracemalloc.start()
    try:
        np.empty(1_000_000)  # numpy reports its allocations to tracemalloc: this one shows as 8 MB
        assert tracemalloc.get_traced_memory()[1] > 7_000_000
        tracemalloc.reset_peak()
        dataset = TokenDataset(shards, dtype=np.uint16, seq_len=256, seed=0)
        for epoch in range(3):
            inputs, _ = dataset.batch(epoch * dataset.num_windows + 12345, 8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert dataset.num_windows == (3 * 2**31 - 1) // 256
    assert inputs.shape == (8, 256) and int(inputs.abs().sum()) == 0  # sparse files read as zeros
    assert peak < 1_000_000, peak


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
    dataset = TokenDataset(prepared.val_files, dtype=prepared.dtype, seq_len=8, seed=0)
    raw = split_tokens(prepared, "val")
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
    for (inputs, targets), first in zip(got, firsts, strict=True):
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


# ---------------------------------------------------------------- the built-in corpora


@pytest.mark.slow
def test_stdlib_source_files():
    files = stdlib_source_files()
    assert len(files) > 200
    assert files == sorted(files)
    assert all(path.suffix == ".py" and path.is_file() for path in files)
    banned = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    assert not any(banned & set(path.parts) for path in files)
    names = {path.name for path in files}
    assert {"os.py", "json", "argparse.py"} & names >= {"os.py", "argparse.py"}


def test_the_python_corpus_is_the_stdlib_and_every_installed_package_once():
    stdlib, python = stdlib_source_files(), python_source_files()
    assert set(stdlib) <= set(python) and len(python) > len(stdlib) + 1000  # this venv: 601 and 20,401
    assert python == sorted(python) and len(set(python)) == len(python)
    assert len({path.resolve() for path in python}) == len(python)  # no file under two names
    assert Path(yaml.__file__) in python and Path(np.__file__) in python
    assert not any({"tests", "__pycache__"} & set(path.parts) for path in python)


def test_the_python_corpus_lists_each_file_once_and_stays_in_its_folders(tmp_path, monkeypatch):
    root = tmp_path.resolve()
    stdlib, site = root / "stdlib", root / "venv/lib/site-packages"
    for path in ("os.py", "json/__init__.py", "test/test_os.py", "site-packages/own.py", "__pycache__/os.py",
                 "notes.txt"):
        (stdlib / path).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / path).write_text("x = 1\n")
    for path in ("pkg/__init__.py", "pkg/mod.py", "pkg/tests/test_mod.py", "pkg/__pycache__/mod.py", "top.py"):
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text("y = 2\n")
    (site / "pkg/alias.py").symlink_to("mod.py")  # a link to a file of the tree: listed as the file
    (site / "pkg/os_again.py").symlink_to(stdlib / "os.py")  # a link to a stdlib file: already listed
    (site / "pkg/mod_copy.py").hardlink_to(site / "pkg/mod.py")  # the same file under a second name
    (site / "pkg/gone.py").symlink_to("missing.py")  # a link to nothing: no file to read
    (site / "pkg/loop").symlink_to("..")  # links to folders are not followed: no loop, nothing outside the tree
    (site / "pkg/outside").symlink_to(stdlib)
    (root / "venv/lib64").symlink_to("lib")  # platlib is purelib through a link to its folder, as in many venvs
    paths = {"stdlib": str(stdlib), "purelib": str(site), "platlib": str(root / "venv/lib64/site-packages")}
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    assert stdlib_source_files() == [stdlib / "json/__init__.py", stdlib / "os.py"]
    assert python_source_files() == [stdlib / "json/__init__.py", stdlib / "os.py", site / "pkg/__init__.py",
                                     site / "pkg/mod.py", site / "top.py"]


# ---------------------------------------------------------------- mixtures


@pytest.fixture
def three_sources(tmp_path) -> list[TokenDataset]:
    """Three token files whose tokens say which source they are: source s holds s * 10000 + position."""
    datasets = []
    for s, num_tokens in enumerate([5000, 3000, 1200]):
        path = tmp_path / f"source{s}.bin"
        (s * 10000 + np.arange(num_tokens)).astype(np.uint16).tofile(path)
        datasets.append(TokenDataset(path, dtype=np.uint16, seq_len=8, seed=s))
    return datasets


def test_mixture_proportions(three_sources):
    weights = [0.5, 0.3, 0.2]
    mixture = Mixture(three_sources, weights)
    # Slots per block of 1024: floor(1024 * cumulative share) differences.
    assert mixture.slots == [512, 307, 205] and MIX_BLOCK == 1024
    num_samples = 40 * MIX_BLOCK
    located = [mixture.locate(i) for i in range(num_samples)]
    sources = np.array([source for source, _ in located])
    for s, weight in enumerate(weights):
        # Every block holds exactly its slots, within 1/1024 of the weight.
        assert np.count_nonzero(sources == s) == 40 * mixture.slots[s]
        assert abs(mixture.slots[s] / MIX_BLOCK - weight) <= 1 / MIX_BLOCK
        # Any aligned run of 64 samples (a global batch, say) holds its share to within 2 samples.
        per_run = np.bincount(np.flatnonzero(sources == s) // 64, minlength=num_samples // 64)
        assert np.all(np.abs(per_run - 64 * weight) <= 2), (s, per_run.min(), per_run.max())
        # A source's own sample indices are used once each, none skipped: 0 .. 40 * slots - 1.
        assert sorted(local for source, local in located if source == s) == list(range(40 * mixture.slots[s]))
    # The window is that source's own window for that index: its tokens carry the source number.
    for index in (0, 1, 2, 1023, 1024, 5000, 40_000):
        source, local = mixture.locate(index)
        window = mixture.window(index)
        np.testing.assert_array_equal(window, three_sources[source].window(local))
        assert np.all(window // 10000 == source)


def global_indices(*, first_step: int, max_steps: int, global_batch: int, micro_batch: int, world_size: int,
                   rank: int) -> list[int]:
    """The first global sample index of each micro-batch that `rank` reads, as train_fsdp.py computes it."""
    grad_accum = global_batch // (micro_batch * world_size)
    return [s * global_batch + (m * world_size + rank) * micro_batch
            for s in range(first_step, max_steps) for m in range(grad_accum)]


def test_mixture_resumes_exactly_at_any_world_size(three_sources):
    mixture = Mixture(three_sources, [3.0, 2.0, 1.0])

    def steps(world_size: int, first_step: int) -> list[torch.Tensor]:
        """Each optimizer step's samples over all ranks, ordered by global index."""
        per_rank = [global_indices(first_step=first_step, max_steps=8, global_batch=16, micro_batch=2,
                                   world_size=world_size, rank=rank) for rank in range(world_size)]
        batches = sorted((first, mixture.batch(first, 2)[0]) for rank in per_rank for first in rank)
        rows = torch.cat([inputs for _, inputs in batches])
        return list(rows.split(16))

    uninterrupted = steps(1, 0)
    for world_size in (2, 4):
        # Stopped after step 3 and resumed on another number of ranks: steps 4..8 read the same samples.
        resumed = steps(world_size, 3)
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[3:], strict=True))


@pytest.mark.slow
def test_mixture_config_checks(txt_prepared, tmp_path):
    prepared, _, root = txt_prepared
    same = prep(tmp_path, [str(root / "corpus")], tokenizer_model=str(prepared.tokenizer_path),
                dataset_dir=tmp_path / "same")
    other = prep(tmp_path, [str(root / "corpus")], vocab_size=300, dataset_dir=tmp_path / "other")

    def problems(sources: str, *extra: str) -> str:
        with pytest.raises(ConfigError) as caught:
            load_config(ROOT / "config/train_tiny_fsdp.yaml", [f"--data.sources={sources}", *extra])
        return "\n".join(caught.value.problems)

    ok = load_config(ROOT / "config/train_tiny_fsdp.yaml",
                     [f"--data.sources=[{{path: {prepared.root}, weight: 0.7}}, {{path: {same.root}, weight: 0.3}}]"])
    assert [(s.path, s.weight) for s in ok.data.sources] == [(str(prepared.root), 0.7), (str(same.root), 0.3)]
    found = problems(f"[{{path: {prepared.root}}}, {{path: {other.root}, weight: 1}}]")
    assert "data.sources[1]: " in found and "was prepared with another tokenizer than data.sources[0]" in found
    found = problems(f"[{{path: {prepared.root}, weight: 0}}, {{path: {tmp_path / 'nope'}, weight: 1}}]")
    assert "data.sources[0].weight must be a positive number, got 0.0" in found
    assert f"data.sources[1].path: {tmp_path / 'nope'} is not a prepared folder (no meta.json)" in found
    found = problems(f"[{{path: {prepared.root}, wieght: 2}}]")
    assert "unknown key 'data.sources[0].wieght' (did you mean 'data.sources[0].weight'?)" in found
    found = problems(f"[{{path: {prepared.root}}}]", "--data.files=[x.txt]")
    assert "data.sources replaces data.files and data.dataset_dir" in found
    assert "data.sources[0]: expected a mapping" in problems("[just/a/path]")


def test_open_datasets_of_a_mixture(txt_prepared, tmp_path):
    prepared, _, root = txt_prepared
    same = prep(tmp_path, [str(root / "corpus")], tokenizer_model=str(prepared.tokenizer_path), val_fraction=0.3,
                dataset_dir=tmp_path / "same")
    train, val = open_datasets([(prepared, 1.0), (same, 3.0)], seq_len=8, seed=0)
    assert isinstance(train, Mixture) and train.slots == [256, 768]
    assert train.num_tokens == prepared.num_train_tokens + same.num_train_tokens
    # Validation mixes each source's held-out split by the same weights, in order within each source.
    assert isinstance(val, Mixture) and val.slots == [256, 768]
    for index in range(6):
        source, local = val.locate(index)
        start = local % val.datasets[source].num_windows * 8  # unshuffled: window after window, then again
        want = split_tokens([prepared, same][source], "val")[start : start + 9]
        np.testing.assert_array_equal(val.window(index), want)
