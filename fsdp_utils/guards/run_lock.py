"""One run per output directory: an exclusive lock that rank 0 holds for the whole run.

Two runs writing into one directory would delete each other's checkpoints (retention) and mix their
config.yaml, tokenizer and metrics.jsonl. The lock is `flock` on `<output_dir>/run.lock`: the operating
system releases it when the holding process ends, however it ends, so a killed run never leaves a stale
lock. The holder writes its host, pid and start time into the file, for the refused run to name it; a run.lock
that is a hard link (a folder copied with `cp -al`) is replaced, never written (nofollow.lock_file).

A run that ends before training a step in a folder it created leaves no folder behind (`RunLock.release`).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from pathlib import Path

from safe_io import nofollow
from safe_io.journal import JOURNAL_NAME, Journal

from ..distributed import DistEnv, agree

log = logging.getLogger(__name__)
LOCK_NAME = "run.lock"


class RunLocked(RuntimeError):
    """Another run holds the output directory."""


class RunLock:
    """The output directory's lock, held by rank 0 until `release`; `created` says whether this run made the
    folder (it did not exist before the lock was taken)."""

    def __init__(self, out_dir: Path):
        self.dir = out_dir
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            out_dir.mkdir()
            self.created = True
        except FileExistsError:  # a folder (or a link to one) that was there before: never removed
            self.created = False
        self.path = out_dir / LOCK_NAME
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        try:
            held = nofollow.lock_file(self.path, holder=f"host {socket.gethostname()}, pid {os.getpid()}, "
                                                        f"started {started}")
        except nofollow.LockHeld as err:
            raise RunLocked(_in_use(out_dir, err.holder)) from None
        except OSError:
            if self.created:
                os.rmdir(out_dir)
            raise
        if not held.locked:  # some network filesystems: run, but say that nothing guards the directory
            log.warning("cannot lock %s: nothing stops a second run from writing into %s", self.path, out_dir)
        self.fd = held.fd

    def release(self, *, discard: bool = False) -> None:
        """Unlock. With `discard` (the run trained no step), a folder this run created goes if it holds nothing but
        what the run wrote there: the lock file, the journal of the run's own files and what that records
        (config.yaml, the tokenizer, ...). Anything else in it keeps the folder, and all it holds, as it is."""
        try:
            if discard and self.created:
                self._remove_folder()
        except OSError as err:
            log.warning("could not remove %s, which this run made and trained nothing in: %s", self.dir, err)
        finally:
            os.close(self.fd)

    def _remove_folder(self) -> None:
        journal = Journal(self.dir)
        own = [self.dir / name for name in journal.own_names() if journal.owns(self.dir / name)]
        if set(os.listdir(self.dir)) - {LOCK_NAME, JOURNAL_NAME, *(path.name for path in own)}:
            return  # something this run did not write: the user's, or a writer's the journal does not know
        for path in own:
            nofollow.remove(path, folder_ok=True)
        nofollow.remove(self.dir / JOURNAL_NAME)  # the journal of a folder this run made is this run's
        nofollow.remove_made(self.path, os.fstat(self.fd))  # still held: a run waiting for it opens the path again
        os.rmdir(self.dir)  # only if empty: a file that came in meanwhile keeps it


def _in_use(out_dir: Path, holder: str) -> str:
    """The refusal of a run whose output directory another run holds (its lock file may be a hard link to the lock
    of the run of which this folder is a copy)."""
    path = out_dir / LOCK_NAME
    try:
        links = os.lstat(path).st_nlink
    except OSError:
        links = 1
    copied = f" ({path} has {links} hard links: if this folder is a copy of another run's, remove it)" \
        if links > 1 else ""
    return (f"{out_dir} is in use by another run ({holder or 'a process that has not yet said who it is'}){copied}; "
            "wait for it to end, or give this run another run.output_dir")


def take_run_lock(out_dir: Path, env: DistEnv) -> RunLock | None:
    """Rank 0 locks the output directory before anything is written there; every rank raises RunLocked
    if it is taken (a collective, right after the process group starts). Keep the returned lock until the run
    ends, then `release` it (None on ranks other than 0)."""
    lock, error = None, None
    if env.is_main:
        try:
            lock = RunLock(out_dir)
        except (RunLocked, OSError) as err:
            error = RunLocked(str(err))
    agree(env, error)
    return lock
