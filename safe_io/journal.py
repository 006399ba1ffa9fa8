"""The journal of a run's own files in its output directory: what the run made there (checkpoints, its config, the
tokenizer copy, the micro-batch record, ...), and therefore what it may replace or delete. Only what the journal
records is ever removed or replaced: never a file or folder of the user's that has the name of one of the run's.

`.checkpoint_journal.jsonl`, one JSON object a line, appended and fsynced by rank 0:
{"made": name, "dev", "ino", "kind"} once the run has created a file or folder (before any data goes in),
{"sealed": name, "dev", "ino", "kind", "mtime_ns", "size"} once it has written all of it, {"renamed": name, "to": name}
before it renames one, {"removed": name} once it has removed one. A path is the run's own while the journal names
it with the file it is now: the same device, inode and kind (a name alone proves nothing), and once sealed the
same modification time and size too (a file written over in place, or a new one that reuses the inode, is not the
run's). Whatever else stands where the run must write is moved aside as `kept-<name>` (never loaded, never
deleted) with a warning.
Plain filesystem code without a process group: rank 0 runs it.
"""
from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from . import nofollow

log = logging.getLogger(__name__)

T = TypeVar("T")

JOURNAL_NAME = ".checkpoint_journal.jsonl"
TMP_PREFIX = ".tmp-"  # a write in progress under the name it will have: never read, removed by the next save
KEPT_PREFIX = "kept-"  # moved aside for being in the run's way without being its own: never loaded or deleted
_LIMIT = 1 << 30  # bytes: a journal of millions of saves; a larger file is not one


