"""Hugging Face datasets as a corpus (data.hf_dataset, data/hf_datasets.py): one corpus written as .jsonl, as a
save_to_disk folder of several arrow shards, as a folder of parquet files (a hub snapshot), into the datasets cache
and into the hub cache, each prepared into the same token shards (streamed or not, on any number of workers); chat
rows equal their .jsonl; an interrupted preparation continues; a changed dataset is prepared again; bad inputs are
one line; a training job prepares and trains on one. Everything is offline: the caches live in tmp_path."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest

from data import DataError, PrepareSettings, prepare_data
from data.hf_datasets import open_dataset
from data.settings import HFDatasetConfig
from data.store import ShardWriter
from scripts import prepare_data as prepare_script
from tests.helpers import ROOT, losses, run_train

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of amber".split()
CACHED_NAME = "hfdata_cached_corpus"  # a name no folder of the repository has (the tests run from its root)
HUB_NAME = "testorg/corpus"
ROLES = ("user", "assistant")


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """Offline, with the datasets cache and the hub cache in tmp_path (both libraries read their cache folders
    from the environment when imported, so their settings are pointed there too)."""
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_home" / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    datasets.disable_progress_bars()


def make_rows(num: int = 300, *, seed: int = 0) -> list[dict]:
    """Documents of a few pseudo-words each, with an id column beside the text."""
    return [{"id": i, "text": " ".join(WORDS[(i * 7 + k * (seed + 3)) % len(WORDS)] for k in range(4 + i % 11))
             + f" number {i}"} for i in range(num)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_saved(folder: Path, rows: list[dict]) -> Path:
    """A save_to_disk folder of three arrow shards, with a column for every key of any row (null where a row
    lacks it)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    datasets.Dataset.from_dict({key: [row.get(key) for row in rows] for key in keys}).save_to_disk(
        str(folder), num_shards=3)
    return folder


def write_snapshot(folder: Path, rows: list[dict], *, suffix: str = ".parquet") -> Path:
    """The layout of a hub dataset's files: data/<split>-0000k-of-0000n.parquet (or .jsonl)."""
    (folder / "data").mkdir(parents=True)
    half = len(rows) // 2
    for k, part in enumerate((rows[:half], rows[half:])):
        path = folder / "data" / f"train-0000{k}-of-00002{suffix}"
        if suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(part), path)
        else:
            write_jsonl(path, part)
    return folder


def write_cached(tmp_path: Path, rows: list[dict]) -> str:
    """The corpus loaded once with load_dataset, as a download would leave it in the datasets cache."""
    folder = write_snapshot(tmp_path / CACHED_NAME, rows)
    datasets.load_dataset(str(folder), split="train")
    return CACHED_NAME


