"""safe_io/nofollow.py, the one set of no-follow rules of the run's output directory and of a prepared data
folder: a file is opened only if it is a regular file (anything else refused in one line and left as it is); a
name written anew or removed has what stands there replaced or removed as itself, never what a link leads to;
a folder goes only where the caller keeps one."""
from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest

from data import DataError, PrepareSettings, load_prepared, prepare_data
from fsdp_utils.checkpoint.checksums import install_full, save_with_checksum, write_record
from safe_io import nofollow
from scripts import prepare_data as prepare_script
from tests.helpers import ROOT, failing_after
from tests.test_data import make_documents
from tests.test_prepare import stopped_after

USERS = "the user's own"


def users_folder(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text(USERS)


def hostile(path: Path, kind: str, elsewhere: Path) -> None:
    """A `kind` at `path`; a link leads to the user's file or folder in `elsewhere`."""
    if kind == "link to a file":
        (elsewhere / "file").write_text(USERS)
        path.symlink_to(elsewhere / "file")
    elif kind == "link to a folder":
        users_folder(elsewhere / "folder")
        path.symlink_to(elsewhere / "folder")
    elif kind == "broken link":
        path.symlink_to(elsewhere / "nothing")
    else:
        os.mkfifo(path)


def elsewhere_intact(elsewhere: Path) -> bool:
    return all(p.read_text() == USERS for p in elsewhere.rglob("*") if p.is_file())


def expect_refusal(call: Callable[[], object], path: Path, what: str) -> None:
    with pytest.raises(nofollow.UnsafePath) as caught:
        call()
    assert str(caught.value) == f"{path}: {what}; refusing to use it (move it away)"


KINDS = ["link to a file", "link to a folder", "broken link", "FIFO"]
WRITES: dict[str, Callable[[Path], object]] = {
    "remove": lambda path: nofollow.remove(path),
    "create": lambda path: nofollow.create(path).close(),
    "replace_file": lambda path: nofollow.replace_file(path, b"new"),
    "replace": lambda path: (path.with_name("staged").write_bytes(b"new"),
                             nofollow.replace(path.with_name("staged"), path)),
    "replace a folder": lambda path: (path.with_name("staged").mkdir(),
                                      nofollow.replace(path.with_name("staged"), path, folder_ok=True)),
}
READS: dict[str, Callable[[Path], object]] = {
    "read_small": lambda path: nofollow.read_small(path, limit=100),
    "open_append": lambda path: nofollow.open_append(path).close(),
    "open_fd": lambda path: os.close(nofollow.open_fd(path, os.O_RDWR | os.O_CREAT)),
    "truncate": lambda path: nofollow.truncate(path, 0),
    "check": lambda path: nofollow.check(path),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("operation", list(WRITES))
def test_a_name_written_anew_or_removed_replaces_a_link_or_fifo_as_itself(tmp_path, kind, operation):
    elsewhere, path = tmp_path / "elsewhere", tmp_path / "run" / "name"
    elsewhere.mkdir()
    path.parent.mkdir()
    hostile(path, kind, elsewhere)
    WRITES[operation](path)
    assert elsewhere_intact(elsewhere) and sorted(p.name for p in elsewhere.iterdir()) == sorted(
        {"link to a file": ["file"], "link to a folder": ["folder"]}.get(kind, []))
    assert not path.is_symlink() and (not path.exists() if operation == "remove" else path.exists())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("operation", list(READS))
def test_a_file_opened_in_place_is_refused_and_left_as_it_is(tmp_path, kind, operation):
    elsewhere, path = tmp_path / "elsewhere", tmp_path / "name"
    elsewhere.mkdir()
    hostile(path, kind, elsewhere)
    before = os.lstat(path)
    words = "a FIFO" if kind == "FIFO" else "a symbolic link"
    expect_refusal(lambda: READS[operation](path), path, f"{words} where this library expects a regular file")
    assert os.lstat(path) == before and elsewhere_intact(elsewhere)


@pytest.mark.parametrize("operation", ["remove", "create", "replace_file", "replace", "read_small", "open_fd"])
def test_a_folder_where_a_file_goes_is_refused_and_kept(tmp_path, operation):
    path = tmp_path / "name"
    users_folder(path)
    expect_refusal(lambda: {**WRITES, **READS}[operation](path), path,
                   "a folder where this library expects a regular file")
    assert (path / "notes.txt").read_text() == USERS


def test_a_folder_goes_only_where_the_caller_keeps_one(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "link").symlink_to(tmp_path / "users")
    users_folder(tmp_path / "users")
    nofollow.remove(tmp_path / "folder", folder_ok=True)
    assert not (tmp_path / "folder").exists() and (tmp_path / "users" / "notes.txt").read_text() == USERS
    assert nofollow.check(tmp_path / "users", folder_ok=True) and not nofollow.check(tmp_path / "nothing")


@pytest.mark.parametrize("name", [".tmp-fsdp_cpt1.pth", ".fsdp_cpt1.pth.json"])
def test_a_checkpoint_tool_never_deletes_a_folder_at_a_name_it_writes(tmp_path, name):
    # A tool's output (convert_checkpoint.py, import_hf.py) writes outside the run's journal: a folder of the
    # user's at the temporary name or at the checksum record's name is refused, never removed with its files.
    users_folder(tmp_path / name)
    final = tmp_path / "fsdp_cpt1.pth"
    if name.startswith(".tmp-"):
        call: Callable[[], object] = lambda: save_with_checksum({"w": 1}, tmp_path / name)  # noqa: E731
    else:  # the tools install the new file, whose old checksum record goes first, then write the new record
        (tmp_path / ".tmp-fsdp_cpt1.pth").write_bytes(b"a checkpoint")
        call = lambda: install_full(tmp_path / ".tmp-fsdp_cpt1.pth", final)  # noqa: E731
    expect_refusal(call, tmp_path / name, "a folder where this library expects a regular file")
    assert (tmp_path / name / "notes.txt").read_text() == USERS
    if name.endswith(".json"):  # and the new record is not renamed over it either
        expect_refusal(lambda: write_record(final, {"size": 1, "crc32": "00000000"}), tmp_path / name,
                       "a folder where this library expects a regular file")
        assert (tmp_path / name / "notes.txt").read_text() == USERS


def test_the_refusal_is_one_line_with_the_path_as_its_filename(tmp_path):
    err = nofollow.refusal(tmp_path / "x", "a FIFO")
    assert isinstance(err, OSError) and err.filename == str(tmp_path / "x") and err.errno is None
    assert str(err) == f"{err.filename}: {err.strerror}" and "\n" not in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is nofollow.UnsafePath and str(again) == str(err)


def test_a_capped_read_reads_no_more_than_its_bound_whatever_the_size_says(tmp_path):
    """/proc's files say 0 bytes and hold more (a file may also grow while read): a bound checked against the size
    alone read all of it (or, trusting the size, nothing). A sparse file's size costs no disk (20 GiB here). Only a
    regular file is read: a FIFO, even through a link the user made, and a device are refused, never opened."""
    status = Path("/proc/self/status")
    assert status.stat().st_size == 0 and len(status.read_bytes()) > 100  # the premise
    with pytest.raises(nofollow.UnsafePath) as caught:
        nofollow.read_capped(status, limit=100, follow_links=True)
    assert str(caught.value) == f"{status}: more than 100 bytes, more than such a file ever holds"
    assert nofollow.read_capped(status, limit=1 << 20, follow_links=True).startswith(b"Name:")
    sparse = tmp_path / "sparse.json"
    with sparse.open("wb") as f:
        f.truncate(20 << 30)
    with pytest.raises(nofollow.UnsafePath, match="more than 1,048,576 bytes, more than a record ever holds"):
        nofollow.read_capped(sparse, limit=1 << 20, what="a record")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    with failing_after(10):
        for path, what in ((tmp_path / "link", "a FIFO"), (Path("/dev/zero"), "a device")):
            with pytest.raises(nofollow.UnsafePath) as caught:
                nofollow.read_capped(path, limit=100, follow_links=True)
            assert str(caught.value) == f"{path}: {what}, not a regular file"
        expect_refusal(lambda: nofollow.read_capped(tmp_path / "link", limit=100), tmp_path / "link",
                       "a symbolic link where this library expects a regular file")
    (tmp_path / "small").write_bytes(b"x" * 100)
    assert nofollow.read_capped(tmp_path / "small", limit=100) == b"x" * 100


# ---- the prepared data folder under the same rules ---------------------------------------------------------


@pytest.fixture
def interrupted(tmp_path) -> tuple[Path, PrepareSettings]:
    """A folder whose preparation stopped after one shard, and the settings to continue it."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_documents(120, seed=4)))
    settings = PrepareSettings(files=(str(corpus),), vocab_size=320, num_workers=0, val_fraction=0.1,
                               shard_tokens=500)
    with stopped_after(1):
        prepare_data(tmp_path / "prepared", settings, show_progress=False)
    return tmp_path / "prepared", settings


def test_a_link_at_a_recorded_leftover_name_is_removed_as_itself(interrupted, tmp_path):
    # Continuing an interrupted preparation removes the leftovers its records name (a .tmp shard, the tokenizer's
    # .tmp): a link planted there goes, what it leads to stays.
    root, settings = interrupted
    names = ["train-00000.bin.tmp", "tokenizer.model.tmp"]
    assert set(names) <= set(json.loads((root / "progress.json").read_text())["files"])
    (tmp_path / "users.bin").write_text(USERS)
    for name in names:
        (root / name).unlink(missing_ok=True)
        (root / name).symlink_to(tmp_path / "users.bin")
    prepared = prepare_data(root, settings, show_progress=False)
    assert (tmp_path / "users.bin").read_text() == USERS and not any(os.path.lexists(root / n) for n in names)
    assert load_prepared(root).num_train_tokens == prepared.num_train_tokens > 0


def test_a_refused_data_path_is_one_data_error_line_and_one_error_line_of_the_script(interrupted, tmp_path, capsys):
    root, settings = interrupted
    (root / "prepare.lock").unlink()
    os.mkfifo(root / "prepare.lock")
    line = (f"{root / 'prepare.lock'}: a FIFO where this library expects a regular file; refusing to use it "
            "(move it away)")
    with pytest.raises(DataError) as caught:
        prepare_data(root, settings, show_progress=False)
    assert str(caught.value) == line
    code = prepare_script.main([str(ROOT / "config/train_tiny_fsdp.yaml"), f"--data.files=[{settings.files[0]}]",
                                "--data.vocab_size=320", "--data.num_workers=0", f"--data.dataset_dir={root}"])
    assert (code, capsys.readouterr().err.strip().splitlines()) == (1, [f"error: {line}"])


def test_a_unique_new_file_is_removed_only_while_it_is_the_very_file_made(tmp_path):
    (tmp_path / ".tmp-x.").symlink_to(tmp_path / "users")
    first, f = nofollow.open_unique(tmp_path, ".tmp-x.")
    second, g = nofollow.open_unique(tmp_path, ".tmp-x.")
    with f, g:
        f.write(b"ours")
        made_first, made_second = os.fstat(f.fileno()), os.fstat(g.fileno())
    assert first != second and first.name.startswith(".tmp-x.") and not (tmp_path / "users").exists()
    first.unlink()
    first.write_bytes(b"another writer's, at that name since")
    nofollow.remove_made(first, made_first)
    nofollow.remove_made(second, made_second)
    assert first.read_bytes() == b"another writer's, at that name since" and not second.exists()
    assert (tmp_path / ".tmp-x.").is_symlink()


# ---- hard links: a file written in place has one name -------------------------------------------------------


def hard_linked(tmp_path: Path) -> tuple[Path, Path]:
    """A file of the user's elsewhere, and a second name of it where the library writes (a `cp -al` copy)."""
    (tmp_path / "elsewhere").mkdir()
    users, path = tmp_path / "elsewhere" / "file", tmp_path / "name"
    users.write_text(USERS)
    os.link(users, path)
    return users, path


IN_PLACE: dict[str, Callable[[Path], object]] = {
    "open_append": lambda path: nofollow.open_append(path).close(),
    "open_fd read-write": lambda path: os.close(nofollow.open_fd(path, os.O_RDWR | os.O_CREAT)),
    "open_fd truncating": lambda path: os.close(nofollow.open_fd(path, os.O_WRONLY | os.O_TRUNC)),
    "truncate": lambda path: nofollow.truncate(path, 0),
}


@pytest.mark.parametrize("operation", list(IN_PLACE))
def test_a_file_with_other_hard_links_is_never_written_in_place(tmp_path, operation):
    users, path = hard_linked(tmp_path)
    with pytest.raises(nofollow.SharedFile) as caught:
        IN_PLACE[operation](path)
    assert str(caught.value) == (f"{path}: a file with 2 hard links where this library writes in place (another name "
                                 "shares its contents, which writing here would change); refusing to write to it "
                                 "(move it away)")
    assert users.read_text() == USERS and os.stat(path).st_ino == os.stat(users).st_ino


def test_an_appended_file_with_other_hard_links_goes_on_in_a_copy_of_its_own(tmp_path):
    users, path = hard_linked(tmp_path)
    os.chmod(users, 0o600)
    with nofollow.open_append(path, copy_if_shared=True) as f:
        f.write("the run's row\n")
    assert users.read_text() == USERS and path.read_text() == USERS + "the run's row\n"
    assert os.stat(users).st_nlink == os.stat(path).st_nlink == 1 and os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "name"]  # no copy left beside it


def test_a_lock_file_with_other_hard_links_is_replaced_by_one_of_its_own_held_from_the_start(tmp_path):
    import fcntl

    users, path = hard_linked(tmp_path)
    lock = nofollow.lock_file(path, holder="host h, pid 1")
    try:
        assert users.read_text() == USERS and path.read_text() == "host h, pid 1\n"
        assert os.stat(path).st_ino != os.stat(users).st_ino and os.stat(users).st_nlink == 1
        with pytest.raises(nofollow.LockHeld) as held:  # the new file is the lock
            nofollow.lock_file(path, holder="another")
        assert held.value.holder == "host h, pid 1"
        with open(users) as f:  # and the user's file is free
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(lock.fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "name"]


def test_a_lock_file_removed_while_it_was_waited_for_is_taken_anew(tmp_path):
    # The holder removes its lock file as it lets go (a run that trained nothing removes the folder it made): the
    # waiter locked the removed file, which locks nothing, so it takes the file now at that name.
    path = tmp_path / "run.lock"
    first = nofollow.lock_file(path, holder="first")
    waits: list[str] = []

    def wait(holder: str) -> bool:
        waits.append(holder)
        path.unlink()
        os.close(first.fd)
        return True

    second = nofollow.lock_file(path, holder="second", wait=wait)
    try:
        assert waits == ["first"] and second.waited and path.read_text() == "second\n"
        assert os.fstat(second.fd).st_ino == os.stat(path).st_ino
    finally:
        os.close(second.fd)


def test_a_hard_linked_prepare_lock_is_replaced_and_the_users_file_kept(interrupted, tmp_path):
    root, settings = interrupted
    (tmp_path / "users.txt").write_text(USERS)
    (root / "prepare.lock").unlink()
    os.link(tmp_path / "users.txt", root / "prepare.lock")
    prepared = prepare_data(root, settings, show_progress=False)
    assert (tmp_path / "users.txt").read_text() == USERS and os.stat(tmp_path / "users.txt").st_nlink == 1
    assert load_prepared(root).num_train_tokens == prepared.num_train_tokens > 0
