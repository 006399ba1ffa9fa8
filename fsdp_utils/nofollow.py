"""Files and folders the library keeps (a run's output directory, a prepared data folder) opened, made, replaced
and removed without following symbolic links.

Whatever the library writes, reads or deletes there goes through these functions, under one rule:
- A file is opened only if it is a regular file: a symbolic link, a FIFO, a device, a socket or a folder there is
  refused with one line naming the path (`UnsafePath`) and left as it is. Writing through a link changes a file
  the library does not own; opening a FIFO or a device can block or never end.
- A name the library writes anew (a new file, a file renamed into place) or removes has what stands there
  replaced or removed as itself: a link, never what it leads to. A folder is removed only where the caller keeps
  a folder; anywhere else it may hold the user's files, and is refused and left as it is.
Entries are checked with lstat, then opened with O_NOFOLLOW and O_NONBLOCK, so that one swapped in after the check
is refused too. Standard library only, so that any package can use it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import BinaryIO, TextIO


class UnsafePath(OSError):
    """A path the library keeps that is not the kind of file expected, or not one it can read. `filename` is the
    path and `strerror` why, so that the message is the one line `<path>: <why>`."""

    def __init__(self, path: Path | str, why: str):
        super().__init__(None, why, str(path))

    def __reduce__(self):
        return type(self), (self.filename, self.strerror)

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, in words."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                        (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return words
    return "a file"


def kind_at(path: Path | str) -> str | None:
    """What is at `path` itself (a link is not followed), in words ("a file", "a folder", "a symbolic link", ...);
    None if nothing."""
    try:
        return kind_of(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


def refusal(path: Path | str, what: str, *, expected: str = "a regular file") -> UnsafePath:
    """The error for `path` being `what` (a symbolic link, a FIFO, ...) where `expected` belongs."""
    return UnsafePath(path, f"{what} where this library expects {expected}; refusing to use it (move it away)")


def check(path: Path | str, *, folder_ok: bool = False) -> bool:
    """Whether something is at `path`: a regular file (or, with folder_ok, a folder); anything else is refused."""
    kind = kind_at(path)
    if kind not in (None, "a file", "a folder" if folder_ok else "a file"):
        raise refusal(path, kind, expected="a regular file or a folder" if folder_ok else "a regular file")
    return kind is not None


def open_fd(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """os.open of a regular file that is not a link (O_NOFOLLOW), without blocking on a FIFO; UnsafePath for
    anything else, which is never opened where lstat sees it first. The descriptor is blocking again when
    returned."""
    check(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO without a reader, a folder
            what = kind_at(path)
            if what is not None:
                raise refusal(path, what) from None
        raise
    try:
        mode_now = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode_now):
            raise refusal(path, kind_of(mode_now))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: Path | str) -> TextIO:
    """A text file opened for appending (created if missing), never through a link."""
    return open(path, "a", opener=lambda name, _: open_fd(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT))


def open_new(path: Path | str) -> BinaryIO:
    """A new binary file for writing: O_EXCL, so nothing that exists there (file, link) is ever opened."""
    return open(path, "wb", opener=lambda name, _: open_fd(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL))


def create(path: Path | str) -> BinaryIO:
    """A new binary file at `path` for writing, what stood there removed first (see `remove`)."""
    remove(path)
    return open_new(path)


def open_unique(folder: Path | str, prefix: str) -> tuple[Path, BinaryIO]:
    """A new binary file in `folder` named `prefix` and a random suffix, so that two writers (ranks, jobs) never
    meet at one name and nothing that stood there is opened or removed (see `open_new`); its path and the file."""
    for _ in range(100):
        path = Path(folder) / f"{prefix}{secrets.token_hex(6)}"
        try:
            return path, open_new(path)
        except (FileExistsError, UnsafePath):  # something is there already: another name
            continue
    raise FileExistsError(errno.EEXIST, f"no free name for a new file after 100 tries in {folder}", prefix)


def remove_made(path: Path | str, made: os.stat_result) -> None:
    """Remove the file at `path` if it is still the very file `made` describes (fstat of the file the caller created
    there, once written): the same device, inode, modification time and size. What another writer put at that
    name since, even on a reused inode, stays."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(now.st_mode) and _identity(now) == _identity(made):
        os.unlink(path)


def written(f: BinaryIO) -> os.stat_result:
    """fstat of the file `f` as its writer leaves it, its buffer flushed first (for `remove_made`; should the flush
    fail, the error is the write's own and the caller's close raises it)."""
    try:
        f.flush()
    except (OSError, ValueError):
        pass
    return os.fstat(f.fileno())


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def read_small(path: Path | str, *, limit: int) -> bytes:
    """The bytes of a regular file (not a link) of at most `limit` bytes (see read_capped)."""
    return read_capped(path, limit=limit)


_READ_BLOCK = 1 << 20


