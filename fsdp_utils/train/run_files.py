"""Small record files: the run's own (trackers.json, the micro-batch cache), replaced whole without following
links, and the results log a user names (a script's --json), appended to without ever blocking."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ..checkpoint import nofollow


def replace_file(path: Path, data: bytes) -> None:
    """`path` holds `data`, or (interrupted) what it held before. The bytes go to .tmp-<name> beside it (what
    was left there removed, a link as itself; the new file opened exclusively), which is then renamed over
    `path`: a link there is replaced, never written through. A folder at either name is refused (UnsafePath)."""
    tmp = path.with_name(f".tmp-{path.name}")
    for name in (tmp, path):
        try:
            if stat.S_ISDIR(os.lstat(name).st_mode):
                raise nofollow.refusal(name, "a folder")
        except FileNotFoundError:
            pass
    nofollow.remove(tmp)
    with nofollow.open_new(tmp) as f:
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
        return f"{option} {path}: {nofollow.kind_of(mode)}, not a file to append results to"
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
            raise OSError(f"{option} {path}: {nofollow.kind_of(mode)}, not a file to append results to")
        f.write(line + "\n")