def write_hub_cache(tmp_path: Path, rows: list[dict]) -> str:
    """The corpus as `huggingface-cli download --repo-type dataset` leaves it in the hub cache."""
    repo = tmp_path / "hf_home" / "hub" / ("datasets--" + HUB_NAME.replace("/", "--"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    write_snapshot(repo / "snapshots" / revision, rows)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return HUB_NAME


def prepared_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.suffix in (".bin", ".mask", ".model")}


def prepare(root: Path, *, files: tuple[str, ...] = (), hf: HFDatasetConfig | None = None,
            **settings) -> dict[str, bytes]:
    settings = {"vocab_size": 320, "num_workers": 0, **settings}
    prepared = prepare_data(root, PrepareSettings(files=files, hf_dataset=hf or HFDatasetConfig(), **settings),
                            show_progress=False)
    return prepared_files(prepared.root)


def test_every_form_of_a_dataset_prepares_the_shards_of_its_jsonl(tmp_path):
    rows = make_rows()
    expected = prepare(tmp_path / "from_jsonl", files=(str(write_jsonl(tmp_path / "c.jsonl", rows)),))
    assert set(expected) == {"tokenizer.model", "train-00000.bin", "val-00000.bin"}
    saved, snapshot = write_saved(tmp_path / "saved", rows), write_snapshot(tmp_path / "snapshot", rows)
    forms = {"saved": str(saved), "snapshot": str(snapshot), "cached": write_cached(tmp_path, rows),
             "hub": write_hub_cache(tmp_path, rows),
             "jsonl_snapshot": str(write_snapshot(tmp_path / "jsonl_snapshot", rows, suffix=".jsonl"))}
    # The names are found where each cache keeps them: the datasets cache's arrow files, the hub cache's snapshot.
    for form, cache in (("cached", "datasets"), ("hub", "hub")):
        found = open_dataset(HFDatasetConfig(forms[form]), text_field="text", chat=None).files
        assert found and all((tmp_path / "hf_home" / cache) in path.parents for path in found), (form, found)
    for form, path in forms.items():
        for streaming in (True, False):
            got = prepare(tmp_path / f"{form}-{streaming}", hf=HFDatasetConfig(path, streaming=streaming))
            assert got == expected, (form, streaming)


@pytest.mark.slow  # starts worker processes
def test_shards_do_not_depend_on_the_worker_count_or_streaming(tmp_path, monkeypatch):
    monkeypatch.setattr("data.hf_datasets.BATCH_ROWS", 8)  # many pieces and work units, so several shards
    monkeypatch.setattr("data.prepare.CHUNK_BYTES", 512)
    rows = make_rows(400)
    saved, snapshot = write_saved(tmp_path / "saved", rows), write_snapshot(tmp_path / "snapshot", rows)
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(prepare(tmp_path / "tok", files=(str(write_jsonl(tmp_path / "c.jsonl", rows)),))[
        "tokenizer.model"])
    outputs = {}
    # Each form, streamed and not, on one and two workers, against the calling process alone.
    for path, streaming, num_workers in ((saved, True, 0), (saved, False, 1), (saved, True, 2), (snapshot, True, 1),
                                         (snapshot, False, 2)):
        outputs[path.name, streaming, num_workers] = prepare(
            tmp_path / f"{path.name}-{streaming}-{num_workers}", hf=HFDatasetConfig(str(path), streaming=streaming),
            num_workers=num_workers, shard_tokens=500, tokenizer_model=str(tokenizer))
    first = next(iter(outputs.values()))
    assert len([name for name in first if name.startswith("train-")]) >= 4
    assert all(output == first for output in outputs.values())


def make_conversations(num: int) -> list[dict]:
    """Multi-turn messages and prompt/response pairs in one dataset (a datasets table fills the other's columns
    with nulls)."""
    records = []
    for i in range(num):
        words = [WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + i % 5)]
        if i % 4 == 0:
            records.append({"prompt": " ".join(words), "response": " ".join(reversed(words))})
        else:
            records.append({"messages": [{"role": ROLES[k % 2], "content": " ".join(words[k:])}
                                         for k in range(2 + i % 3)]})
    return records


def test_a_chat_dataset_prepares_the_shards_and_masks_of_its_jsonl(tmp_path):
    records = make_conversations(200)
    chat = {"format": "chat", "chat_template": "plain"}
    expected = prepare(tmp_path / "from_jsonl", files=(str(write_jsonl(tmp_path / "c.jsonl", records)),), **chat)
    assert {"train-00000.mask", "val-00000.mask"} <= set(expected)
    saved = write_saved(tmp_path / "saved", records)
    assert set(datasets.load_from_disk(str(saved)).column_names) == {"messages", "prompt", "response"}
    assert prepare(tmp_path / "from_saved", hf=HFDatasetConfig(str(saved)), **chat) == expected


