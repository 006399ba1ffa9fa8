"""The checkpoints of an output directory as files: which are complete, which to keep
(checkpoint.keep_last_n), moving a corrupt one aside, and removing what an interrupted save left.
Plain filesystem code without a process group: the manager runs it on rank 0."""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from . import nofollow
from .format import CORRUPT_PREFIX, FULL_RE, META_NAME, SHARDED_RE, TMP_PREFIX, sidecar_of

log = logging.getLogger(__name__)


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `directory`, newest first. A sharded folder counts
    once its meta.json is there (written last, so whatever is there under that name marks a save that ended;
    loading checks what it is); `.tmp-` and `corrupt-` names never match. Only the run's own files and
    folders count: a link under a checkpoint's name is never loaded, counted or deleted (`odd_checkpoints`
    names them)."""
    found = []
    if directory.is_dir():
        for entry in os.scandir(directory):
            path = Path(entry.path)
            if (m := FULL_RE.match(entry.name)) and entry.is_file(follow_symlinks=False):
                found.append((int(m.group(1)), path))
            elif ((m := SHARDED_RE.match(entry.name)) and entry.is_dir(follow_symlinks=False)
                  and os.path.lexists(path / META_NAME)):
                found.append((int(m.group(1)), path))
    return sorted(found, key=lambda item: item[0], reverse=True)


def odd_checkpoints(directory: Path) -> list[Path]:
    """Entries of `directory` under a checkpoint's name that a save never makes: a link, a FIFO, a device, a
    folder under a full checkpoint's name or a file under a sharded one's."""
    odd = []
    for entry in os.scandir(directory) if directory.is_dir() else ():
        mode = entry.stat(follow_symlinks=False).st_mode
        if (FULL_RE.match(entry.name) and not stat.S_ISREG(mode)) or (SHARDED_RE.match(entry.name)
                                                                      and not stat.S_ISDIR(mode)):
            odd.append(Path(entry.path))
    return sorted(odd)


def remove(path: Path) -> None:
    """Remove a file or a folder, if there (a link itself, never what it points to); a failure is logged."""
    try:
        nofollow.remove(path)
    except OSError as err:
        log.warning("cannot remove %s (%s)", path, err)


def remove_incomplete(directory: Path) -> None:
    """Remove the `.tmp-` leftovers of interrupted saves (names only saves make)."""
    for path in directory.glob(f"{TMP_PREFIX}*"):
        log.warning("removing incomplete checkpoint %s (an interrupted save)", path)
        remove(path)


def apply_retention(directory: Path, newest: Path, *, keep_last_n: int) -> None:
    """Keep the keep_last_n newest complete checkpoints, `newest` (the one just saved) counted first
    whatever its step; checkpoints moved aside as corrupt are not counted and never deleted. 0 keeps all."""
    if keep_last_n <= 0:
        return
    others = [path for _, path in complete_checkpoints(directory) if path != newest]
    for path in others[keep_last_n - 1:]:
        log.info("removing old checkpoint %s (checkpoint.keep_last_n=%d)", path, keep_last_n)
        remove(path)
        remove(sidecar_of(path))


def move_aside(path: Path) -> Path:
    """Rename a corrupt checkpoint (and its checksum record) to a name that is never loaded or deleted;
    returns the new path."""
    target, n = path.with_name(CORRUPT_PREFIX + path.name), 1
    while os.path.lexists(target):
        n += 1
        target = path.with_name(f"{CORRUPT_PREFIX}{n}-{path.name}")
    os.replace(path, target)
    if os.path.lexists(sidecar_of(path)):
        os.replace(sidecar_of(path), sidecar_of(target))
    log.warning("moved %s aside to %s: it is never loaded or deleted automatically; delete it once inspected",
                path.name, target.name)
    return target