class Journal:
    """The journal of the output directory `directory` (read again wherever it grew since the last look)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.path = self.dir / JOURNAL_NAME
        self._entries: dict[str, tuple] = {}  # name -> identity (_identity) of what the run made there
        self._read = 0  # bytes of the file applied to _entries (its whole lines)
        self._size = 0  # bytes of the file when last read (more than _read: a line torn by a crash)

    # ---- reading ----------------------------------------------------------------------------------
    def _refresh(self) -> dict[str, tuple]:
        try:
            fd = nofollow.open_fd(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self._entries, self._read, self._size = {}, 0, 0
            return self._entries
        with os.fdopen(fd, "rb") as f:
            size = self._size = os.fstat(fd).st_size
            if size > _LIMIT:
                raise nofollow.UnsafePath(self.path, f"{size:,} bytes, more than a checkpoint journal holds")
            if size < self._read:  # replaced by another file: read it whole
                self._entries, self._read = {}, 0
            f.seek(self._read)
            data = f.read(size - self._read)
        whole = data[:data.rfind(b"\n") + 1]  # a line torn by a crash mid-append is not applied
        self._read += len(whole)
        for line in whole.splitlines():
            self._apply(line)
        return self._entries

    def _apply(self, line: bytes) -> None:
        try:
            entry = json.loads(line)
            if "made" in entry or "sealed" in entry:
                name = entry.get("made", entry.get("sealed"))
                ident = (int(entry["dev"]), int(entry["ino"]), int(entry["kind"]),
                         *((int(entry["mtime_ns"]), int(entry["size"])) if "sealed" in entry else ()))
                if _in_directory(name):
                    self._entries[name] = ident
            elif "renamed" in entry and entry["renamed"] in self._entries and _in_directory(entry["to"]):
                self._entries[entry["to"]] = self._entries.pop(entry["renamed"])
            elif "removed" in entry:
                self._entries.pop(entry["removed"], None)
        except (ValueError, TypeError, KeyError, AttributeError):  # not a line this journal writes: it proves nothing
            return

    def owns(self, path: Path) -> bool:
        """Whether `path` (in the output directory) is the very file or folder the run's saves made there."""
        ident = self._refresh().get(path.name) if path.parent.resolve() == self.dir.resolve() else None
        if ident is None:
            return False
        try:
            now = _identity(os.lstat(path))
        except FileNotFoundError:
            return False
        return now[:len(ident)] == ident

    def own_names(self, prefix: str = "") -> list[str]:
        """Names the journal records as the run's own that start with `prefix` (each may be gone since)."""
        return sorted(name for name in self._refresh() if name.startswith(prefix))

    # ---- writing ----------------------------------------------------------------------------------
    def _append(self, entry: dict) -> None:
        self._refresh()
        line = json.dumps(entry) + "\n"
        torn = self._size > self._read  # a line a crash cut short: this one starts on a line of its own
        # A journal with other hard links (a copied output directory) gets a copy of its own: the copy's records
        # go on in the copy only.
        with nofollow.open_append(self.path, copy_if_shared=True) as f:
            f.write("\n" * torn + line)
            f.flush()
            os.fsync(f.fileno())
        self._read = self._size = self._size + torn + len(line.encode())
        self._apply(line.encode())

    def made(self, path: Path) -> None:
        """Record `path` (just created by a save, still empty) as the run's own."""
        dev, ino, kind, _, _ = _identity(os.lstat(path))
        self._append({"made": path.name, "dev": dev, "ino": ino, "kind": kind})

    def seal(self, path: Path) -> None:
        """Record the run's own `path` as a save left it, once all of it is written."""
        dev, ino, kind, mtime_ns, size = _identity(os.lstat(path))
        self._append({"sealed": path.name, "dev": dev, "ino": ino, "kind": kind, "mtime_ns": mtime_ns, "size": size})

    def create_file(self, path: Path) -> BinaryIO:
        """A new file at `path`, recorded as the run's own before anything is written to it; what stood there is
        removed if the run's own, else kept aside."""
        self.clear(path)
        f = nofollow.open_new(path)
        try:
            self.made(path)
        except BaseException:
            f.close()
            raise
        return f

    def write_file(self, path: Path, write: Callable[[BinaryIO], T]) -> T:
        """A new file at `path` (see create_file) that `write` fills, sealed once closed; returns what `write`
        returned."""
        with self.create_file(path) as f:
            result = write(f)
        self.seal(path)
        return result

    def install_file(self, final: Path, write: Callable[[BinaryIO], T]) -> T:
        """`final` made anew, recorded as the run's own, with what `write` writes: into a new file of a unique `.tmp-`
        name beside it (created exclusively, recorded before anything goes in: an interrupted write leaves a leftover
        the next save removes), sealed, then renamed into place. What stood at `final` is replaced if the run's own,
        else kept aside (see keep_foreign)."""
        tmp, f = nofollow.open_unique(self.dir, f"{TMP_PREFIX}{final.name}.")
        with f:
            try:
                self.made(tmp)
            except BaseException:
                nofollow.remove_made(tmp, os.fstat(f.fileno()))
                raise
            result = write(f)
        self.seal(tmp)
        self.keep_foreign(final, why=f"the run's {final.name}")
        self.rename(tmp, final)
        return result

    def create_dir(self, path: Path) -> None:
        """A new, empty folder at `path`, recorded as the run's own (what stood there: as for create_file)."""
        self.clear(path)
        os.mkdir(path)  # never through a link: mkdir fails on whatever is there
        self.made(path)

    def rename(self, src: Path, dst: Path) -> None:
        """os.replace(src, dst), recorded first: whatever happens between, dst is the run's own only if it is src."""
        self._append({"renamed": src.name, "to": dst.name})
        try:
            os.replace(src, dst)
        except BaseException:
            self._append({"renamed": dst.name, "to": src.name})
            raise

    def remove(self, path: Path) -> bool:
        """Remove `path` (a file or a folder) if it is the run's own; whether it was."""
        if not self.owns(path):
            return False
        nofollow.remove(path, folder_ok=True)
        self._append({"removed": path.name})
        return True

    def keep_foreign(self, path: Path, *, why: str, along: Path | None = None) -> None:
        """Move whatever stands at `path` and is not the run's own aside as `kept-<name>` (with `along`, its
        checksum record, unless that is the run's own), with a warning saying `why` it was in the way; the run's
        own stays."""
        if not os.path.lexists(path) or self.owns(path):
            return
        target = set_aside(path, KEPT_PREFIX, journal=self, along=along)
        log.warning("%s is in the way of %s and is not something this run made (%s does not record it): "
                    "kept as %s, never loaded or deleted automatically", path.name, why, JOURNAL_NAME, target.name)

    def clear(self, path: Path, *, why: str = "a save") -> None:
        """Nothing at `path` after: the run's own removed, anything else kept aside (see keep_foreign)."""
        self.keep_foreign(path, why=why)
        self.remove(path)


def set_aside(path: Path, prefix: str, *, journal: Journal, along: Path | None = None) -> Path:
    """Rename `path` to `prefix` + its name, numbered so that nothing is overwritten, and `along` (a file named
    after it, `.{name}.json`) with it unless that is the run's own and `path` is not; returns the new path."""
    target, n = path.with_name(prefix + path.name), 1
    while os.path.lexists(target):
        n += 1
        target = path.with_name(f"{prefix}{n}-{path.name}")
    moves = [(path, target)]
    if along is not None and os.path.lexists(along) and not (journal.owns(along) and not journal.owns(path)):
        moves.append((along, along.with_name(along.name.replace(path.name, target.name, 1))))
    for src, dst in moves:
        journal.rename(src, dst)
    return target


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """(device, inode, kind, modification time, size) of a file or folder (a folder's size is 0: the size of its
    listing varies)."""
    kind = stat.S_IFMT(st.st_mode)
    return st.st_dev, st.st_ino, kind, st.st_mtime_ns, 0 if stat.S_ISDIR(st.st_mode) else st.st_size


def _in_directory(name: object) -> bool:
    """A name of an entry of the output directory itself (no path: nothing that leads out of it)."""
    return isinstance(name, str) and os.path.basename(name) == name and name not in ("", ".", "..") and "\0" not in name