def test_an_interrupted_preparation_continues_to_the_same_shards(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("data.hf_datasets.BATCH_ROWS", 8)
    monkeypatch.setattr("data.prepare.CHUNK_BYTES", 512)
    saved = write_saved(tmp_path / "saved", make_rows(400))
    hf = HFDatasetConfig(str(saved))
    expected = prepare(tmp_path / "whole", hf=hf, shard_tokens=500)
    finish_shard, calls = ShardWriter.finish_shard, []

    def fail_after_three(self, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        finish_shard(self, **kwargs)

    monkeypatch.setattr(ShardWriter, "finish_shard", fail_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "resumed", hf=hf, shard_tokens=500)
    monkeypatch.setattr(ShardWriter, "finish_shard", finish_shard)
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        assert prepare(tmp_path / "resumed", hf=hf, shard_tokens=500) == expected
    assert "continuing an interrupted preparation after its 3 finished shards" in caplog.text


def test_a_changed_dataset_is_prepared_again(tmp_path, caplog):
    saved = tmp_path / "saved"
    first = prepare(tmp_path / "out", hf=HFDatasetConfig(str(write_saved(saved, make_rows(300)))))
    datasets.Dataset.from_list(make_rows(300, seed=1)).save_to_disk(str(saved), num_shards=3)
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        again = prepare(tmp_path / "out", hf=HFDatasetConfig(str(saved)))
    assert "using the data prepared earlier" not in caplog.text
    assert again != first and again == prepare(tmp_path / "fresh", hf=HFDatasetConfig(str(saved)))
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        prepare(tmp_path / "out", hf=HFDatasetConfig(str(saved)))
    assert "using the data prepared earlier" in caplog.text


def test_a_named_folder_of_another_corpus_names_the_dataset_setting_to_clear(tmp_path):
    from data import DataError, prepare_for_training

    prepare(tmp_path / "prepared", hf=HFDatasetConfig(str(write_saved(tmp_path / "a", make_rows(60)))))
    other = PrepareSettings(hf_dataset=HFDatasetConfig(str(write_saved(tmp_path / "b", make_rows(60, seed=1)))),
                            vocab_size=320, num_workers=0)
    with pytest.raises(DataError, match=r"delete it to prepare data.hf_dataset.path there, or leave "
                                        r"data.hf_dataset.path empty to train on it as it is$"):
        prepare_for_training(tmp_path / "prepared", other, named_dir=True, max_input_mb=1000)


def run_prepare_script(tmp_path: Path, capsys, *overrides: str) -> tuple[int, list[str]]:
    """scripts/prepare_data.py in this process: its exit code and the lines it wrote to stderr."""
    code = prepare_script.main([str(ROOT / "config/train_tiny_fsdp.yaml"), "--data.vocab_size=320",
                                "--data.num_workers=0", f"--data.dataset_dir={tmp_path / 'out'}", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


def test_the_prepare_script_takes_a_dataset_folder(tmp_path, capsys):
    rows = make_rows()
    saved = write_saved(tmp_path / "saved", rows)
    code, _ = run_prepare_script(tmp_path, capsys, f"--data.hf_dataset.path={saved}")
    assert code == 0
    assert prepared_files(tmp_path / "out") == prepare(tmp_path / "jsonl",
                                                       files=(str(write_jsonl(tmp_path / "c.jsonl", rows)),))


@pytest.mark.parametrize(("case", "message"), [
    ("no_such_path", r"data.hf_dataset.path=\S*nowhere is not a folder, and no dataset of that name is in the local "
                     r"caches"),
    ("no_such_name", r"data.hf_dataset.path=nobody/nothing is not a folder, and no dataset of that name"),
    ("missing_split", r"saved has no split 'validation' \(it has train, test\); set data.hf_dataset.split"),
    ("single_split", r"saved holds the split 'train', not 'validation'; set data.hf_dataset.split=train"),
    ("snapshot_split", r"snapshot has no split 'validation' \(it has train\)"),
    ("no_text_field", r"saved\[train\] has no column 'body' \(it has id, text\); set data.text_field"),
    ("not_text", r"saved\[train\]: column 'id' holds int64, not text"),
    ("chat_without_messages", r"has no column 'messages' \(nor 'prompt' and 'response'\); it has id, text"),
    ("without_datasets", r"needs the datasets package: pip install datasets"),
    ("with_files", r"data.hf_dataset.path and data.files \(or data.sources\) both name a corpus"),
    ("a_file", r"data.hf_dataset.path=\S*train-00000-of-00002.parquet is a file: give the dataset's folder"),
    ("empty_saved", r"cannot load \S*empty with the datasets library: a split of it has no arrow file"),
    ("unread_line", r"cannot read \S*jsonl with the datasets library: JSON parse error"),
])
def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys, monkeypatch, case, message):
    rows = make_rows(20)
    saved, snapshot = tmp_path / "saved", write_snapshot(tmp_path / "snapshot", rows)
    if case == "missing_split":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}
                             ).save_to_disk(str(saved))
    else:
        datasets.Dataset.from_list(rows, split=datasets.Split.TRAIN).save_to_disk(str(saved))
    overrides = {
        "no_such_path": [f"--data.hf_dataset.path={tmp_path / 'nowhere'}"],
        "no_such_name": ["--data.hf_dataset.path=nobody/nothing"],
        "missing_split": [f"--data.hf_dataset.path={saved}", "--data.hf_dataset.split=validation"],
        "single_split": [f"--data.hf_dataset.path={saved}", "--data.hf_dataset.split=validation"],
        "snapshot_split": [f"--data.hf_dataset.path={snapshot}", "--data.hf_dataset.split=validation"],
        "no_text_field": [f"--data.hf_dataset.path={saved}", "--data.text_field=body"],
        "not_text": [f"--data.hf_dataset.path={saved}", "--data.text_field=id"],
        "chat_without_messages": [f"--data.hf_dataset.path={saved}", "--data.format=chat"],
        "without_datasets": [f"--data.hf_dataset.path={saved}"],
        "with_files": [f"--data.hf_dataset.path={saved}", f"--data.files=[{write_jsonl(tmp_path / 'c.jsonl', rows)}]"],
        "a_file": [f"--data.hf_dataset.path={snapshot / 'data' / 'train-00000-of-00002.parquet'}"],
        "empty_saved": [f"--data.hf_dataset.path={tmp_path / 'empty'}"],
        "unread_line": [f"--data.hf_dataset.path={tmp_path / 'jsonl'}", "--data.hf_dataset.streaming=false"],
    }[case]
    if case == "empty_saved":
        datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})
                                   ).save_to_disk(str(tmp_path / "empty"))
    if case == "unread_line":
        with (write_snapshot(tmp_path / "jsonl", rows, suffix=".jsonl") / "data" / "train-00001-of-00002.jsonl"
              ).open("a") as file:
            file.write('{"text": "a line cut sho\n')
    if case == "without_datasets":
        monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    code, lines = run_prepare_script(tmp_path, capsys, *overrides)
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()


