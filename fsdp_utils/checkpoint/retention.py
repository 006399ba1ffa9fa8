"""The checkpoints of an output directory as files: which are complete, which to keep
(checkpoint.keep_last_n), moving a corrupt one aside, and removing what an interrupted save left.
Plain filesystem code without a process group: the manager runs it on rank 0."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from .format import CORRUPT_PREFIX, FULL_RE, META_NAME, SHARDED_RE, TMP_PREFIX, sidecar_of

log = logging.getLogger(__name__)


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `directory`, newest first. A sharded folder counts
    once its meta.json is there (written last); `.tmp-` and `corrupt-` names never match."""
    found = []
    if directory.is_dir():
        for path in directory.iterdir():
            if m := FULL_RE.match(path.name):
                found.append((int(m.group(1)), path))
            elif (m := SHARDED_RE.match(path.name)) and (path / META_NAME).is_file():
                found.append((int(m.group(1)), path))
    return sorted(found, key=lambda item: item[0], reverse=True)


def remove(path: Path) -> None:
    """Remove a file or a folder, if there."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
        sidecar_of(path).unlink(missing_ok=True)


def move_aside(path: Path) -> Path:
    """Rename a corrupt checkpoint (and its checksum record) to a name that is never loaded or deleted;
    returns the new path."""
    target, n = path.with_name(CORRUPT_PREFIX + path.name), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{CORRUPT_PREFIX}{n}-{path.name}")
    os.replace(path, target)
    if sidecar_of(path).exists():
        os.replace(sidecar_of(path), sidecar_of(target))
    log.warning("moved %s aside to %s: it is never loaded or deleted automatically; delete it once inspected",
                path.name, target.name)
    return target
