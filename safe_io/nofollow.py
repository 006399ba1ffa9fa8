"""Files and folders the library keeps (a run's output directory, a prepared data folder) opened, made, replaced
and removed without following symbolic links.

Whatever the library writes, reads or deletes there goes through these functions, under one rule:
- A file is opened only if it is a regular file: a symbolic link, a FIFO, a device, a socket or a folder there is
  refused with one line naming the path (`UnsafePath`) and left as it is. Writing through a link changes a file
  the library does not own; opening a FIFO or a device can block or never end.
- A name the library writes anew (a new file, a file renamed into place) or removes has what stands there
  replaced or removed as itself: a link, never what it leads to. A folder is removed only where the caller keeps
  a folder; anywhere else it may hold the user's files, and is refused and left as it is.
- A file is written in place (appended to, truncated, rewritten) only while it has one name: a file with other hard
  links (a folder copied with `cp -al` or `rsync --link-dest`) shares its contents with them, so writing would
  change the other copies. Such a file is refused (`SharedFile`), or given a copy of its own first (`open_append`
  with copy_if_shared, `lock_file`), renamed over that one name.
Entries are checked with lstat, then opened with O_NOFOLLOW and O_NONBLOCK, so that one swapped in after the check
is refused too.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO, TypeVar

T = TypeVar("T")


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


class SharedFile(UnsafePath):
    """A file to be written in place that has other hard links: writing would change them too."""

    def __init__(self, path: Path | str, links: int):
        super().__init__(path, f"a file with {links} hard links where this library writes in place (another name "
                               "shares its contents, which writing here would change); refusing to write to it "
                               "(move it away)")

    def __reduce__(self):
        return UnsafePath, (self.filename, self.strerror)


def open_fd(path: Path | str, flags: int, mode: int = 0o644, *, shared_ok: bool = False) -> int:
    """os.open of a regular file that is not a link (O_NOFOLLOW), without blocking on a FIFO; UnsafePath for
    anything else, which is never opened where lstat sees it first. Opened for writing, a file with other hard
    links is refused (SharedFile) before anything is written or truncated, unless `shared_ok` (a caller that
    only locks it, see `lock_file`). The descriptor is blocking again when returned."""
    check(path)
    truncate_it = flags & os.O_TRUNC  # done once the file is known to be one the rule lets us write
    writing = flags & (os.O_WRONLY | os.O_RDWR)
    try:
        fd = os.open(path, flags & ~os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO without a reader, a folder
            what = kind_at(path)
            if what is not None:
                raise refusal(path, what) from None
        raise
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode):
            raise refusal(path, kind_of(now.st_mode))
        if writing and now.st_nlink > 1 and not shared_ok:
            raise SharedFile(path, now.st_nlink)
        if truncate_it:
            os.ftruncate(fd, 0)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: Path | str, *, copy_if_shared: bool = False) -> TextIO:
    """A text file opened for appending (created if missing), never through a link. A file with other hard links is
    refused (SharedFile), or with `copy_if_shared` given a copy of its own first (see `unshare`): the other names
    keep the file as it was."""
    def opener(name: str, _: int) -> int:
        return open_fd(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    try:
        return open(path, "a", opener=opener)
    except SharedFile:
        if not copy_if_shared:
            raise
    unshare(Path(path))
    return open(path, "a", opener=opener)


def unshare(path: Path) -> None:
    """Give `path`, a file with other hard links, a file of its own: a copy of its contents (and permissions), written
    beside it and renamed over that one name. Its other names keep the file as it was."""
    fd = open_fd(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as src:
        def copy(dst: BinaryIO) -> None:
            shutil.copyfileobj(src, dst)
            os.fchmod(dst.fileno(), stat.S_IMODE(os.fstat(fd).st_mode))
            dst.flush()
            os.fsync(dst.fileno())

        write_beside(path, copy)


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


# ---- lock files ------------------------------------------------------------------------------------


class LockHeld(OSError):
    """Another process holds the lock: `holder` is the line it wrote into the lock file (may be empty)."""

    def __init__(self, path: Path | str, holder: str):
        super().__init__(errno.EWOULDBLOCK, "held by another process", str(path))
        self.holder = holder


@dataclasses.dataclass
class HeldLock:
    """An exclusive flock held until `fd` is closed (the operating system releases it however the process ends).
    `locked` is False where the filesystem has no locks; `waited`, whether another process held it first."""
    fd: int
    locked: bool
    waited: bool = False


def lock_file(path: Path, *, holder: str, wait: Callable[[str], bool] | None = None,
              tmp: Path | None = None) -> HeldLock:
    """Lock the file at `path` (created if missing) exclusively, then write `holder` (a line saying who holds it)
    into it. Held by another process: LockHeld, or with `wait`, tried again every 0.2 s while wait(its holder's line)
    says to wait.

    The file is written only while it has one name: one with other hard links (a copied folder) is locked, then a
    new file, locked too, is renamed over that name (written beside it: at `tmp` if given, see replace_file), so the
    other names keep theirs and the lock never lapses. A file replaced or removed while this one waited for it is
    opened again: its new one is the lock."""
    waited = False
    for _ in range(100):
        fd = open_fd(path, os.O_RDWR | os.O_CREAT, shared_ok=True)  # written only once it has one name (_take)
        try:
            lock = _flock(path, fd, wait)
            waited = waited or lock.waited
            taken = _take(path, lock, holder=holder, tmp=tmp)
        except BaseException:
            os.close(fd)
            raise
        if not taken or lock.fd != fd:  # replaced meanwhile (try again), or by a file of its own
            os.close(fd)
        if taken:
            lock.waited = waited
            return lock
    raise UnsafePath(path, "replaced by other processes 100 times while this one locked it")


def _take(path: Path, lock: HeldLock, *, holder: str, tmp: Path | None) -> bool:
    """Write `holder` into the file `lock` has just locked, given a file of its own first if it has other names;
    False if `path` names another file by now (this one was replaced or removed meanwhile: it locks nothing)."""
    fd = lock.fd
    now = os.fstat(fd)
    if lock.locked and not _same_file(path, now):
        return False
    if now.st_nlink > 1:
        lock.fd = _replace_locked(path, lock, tmp)
    try:
        os.ftruncate(lock.fd, 0)
        os.pwrite(lock.fd, f"{holder}\n".encode(), 0)
    except BaseException:
        if lock.fd != fd:
            os.close(lock.fd)
        raise
    return True


def _flock(path: Path, fd: int, wait: Callable[[str], bool] | None) -> HeldLock:
    """Lock `fd` without blocking, trying again while `wait` says so; a filesystem without locks is no lock."""
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return HeldLock(fd, locked=True, waited=waited)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # no locks here (some network ones)
                return HeldLock(fd, locked=False)
        holder = holder_of(fd)
        if wait is None or not wait(holder):
            raise LockHeld(path, holder)
        waited = True
        time.sleep(0.2)


def holder_of(fd: int) -> str:
    """The line a lock file open at `fd` holds about its holder: its first, of at most 200 bytes (it goes into a
    message, and the file may be another name of any file)."""
    return os.pread(fd, 200, 0).decode(errors="replace").strip().split("\n")[0]


def _same_file(path: Path, opened: os.stat_result) -> bool:
    """Whether `path` is still the file `opened` describes."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def _replace_locked(path: Path, lock: HeldLock, tmp: Path | None) -> int:
    """A new lock file renamed over `path`, whose file has other hard links and is locked by `lock`: the new one
    is locked before it takes the name. Returns its descriptor."""
    if tmp is None:
        tmp, f = open_unique(path.parent, f".tmp-{path.name}.")
    else:
        f = create(tmp)
    with f:
        fd = os.dup(f.fileno())
        made = os.fstat(fd)
    try:
        if lock.locked:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else has it
        replace(tmp, path)
    except BaseException:
        os.close(fd)
        remove_made(tmp, made)
        raise
    return fd


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


def write_beside(final: Path, write: Callable[[BinaryIO], T], *,
                 install: Callable[[Path, Path], None] = replace) -> T:
    """`write` fills a new file of a unique name beside `final` (`.tmp-<name>.<random>`, created exclusively: never a
    file the user has there, never through a link), which `install(tmp, final)` then renames into place; returns what
    `write` returned. Should anything fail or be interrupted, that file, and only it, is removed."""
    tmp, f = open_unique(final.parent, f".tmp-{final.name}.")
    made = os.fstat(f.fileno())
    try:
        with f:
            try:
                result = write(f)
            finally:
                made = written(f)  # removed below only while it is still this file
        install(tmp, final)
    except BaseException:
        remove_made(tmp, made)
        raise
    return result


def replace_file(path: Path, data: bytes, *, tmp: Path | None = None) -> None:
    """`path` holds `data`, or (interrupted) what it held before. The bytes go to a new file beside it, which is then
    renamed over `path` (see `replace`): a file of a unique name (see `write_beside`), or `tmp` when given (a name
    the caller records as its own; what stands there is removed first, see `create`). A folder at either name is
    refused, before anything is written."""
    for name in (path,) if tmp is None else (tmp, path):
        if kind_at(name) == "a folder":
            raise refusal(name, "a folder")
    if tmp is None:
        write_beside(path, lambda f: f.write(data))
        return
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