# README.md metadata the datasets library cannot read, each raising another kind of error inside it.
BAD_CARDS = {
    "feature_of_a_number": ("dataset_info:\n  features:\n  - name: text\n    dtype: 5\n",
                            r"TypeError: Expected a dict or a list but got <class 'int'>: 5"),
    "feature_without_name": ("dataset_info:\n  features:\n  - dtype: string\n", r"KeyError: 'name'"),
    "data_files_of_a_number": ("configs:\n- config_name: default\n  data_files: 5\n",
                               r"ValueError: Expected data_files in YAML to be either a string or a list"),
    "yaml_cut_short": ("configs: [\n", r"ParserError: while parsing a flow node"),
}


@pytest.mark.parametrize("case", [*BAD_CARDS, "loading_script"])
def test_a_card_or_script_the_library_cannot_use_is_one_line(tmp_path, capsys, case):
    snapshot = write_snapshot(tmp_path / "snapshot", make_rows(20))
    if case == "loading_script":  # what the datasets library looks for, and refuses to run
        (snapshot / "snapshot.py").write_text("import datasets\n")
        expected = (r"\S*snapshot holds a loading script \(snapshot.py\), which is never run \(nor does the datasets "
                    r"library run them\): give a folder of the dataset's data files")
    else:
        card, said = BAD_CARDS[case]
        (snapshot / "README.md").write_text(f"---\n{card}---\n# A dataset\n")
        expected = (rf"cannot read \S*snapshot with the datasets library \({said}.*\); check data.hf_dataset.name and "
                    rf"the metadata atop its README.md \(configs, dataset_info\)$")
    code, lines = run_prepare_script(tmp_path, capsys, f"--data.hf_dataset.path={snapshot}")
    assert code != 0 and len(lines) == 1 and re.match(r"error: " + expected, lines[0]), lines
    assert not (tmp_path / "out").exists()


