"""Links and special files at every path of the prepared folder the library reads or writes: each ends in
one DataError line naming it, or is handled safely; nothing is written through a link, nothing hangs on a
FIFO or reads a device, and the hostile entry itself is left as it was or (where the library writes or removes
that name) replaced or removed as itself, never a folder."""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
from pathlib import Path

import pytest

from data import DataError, PrepareSettings, load_prepared, open_datasets, prepare_data
from tests.test_data import make_documents
from tests.test_prepare import stopped_after

# Every name of the folder that the library writes, reads or deletes (a one-shard folder).
NAMES = ["meta.json", "meta.json.tmp", "progress.json", "progress.json.tmp", "prepare.lock", "data-folder.json",
         "tokenizer.model", "tokenizer.model.tmp", "train-00000.bin", "val-00000.bin", "train-00000.bin.tmp"]
KINDS = ["link to a file", "link to a folder", "FIFO", "device", "folder"]
USER_FILE = b"the user's file\n"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A complete folder, an interrupted one (no meta.json, progress.json naming one finished shard) of the same
    settings, and a new one (only the marker); the user's file and folder that links point at."""
    sandbox = tmp_path_factory.mktemp("hostile")
    corpus = sandbox / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_documents(120, seed=4)))
    tokenizer = prepare_data(sandbox / "t", PrepareSettings(files=(str(corpus),), vocab_size=320, num_workers=0),
                             show_progress=False).tokenizer_path
    settings = dict(files=(str(corpus),), tokenizer_model=str(tokenizer), num_workers=0, val_fraction=0.1,
                    shard_tokens=500)
    prepare_data(sandbox / "complete", PrepareSettings(**settings), show_progress=False)
    with stopped_after(1):
        prepare_data(sandbox / "interrupted", PrepareSettings(**settings), show_progress=False)
    (sandbox / "new").mkdir()
    (sandbox / "new" / "data-folder.json").write_bytes((sandbox / "complete" / "data-folder.json").read_bytes())
    (sandbox / "user.txt").write_bytes(USER_FILE)
    (sandbox / "user_dir").mkdir()
    (sandbox / "user_dir" / "keep.txt").write_bytes(USER_FILE)
    return sandbox, settings


