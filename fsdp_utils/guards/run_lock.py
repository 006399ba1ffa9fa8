"""One run per output directory: an exclusive lock that rank 0 holds for the whole run.

Two runs writing into one directory would delete each other's checkpoints (retention) and mix their
config.yaml, tokenizer and metrics.jsonl. The lock is `flock` on `<output_dir>/run.lock`: the operating
system releases it when the holding process ends, however it ends, so a killed run never leaves a stale
lock. The holder writes its host, pid and start time into the file, for the refused run to name it.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import logging
import os
import socket
from pathlib import Path

from ..distributed import DistEnv, agree
from ..nofollow import open_fd

log = logging.getLogger(__name__)
LOCK_NAME = "run.lock"


class RunLocked(RuntimeError):
    """Another run holds the output directory."""


def _acquire(out_dir: Path) -> int | None:
    """The open, locked lock file's descriptor; RunLocked naming the holder if another process has it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_NAME
    # The holder's line is written into run.lock itself, never through a link, and a FIFO there never blocks.
    fd = open_fd(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not yet said who it is"
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunLocked(f"{out_dir} is in use by another run ({holder}); wait for it to end, or give this run "
                            f"another run.output_dir") from None
        # A filesystem without locks (some network filesystems): run, but say that nothing guards the directory.
        log.warning("cannot lock %s (%s): nothing stops a second run from writing into %s", path, err.strerror, out_dir)
        return None
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n".encode(), 0)
    return fd


def take_run_lock(out_dir: Path, env: DistEnv) -> int | None:
    """Rank 0 locks the output directory before anything is written there; every rank raises RunLocked
    if it is taken (a collective, right after the process group starts). Keep the returned descriptor
    open for the whole run (None on ranks other than 0, or where the filesystem has no locks)."""
    fd, error = None, None
    if env.is_main:
        try:
            fd = _acquire(out_dir)
        except (RunLocked, OSError) as err:
            error = RunLocked(str(err))
    agree(env, error)
    return fd