def write_card(folder: Path, card: str) -> None:
    (folder / "README.md").write_text(f"---\n{card}---\n")


def write_outside_cases(tmp_path: Path, case: str) -> Path:
    """A dataset folder whose records name a data file outside it, as `case` says; the file is there."""
    outside = tmp_path / "elsewhere"
    write_snapshot(outside, make_rows(30, seed=1))
    folder = tmp_path / "ds"
    if case.startswith("saved"):
        datasets.Dataset.from_list(make_rows(30, seed=1)).save_to_disk(str(outside / "saved"))
        if case == "saved_state":
            write_saved(folder, make_rows(20))
            state = json.loads((folder / "state.json").read_text())
            state["_data_files"][1]["filename"] = "../elsewhere/saved/data-00000-of-00001.arrow"
            (folder / "state.json").write_text(json.dumps(state))
        else:
            datasets.DatasetDict({"train": datasets.Dataset.from_list(make_rows(20))}).save_to_disk(str(folder))
            (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["../elsewhere/saved"]}))
        return folder
    write_snapshot(folder, make_rows(20))
    if case == "data_dir":
        write_card(folder, "configs:\n- config_name: default\n  data_dir: ../elsewhere/data\n")
    else:
        named = str(outside / "data" / "train-00000-of-00002.parquet") if case == "absolute" else "../elsewhere/**"
        write_card(folder, f"configs:\n- config_name: default\n  data_files:\n  - split: train\n    path: {named}\n")
    return folder


@pytest.mark.parametrize(("case", "checked"), [(case, True) for case in ("absolute", "parent", "data_dir")]
                         + [(case, False) for case in ("absolute", "parent", "data_dir")]
                         + [("saved_state", True), ("saved_splits", True)])
def test_data_files_outside_the_dataset_folder_are_refused(tmp_path, monkeypatch, case, checked):
    # Such a file would be read, but a later change to it not seen: the fingerprint covers the folder. README.md's
    # patterns are checked before the library globs them (a glob from / walks the whole disk), and the files it
    # resolved before it reads them (checked=False: that second check alone).
    if not checked:
        monkeypatch.setattr("data.hf_datasets._check_card", lambda folder, path: None)
    folder = write_outside_cases(tmp_path, case)
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "out", hf=HFDatasetConfig(str(folder), streaming=False))
    said = str(err.value)
    assert "\n" not in said and said.startswith(str(folder)), said
    if case.startswith("saved"):
        expected = (r"names '../elsewhere/saved\S*' in '(_data_files|splits)', not a name inside \S+: only files "
                    r"inside the dataset folder are read$")
    elif checked:
        expected = (r"its metadata \(README.md configs\) names data_(files|dir) '\S+', which reaches outside the "
                    r"dataset folder: only files inside it are read; copy or link the files into it$")
    else:
        expected = (r"its metadata \(README.md configs\) names the data file \S+/elsewhere/data/\S+, outside the "
                    r"dataset folder: only files inside it are read; copy or link the file into it$")
    assert re.search(expected, said), said
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["folder_elsewhere", "loop", "hidden_root", "fifo"])
def test_links_to_folders_and_special_files_in_a_dataset_folder_are_refused(tmp_path, case):
    # The datasets library follows a link to a folder wherever it leads (the whole disk from /, or without end in a
    # loop of links) and blocks reading a FIFO: each is refused in one line before it reads anything.
    folder = write_snapshot(tmp_path / "ds", make_rows(20))
    culprit = {"folder_elsewhere": folder / "data" / "more", "loop": folder / "data" / "again",
               "hidden_root": folder / ".root", "fifo": folder / "data" / "train-00002-of-00002.parquet"}[case]
    if case == "fifo":
        os.mkfifo(culprit)
    else:
        culprit.symlink_to({"folder_elsewhere": write_snapshot(tmp_path / "elsewhere", make_rows(5)),
                            "loop": folder / "data", "hidden_root": Path("/")}[case])
    if case == "hidden_root":
        write_card(folder, "configs:\n- config_name: default\n  data_files: .root/**/*.parquet\n")
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "out", hf=HFDatasetConfig(str(folder)))
    expected = "is a link to a folder: a dataset folder's data is read only inside it" if case != "fifo" else (
        "is not a regular file (a FIFO, device or socket, or a link to nothing)")
    assert str(err.value).startswith(f"{culprit} {expected}") and "\n" not in str(err.value), err.value
    assert not (tmp_path / "out").exists()