def make_hostile(path: Path, kind: str, sandbox: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if kind == "link to a file":
        path.symlink_to(sandbox / "user.txt")
    elif kind == "link to a folder":
        path.symlink_to(sandbox / "user_dir")
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers: endless if ever read
    else:
        path.mkdir()
        (path / "keep.txt").write_bytes(USER_FILE)


def describe(path: Path) -> tuple:
    """What a hostile entry is: its kind, and where it points (a link) or what it holds (a folder)."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return "link", os.readlink(path)
    if stat.S_ISDIR(mode):
        return "folder", sorted((p.name, p.read_bytes()) for p in path.iterdir())
    return stat.S_IFMT(mode), os.lstat(path).st_rdev


class _Hung(BaseException):  # not an Exception: no library's `except Exception` takes it for its own error
    pass


def _alarm(signum, frame):
    raise _Hung


def outcome(call) -> str:
    """'ok', or the DataError's one line; anything else, or a call that hangs for 10 s, fails the test."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        call()
    except DataError as err:
        assert "\n" not in str(err), str(err)
        return str(err)
    except _Hung:
        pytest.fail("hung")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return "ok"


def train_open(root: Path) -> None:
    """What a training job does with the folder: open it, then read its first batches."""
    train, val = open_datasets([(load_prepared(root), 1.0)], seq_len=16, seed=0)
    train.batch(0, 8)
    val.batch(0, 2)


def copy_folder(source: Path, target: Path) -> None:
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_entries_are_refused_in_one_line_or_left_alone(folders, kind, tmp_path):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("making a device file needs root")
    sandbox, settings = folders
    other = PrepareSettings(**{**settings, "val_fraction": 0.2})
    calls = {"training": lambda root: train_open(root),
             "same settings": lambda root: prepare_data(root, PrepareSettings(**settings), show_progress=False),
             "other settings": lambda root: prepare_data(root, other, show_progress=False)}
    refused = 0
    for name in NAMES:
        for start in ("complete", "interrupted", "new"):
            for what, call in calls.items():
                if start != "complete" and what != "same settings":
                    continue  # an interrupted folder is only ever continued, a new one prepared
                root = tmp_path / f"{name}-{start}-{what.replace(' ', '_')}"
                copy_folder(sandbox / start, root)
                make_hostile(root / name, kind, sandbox)
                entry = describe(root / name)
                said = outcome(lambda: call(root))
                case = (name, kind, start, what, said)
                assert said == "ok" or str(root / name) in said or f"did not write ({name})" in said, case
                refused += said != "ok"
                # Nothing reached the user's files; the hostile entry is as it was, or a link or special file
                # under a name the library writes or removes is replaced by its file or removed, as itself.
                assert (sandbox / "user.txt").read_bytes() == USER_FILE, case
                assert sorted(p.name for p in (sandbox / "user_dir").iterdir()) == ["keep.txt"], case
                assert (sandbox / "user_dir" / "keep.txt").read_bytes() == USER_FILE, case
                now = describe(root / name) if os.path.lexists(root / name) else None
                assert now == entry or kind != "folder" and now in (None, (stat.S_IFREG, 0)), (*case, now)
    assert refused >= len(NAMES), refused


def test_links_to_the_users_files_are_never_written_through(folders, tmp_path):
    # prepare.lock, meta.json.tmp and progress.json.tmp linked to a file of the user's, in a folder the library
    # prepared, then prepared again with other settings (which rewrites those three).
    sandbox, settings = folders
    for name in ("prepare.lock", "meta.json.tmp", "progress.json.tmp"):
        root = tmp_path / name
        copy_folder(sandbox / "complete", root)
        (root / name).unlink(missing_ok=True)
        (root / name).symlink_to(sandbox / "user.txt")
        said = outcome(lambda: prepare_data(root, PrepareSettings(**{**settings, "val_fraction": 0.2}),
                                            show_progress=False))
        assert said == (f"{root / name}: a symbolic link where this library expects a regular file; refusing to "
                        "use it (move it away)"), said
        assert (sandbox / "user.txt").read_bytes() == USER_FILE


# ---------------------------------------------------------------- a Hugging Face dataset folder's own records

# Values planted where a dataset folder's records name its data: files elsewhere (absolute, ../, through a link
# inside the folder and back up), globs reaching out, the folder itself or its parent, URLs; and two that name the
# folder's own file, which must prepare.
HOSTILE_DATA_PATHS = ["{outside}", "../outside.parquet", "../*.parquet", "../**", "link/../inside.parquet", "/", "..",
                      "", "**/../../*.parquet", "~/inside.parquet", "https://example.com/inside.parquet",
                      "hf://datasets/org/name/inside.parquet", "inside.parquet", "./inside.parquet"]
DATASET_RECORDS = ["README.md data_files", "README.md data_dir", "state.json _data_files", "dataset_dict.json splits"]


def hostile_dataset(case: Path, record: str, value: str) -> Path:
    """case/ds, a dataset folder of 20 rows whose record names `value`; beside it case/outside.parquet (70 other
    rows) and case/deep/inside.parquet (a copy of those), where ds/link/.. leads."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    inside, outside = make_documents(20, seed=5), make_documents(70, seed=6)
    (case / "deep" / "dir").mkdir(parents=True)
    pq.write_table(pa.table({"text": outside}), case / "outside.parquet")
    pq.write_table(pa.table({"text": outside}), case / "deep" / "inside.parquet")
    folder = case / "ds"
    value = value.replace("{outside}", str(case / "outside.parquet"))
    if record.startswith("README"):
        folder.mkdir()
        pq.write_table(pa.table({"text": inside}), folder / "inside.parquet")
        if "link/" in value:
            (folder / "link").symlink_to(case / "deep" / "dir")
        key = "data_files:\n  - split: train\n    path" if record.endswith("data_files") else "data_dir"
        (folder / "README.md").write_text(f"---\nconfigs:\n- config_name: default\n  {key}: {json.dumps(value)}\n---\n")
    elif record.startswith("state.json"):
        datasets.Dataset.from_dict({"text": inside}).save_to_disk(str(folder))
        state = json.loads((folder / "state.json").read_text())
        state["_data_files"][0]["filename"] = value
        (folder / "state.json").write_text(json.dumps(state))
    else:
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": inside})}).save_to_disk(str(folder))
        (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train", value]}))
    return folder


def test_hostile_paths_in_a_dataset_folder_read_nothing_outside_it(folders, tmp_path):
    # Each one DataError line, or prepared from the folder's own 20 rows and nothing else; never a hang.
    from data.settings import HFDatasetConfig

    sandbox, settings = folders
    outcomes = []
    for r, record in enumerate(DATASET_RECORDS):
        for v, value in enumerate(HOSTILE_DATA_PATHS):
            case = tmp_path / f"{r}-{v}"
            folder = hostile_dataset(case, record, value)
            hf = PrepareSettings(**{**settings, "files": (), "shard_tokens": 10**6},
                                 hf_dataset=HFDatasetConfig(str(folder)))
            said = outcome(lambda: prepare_data(case / "out", hf, show_progress=False))  # noqa: B023 - called here
            if said == "ok":
                meta = json.loads((case / "out" / "meta.json").read_text())
                assert meta["num_train_documents"] + meta["num_val_documents"] == 20, (record, value)
            else:
                assert str(folder) in said and not (case / "out").exists(), (record, value, said)
            outcomes.append((record, value, said))
    ok = [(record, value) for record, value, said in outcomes if said == "ok"]
    # The folder's own file, named plainly in the README, prepares; every name reaching out is refused.
    assert {("README.md data_files", "inside.parquet"), ("README.md data_files", "./inside.parquet")} <= set(ok), ok
    assert not [case for case in ok if "outside" in case[1] or ".." in case[1] or case[1].startswith("/")], ok


@pytest.mark.parametrize("kind", ["FIFO", "device", "sparse", "damaged"])
def test_a_hostile_tokenizer_model_is_one_line_before_any_work(folders, tmp_path, capsys, kind):
    """data.tokenizer_model: a FIFO or /dev/zero was called "not found" (and copied, /dev/zero, without end), a
    sparse 20 GiB file was copied whole, a piece of invalid UTF-8 was a UnicodeDecodeError traceback. Each is one
    line saying what it is, before the corpus is read; the same file in a prepared folder is refused as it is read."""
    from scripts import prepare_data as prepare_script
    from tests.helpers import ROOT
    from tests.test_hostile_paths import damaged_tokenizer

    sandbox, settings = folders
    given = tmp_path / "given.model"
    if kind == "sparse":
        with given.open("wb") as f:
            f.truncate(20 << 30)
    elif kind == "damaged":
        damaged_tokenizer(given)
    else:
        make_hostile(given, kind, sandbox)
    says = {"FIFO": "a FIFO, not a regular file", "device": "a device, not a regular file",
            "sparse": "more than 67,108,864 bytes, more than a tokenizer file ever holds",
            "damaged": "a piece of it is not valid UTF-8 text"}[kind]
    codes = []
    assert outcome(lambda: codes.append(prepare_script.main([
        str(ROOT / "config/train_tiny_fsdp.yaml"), f"--data.files=[{settings['files'][0]}]", "--data.num_workers=0",
        f"--data.tokenizer_model={given}", f"--data.dataset_dir={tmp_path / 'out'}"]))) == "ok"
    err = capsys.readouterr().err
    assert codes == [1] and err.startswith("error: ") and err.count("\n") == 1, err
    assert str(given) in err and says in err and not (tmp_path / "out").exists(), err
    if kind in ("sparse", "damaged"):  # such a file in a prepared folder: read by its hash, when the folder is opened
        root = tmp_path / "complete"
        copy_folder(sandbox / "complete", root)
        os.replace(given, root / "tokenizer.model")
        said = outcome(lambda: load_prepared(root))
        assert str(root / "tokenizer.model") in said and ("is not the tokenizer" in said if kind == "damaged" else
                                                          says in said), said
