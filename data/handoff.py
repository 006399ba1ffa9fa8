"""Rank 0 prepares data inside a training job while the other ranks wait on a file, not a collective.

A collective (broadcast, barrier) gives up after run.timeout_s, and tokenising a corpus can take longer.
So rank 0 writes its outcome, "ok" or the error message, to a file named for this job in the dataset
folder, and the others poll for it, reporting as they wait, up to a limit of their own.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from .errors import DataError

log = logging.getLogger(__name__)
OK = "ok"


def outcome_path(dataset_dir: str | Path, job_id: str) -> Path:
    """The outcome file of one job: a name of its own, so a file a crashed job left is never read."""
    return Path(dataset_dir) / f".prepared-{job_id}"


def publish(path: Path, error: str | None) -> None:
    """Rank 0: write the outcome atomically (the waiting ranks never see half a message)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(OK if error is None else error, encoding="utf-8")
    os.replace(tmp, path)


def wait_for(path: Path, *, timeout_s: float, poll_s: float = 0.5, report_every_s: float = 60.0) -> str | None:
    """The other ranks: wait for rank 0's outcome; None when it succeeded, else its error message."""
    start = last_report = time.monotonic()
    while not path.is_file():
        now = time.monotonic()
        if now - start > timeout_s:
            message = (f"rank 0 did not finish preparing the data in {path.parent} within data.prepare_wait_s="
                       f"{timeout_s:g} s; prepare it beforehand with scripts/prepare_data.py")
            log.error(message)  # every rank reports this one: rank 0 may be unable to
            raise DataError(message)
        if now - last_report >= report_every_s:
            log.info("waiting for rank 0 to prepare the data in %s (%.0f s so far)", path.parent, now - start)
            last_report = now
        time.sleep(poll_s)
    outcome = path.read_text(encoding="utf-8")
    return None if outcome == OK else outcome