def test_a_change_to_a_linked_data_file_is_prepared_again(tmp_path, caplog):
    # Data files linked into the folder (a hub snapshot's are links to its blobs) are fingerprinted where they lead.
    elsewhere = write_snapshot(tmp_path / "elsewhere", make_rows(200))
    (tmp_path / "ds" / "data").mkdir(parents=True)
    for path in (elsewhere / "data").iterdir():
        (tmp_path / "ds" / "data" / path.name).symlink_to(path)
    hf = HFDatasetConfig(str(tmp_path / "ds"))
    first = prepare(tmp_path / "out", hf=hf)
    assert first == prepare(tmp_path / "direct", hf=HFDatasetConfig(str(elsewhere)))
    pq.write_table(pa.Table.from_pylist(make_rows(100, seed=2)), elsewhere / "data" / "train-00001-of-00002.parquet")
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        again = prepare(tmp_path / "out", hf=hf)
    assert "using the data prepared earlier" not in caplog.text
    assert again != first and again == prepare(tmp_path / "fresh", hf=HFDatasetConfig(str(elsewhere)))


@pytest.mark.parametrize("ref", ["../..", "../../../outside", "/{tmp}/outside"])
def test_a_hub_cache_ref_cannot_lead_out_of_its_repository(tmp_path, ref):
    """refs/main names a folder of snapshots/ (a commit hash): `..` or a path would read a corpus from elsewhere
    (here a complete one, which would prepare)."""
    name = write_hub_cache(tmp_path, make_rows(20))
    write_snapshot(tmp_path / "outside", make_rows(20))
    ref = ref.format(tmp=str(tmp_path).lstrip("/"))
    main = tmp_path / "hf_home" / "hub" / ("datasets--" + name.replace("/", "--")) / "refs" / "main"
    main.write_text(ref)
    from data import DataError

    with pytest.raises(DataError) as err:
        open_dataset(HFDatasetConfig(name), text_field="text", chat=None)
    assert str(err.value) == (f"{main}: names the revision {ref!r}, which is not a folder of "
                              f"{main.parent.parent / 'snapshots'}; download the dataset again")


def test_a_damaged_file_of_a_dataset_is_one_line(tmp_path, capsys):
    snapshot = write_snapshot(tmp_path / "snapshot", make_rows(40))
    damaged = snapshot / "data" / "train-00001-of-00002.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-40])  # the footer's end, and the file's closing magic, cut off
    code, lines = run_prepare_script(tmp_path, capsys, f"--data.hf_dataset.path={snapshot}")
    lines = [line for line in lines if "sampling for the tokenizer" not in line]  # the progress bar's
    assert code != 0 and len(lines) == 1, lines
    expected = r"error: \S*snapshot\[train\]: cannot read the rows from \d+ on \(.*Parquet magic bytes not found.*\)$"
    assert re.match(expected, lines[0]), lines[0]
    assert not (tmp_path / "out" / "meta.json").exists()


