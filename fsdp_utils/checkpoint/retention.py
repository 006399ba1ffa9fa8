"""Which checkpoints of the output directory are complete, retention (checkpoint.keep_last_n), moving a corrupt one
aside, and removing what an interrupted save left; only what the run's journal (safe_io/journal.py) records as the
run's own is ever removed. Plain filesystem code without a process group: rank 0 runs it."""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from safe_io.journal import TMP_PREFIX, Journal, set_aside

from .names import CORRUPT_PREFIX, FULL_RE, META_NAME, SHARDED_RE, sidecar_of

log = logging.getLogger(__name__)


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `directory`, newest first. A sharded folder counts once its
    meta.json is there (written last, so whatever is there under that name marks a save that ended; loading checks what
    it is); `.tmp-` and `corrupt-` names never match. Only the run's own files and folders count: a link under a
    checkpoint's name is never loaded, counted or deleted (`odd_checkpoints` names them)."""
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


def incomplete_sharded(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every folder under a sharded checkpoint's name without its meta.json (an interrupted save
    that left none, one whose meta.json was lost, or another folder): never loaded, but never passed over in
    silence either (`latest` moves it aside as corrupt)."""
    found = []
    for entry in os.scandir(directory) if directory.is_dir() else ():
        if ((m := SHARDED_RE.match(entry.name)) and entry.is_dir(follow_symlinks=False)
                and not os.path.lexists(Path(entry.path) / META_NAME)):
            found.append((int(m.group(1)), Path(entry.path)))
    return found


def remove(journal: Journal, path: Path) -> None:
    """Remove a file or a folder the run's saves made (a link itself, never what it points to); anything else at
    `path` stays. A failure is logged."""
    try:
        journal.remove(path)
    except OSError as err:
        log.warning("cannot remove %s (%s)", path, err)


def remove_incomplete(journal: Journal) -> None:
    """Remove what interrupted saves of this run left (their `.tmp-` files and folders, as the journal records
    them); a `.tmp-` name the journal does not record is not the run's, and stays."""
    for name in journal.own_names(TMP_PREFIX):
        path = journal.dir / name
        if journal.owns(path):
            log.warning("removing incomplete checkpoint %s (an interrupted save)", path)
            remove(journal, path)


def apply_retention(journal: Journal, newest: Path, *, keep_last_n: int) -> None:
    """Keep the keep_last_n newest complete checkpoints the run's saves made, `newest` (the one just saved)
    counted first whatever its step; checkpoints moved aside, and those the journal does not record (copied in,
    or saved without it), are neither counted nor deleted. 0 keeps all."""
    if keep_last_n <= 0:
        return
    others = [path for _, path in complete_checkpoints(journal.dir) if path != newest and journal.owns(path)]
    for path in others[keep_last_n - 1:]:
        log.info("removing old checkpoint %s (checkpoint.keep_last_n=%d)", path, keep_last_n)
        remove(journal, path)
        remove(journal, sidecar_of(path))


def move_aside(journal: Journal, path: Path) -> Path:
    """Rename a corrupt checkpoint (and its checksum record) to a name that is never loaded or deleted;
    returns the new path."""
    target = set_aside(path, CORRUPT_PREFIX, journal=journal, along=sidecar_of(path))
    log.warning("moved %s aside to %s: it is never loaded or deleted automatically; delete it once inspected",
                path.name, target.name)
    return target
