"""Files of the prepared folder, written, replaced, read and deleted without following links.

Where the library expects one of its own files, a symbolic link, FIFO, device or socket (or a folder where a
file belongs) is refused with one line naming it: never written through, never opened for reading (a FIFO
would block), never deleted. Entries are checked with lstat, and opened with O_NOFOLLOW and O_NONBLOCK so that
one swapped in after the check is refused too.
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import DataError

_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link"),
          (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "device"), (stat.S_ISBLK, "device"), (stat.S_ISSOCK, "socket"))
_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def kind_of(path: Path) -> str | None:
    """What is at path itself (a link is not followed): "file", "folder", "symbolic link", ...; None if nothing."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise DataError(f"cannot inspect {path}: {err.strerror or err}") from None
    return next((name for test, name in _KINDS if test(mode)), "special file")


def refuse(path: Path, kind: str) -> DataError:
    return DataError(f"{path} is a {kind}, not a file this library wrote: it is never written through, read or "
                     f"deleted; move it away or choose another data.dataset_dir")


def check(path: Path, *, folder_ok: bool = False) -> str | None:
    """The kind of path ("file", or "folder" with folder_ok), None if absent; anything else is refused."""
    kind = kind_of(path)
    if kind not in (None, "file", "folder" if folder_ok else "file"):
        raise refuse(path, kind)
    return kind


def _open(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open without following a link; the descriptor of a regular file, or one line."""
    try:
        fd = os.open(path, flags | _FLAGS, mode)
    except OSError:
        kind = kind_of(path)
        if kind not in (None, "file"):
            raise refuse(path, kind) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refuse(path, kind_of(path) or "special file")
    return fd


def open_file(path: Path, flags: int) -> int:
    """A descriptor of the regular file at path (created with os.O_CREAT in flags), never of what a link names."""
    check(path)
    return _open(path, flags)


def read_bytes(path: Path) -> bytes:
    check(path)
    with os.fdopen(_open(path, os.O_RDONLY), "rb") as file:
        return file.read()


def remove(path: Path, *, folder_ok: bool = False) -> None:
    """Delete the file (or, with folder_ok, the folder) at path; nothing there is fine."""
    kind = check(path, folder_ok=folder_ok)
    if kind == "folder":
        shutil.rmtree(path)
    elif kind == "file":
        path.unlink(missing_ok=True)


def create(path: Path) -> BinaryIO:
    """A new, empty file at path for writing, replacing an earlier file of that name (never a link)."""
    remove(path)
    return os.fdopen(_open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")


def replace(source: Path, target: Path, *, folder_ok: bool = False) -> None:
    """os.replace(source, target), where target may only be a file (or a folder with folder_ok) or nothing."""
    if check(target, folder_ok=folder_ok) == "folder":
        shutil.rmtree(target)
    os.replace(source, target)


def write_atomic(path: Path, data: bytes) -> None:
    """path holds data, or (interrupted) what it held before: written under path.tmp, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with create(tmp) as file:
        file.write(data)
    replace(tmp, path)


def truncate(path: Path, size: int) -> None:
    fd = open_file(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