def test_a_dataset_folder_that_reads_as_far_more_than_its_size_is_one_line(tmp_path, monkeypatch):
    # A .jsonl.zst data file of a few hundred bytes holding 4 MB of one short line, streamed by datasets: stopped as
    # such a file of data.files is (data/prepare.py's MAX_EXPANSION), past a floor of 1 MB here instead of 16 MB.
    import zstandard

    monkeypatch.setattr("data.prepare.EXPANSION_FLOOR_BYTES", 1 << 20)
    (tmp_path / "ds" / "data").mkdir(parents=True)
    line = json.dumps({"text": "the same short document"}).encode() + b"\n"
    with open(tmp_path / "ds" / "data" / "train-00000-of-00001.jsonl.zst", "wb") as file, \
            zstandard.ZstdCompressor(level=3).stream_writer(file) as out:
        out.write(line * ((4 << 20) // len(line)))
    size = (tmp_path / "ds" / "data" / "train-00000-of-00001.jsonl.zst").stat().st_size
    assert size * 100 < 1 << 20
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "out", hf=HFDatasetConfig(str(tmp_path / "ds")))
    assert str(err.value).startswith(f"{tmp_path / 'ds'}[train] reads as more than 100 times its {size:,} bytes on "
                                     f"disk (a compression bomb?"), err.value


@pytest.mark.slow  # a training job
def test_a_training_job_prepares_and_trains_on_a_dataset_folder(tmp_path):
    saved = write_saved(tmp_path / "saved", make_rows(300))
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    run_train("--data.files=[]", f"--data.hf_dataset.path={saved}", "--train.max_steps=4", out_dir=tmp_path / "run",
              corpus=tmp_path / "unused.txt", dataset_dir=tmp_path / "prep", extra_env=env)
    meta = json.loads((tmp_path / "prep" / "meta.json").read_text())
    assert meta["inputs"] == {"hf_dataset": {"path": str(saved), "name": "", "split": "train"}}
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]


@contextlib.contextmanager
def memory_bound(extra: int):
    """At most `extra` bytes more of address space for this process inside (RLIMIT_AS): a read past it is a
    MemoryError that fails the test, rather than the machine's memory exhausted."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    in_use = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (in_use + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("name", ["state.json", "dataset_info.json", "dataset_dict.json", "README.md", "refs/main"])
def test_a_sparse_metadata_file_is_one_line_in_bounded_memory(tmp_path, name):
    """A dataset folder's metadata, 20 GiB of size and no disk (sparse): read whole by the library or by the datasets
    library (dataset_info.json), it exhausted memory. Each is refused in one line naming it, reading no more than
    its bound (the test allows 2 GiB more address space than the process has)."""
    if name == "dataset_dict.json":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(make_rows(20))}).save_to_disk(str(tmp_path / "ds"))
    elif name in ("state.json", "dataset_info.json"):
        write_saved(tmp_path / "ds", make_rows(20))
    else:
        write_snapshot(tmp_path / "ds", make_rows(20))
    folder, given = tmp_path / "ds", str(tmp_path / "ds")
    if name == "refs/main":  # a dataset by name, found in the hub cache by the revision its ref names
        repo = tmp_path / "hf_home" / "hub" / ("datasets--" + HUB_NAME.replace("/", "--"))
        (repo / "snapshots").mkdir(parents=True)
        folder.rename(repo / "snapshots" / "abc123")
        (repo / "refs").mkdir()
        folder, given = repo, HUB_NAME
    with (folder / name).open("wb") as f:
        f.truncate(20 << 30)
    with pytest.raises(DataError) as err, memory_bound(2 << 30):
        prepare(tmp_path / "out", hf=HFDatasetConfig(given))
    line = str(err.value)
    assert line.startswith(f"{folder / name}: ") and "more than 67,108,864 bytes" in line and "\n" not in line, line
    assert not (tmp_path / "out").exists()