def read_capped(path: Path | str, *, limit: int, follow_links: bool = False, what: str = "such a file") -> bytes:
    """The bytes of the regular file at `path`, UnsafePath in one line if it holds more than `limit` (`what` names
    the kind of file in that line). At most limit + 1 bytes are ever read, whatever the file's size says: a sparse
    file's apparent size costs nothing on disk, a file may grow while read, and one of /proc says 0. Opened without
    blocking and checked with fstat, so that a FIFO or a device is refused, never read; a link is refused too (see
    open_fd), or with follow_links (a path the user named: a link is theirs to make) followed."""
    fd = _open_following(path) if follow_links else open_fd(path, os.O_RDONLY)
    chunks: list[bytes] = []
    with os.fdopen(fd, "rb", buffering=0) as f:
        too_large, num_bytes = os.fstat(fd).st_size > limit, 0  # a size past the bound: refused unread
        # In blocks: one read of limit + 1 bytes would take that much memory even for a file of a few bytes.
        while not too_large and (chunk := f.read(min(_READ_BLOCK, limit + 1 - num_bytes))):
            chunks.append(chunk)
            num_bytes += len(chunk)
            too_large = num_bytes > limit
    if too_large:
        raise UnsafePath(path, f"more than {limit:,} bytes, more than {what} ever holds")
    return b"".join(chunks)


def _open_following(path: Path | str) -> int:
    """A blocking descriptor for reading the regular file `path` leads to; UnsafePath naming anything else."""
    what = kind_of(os.stat(path).st_mode)  # first: a device is never opened (opening some has effects)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC) if what == "a file" else -1
    try:
        what = kind_of(os.fstat(fd).st_mode) if fd >= 0 else what  # what was opened, if swapped since the stat
        if what != "a file":
            raise UnsafePath(path, f"{what}, not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def truncate(path: Path | str, size: int) -> None:
    """Cut the regular file at `path` (never what a link leads to) to `size` bytes."""
    fd = open_fd(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def make_dir(path: Path | str) -> Path:
    """Create a folder (its parents too) if missing; UnsafePath if a link or anything but a folder is there."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a file or a broken link: said below
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise refusal(path, kind_of(mode), expected="a folder")
    return path


def remove(path: Path | str, *, folder_ok: bool = False) -> None:
    """Remove what is at `path`, if anything: a link itself, never what it leads to; a folder (with the links it
    holds, never their targets) only with folder_ok, else it is refused."""
    kind = kind_at(path)
    if kind == "a folder":
        if not folder_ok:
            raise refusal(path, kind)
        shutil.rmtree(path)
    elif kind is not None:
        os.unlink(path)


def replace(source: Path | str, target: Path | str, *, folder_ok: bool = False) -> None:
    """os.replace(source, target): what stands at target is replaced as itself (a link, never what it leads to);
    a folder there is replaced only with folder_ok (removed first), else refused."""
    if kind_at(target) == "a folder" or os.path.isdir(source) and not os.path.islink(source):
        remove(target, folder_ok=folder_ok)  # os.replace moves a folder only onto nothing or an empty folder
    os.replace(source, target)


# ---- small record files and results logs ---------------------------------------------------------------


def replace_file(path: Path, data: bytes, *, tmp: Path | None = None) -> None:
    """`path` holds `data`, or (interrupted) what it held before. The bytes go to `tmp` beside it (.tmp-<name>
    unless given; created anew, see `create`), which is then renamed over `path` (see `replace`). A folder at
    either name is refused, before anything is written."""
    tmp = path.with_name(f".tmp-{path.name}") if tmp is None else tmp
    for name in (tmp, path):
        if kind_at(name) == "a folder":
            raise refusal(name, "a folder")
    with create(tmp) as f:
        f.write(data)
    replace(tmp, path)


def results_log_problem(path: str | Path, *, option: str = "--json") -> str | None:
    """Why lines cannot be appended to the results log `path` (checked before the work whose results go there),
    or None: it must be a regular file (a link the user made to one is theirs to make) or a new name in an
    existing folder. A FIFO would block the append, a device or a folder is not a log."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        parent = Path(path).parent
        return None if parent.is_dir() else f"{option} {path}: the folder {parent} does not exist"
    except OSError as err:
        return f"{option} {path}: {err.strerror or err}"
    if not stat.S_ISREG(mode):
        return f"{option} {path}: {kind_of(mode)}, not a file to append results to"
    return None


def append_line(path: str | Path, line: str, *, option: str = "--json") -> None:
    """Append one line to the results log `path` (created if missing), opened without blocking: OSError in one
    line naming it for anything but a regular file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:  # a FIFO without a reader (ENXIO), a folder (EISDIR), a missing folder, ...
        raise OSError(results_log_problem(path, option=option) or f"{option} {path}: {err.strerror or err}") from None
    with os.fdopen(fd, "a") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"{option} {path}: {kind_of(mode)}, not a file to append results to")
        f.write(line + "\n")
