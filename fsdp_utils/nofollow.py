"""Files and folders of a run's output directory opened, made and removed without following symbolic links.

Whatever the run writes or deletes there goes through these functions. A symbolic link, a FIFO or a device
where the run expects its own file or folder is refused with one line naming the path (`UnsafePath`):
writing through a link changes a file the run does not own, and opening a FIFO or a device can block or
never end. Removing a link removes the link alone. Standard library only, so that any package can use it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO, TextIO


class UnsafePath(OSError):
    """A path of the run that is a link or not the kind of file expected; the message is one line naming it."""


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, in words."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                        (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return words
    return "a file"


def refusal(path: Path | str, what: str, *, expected: str = "a regular file") -> UnsafePath:
    """The error for `path` being `what` (a symbolic link, a FIFO, ...) where `expected` belongs."""
    return UnsafePath(f"{path}: {what} where the run expects {expected}; refusing to use it (move it away)")


def open_fd(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """os.open of a regular file that is not a link (O_NOFOLLOW), without blocking on a FIFO; UnsafePath
    for anything else. The descriptor is blocking again when returned."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO without a reader, a folder
            try:
                what = kind_of(os.lstat(path).st_mode)
            except OSError:
                raise err from None
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


def read_small(path: Path | str, *, limit: int) -> bytes:
    """The bytes of a regular file (not a link) of at most `limit` bytes, its size known before reading."""
    fd = open_fd(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafePath(f"{path}: {size:,} bytes, more than such a file ever holds ({limit:,})")
        return f.read(size)


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


def remove(path: Path | str) -> None:
    """Remove a file or a folder if there; a link is removed itself, never what it points to."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)  # removes the links it meets inside, never their targets
    else:
        os.unlink(path)


# ---- small record files and results logs ---------------------------------------------------------------


def replace_file(path: Path, data: bytes) -> None:
    """`path` holds `data`, or (interrupted) what it held before. The bytes go to .tmp-<name> beside it (what
    was left there removed, a link as itself; the new file opened exclusively), which is then renamed over
    `path`: a link there is replaced, never written through. A folder at either name is refused (UnsafePath)."""
    tmp = path.with_name(f".tmp-{path.name}")
    for name in (tmp, path):
        try:
            if stat.S_ISDIR(os.lstat(name).st_mode):
                raise refusal(name, "a folder")
        except FileNotFoundError:
            pass
    remove(tmp)
    with open_new(tmp) as f:
        f.write(data)
    os.replace(tmp, path)


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
