"""Rank 0 prepares data inside a training job while the other ranks wait on a file, not a collective.

A collective (broadcast, barrier) gives up after run.timeout_s, and tokenising a corpus can take longer.
So rank 0 writes its outcome, "ok" or the error message, to a file named for this job in the run's
output directory (which it holds and has written already, where the dataset folder may be read-only),
and the others poll for it, reporting as they wait, up to a limit of their own, or until asked to stop."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from safe_io import nofollow

from .errors import DataError

log = logging.getLogger(__name__)
OK = "ok"


def outcome_path(output_dir: str | Path, job_id: str) -> Path:
    """The outcome file of one job: a name of its own, so a file a crashed job left is never read."""
    return Path(output_dir) / f".data-prepared-{job_id}"


def publish(path: Path, error: str | None) -> None:
    """Rank 0: write the outcome atomically (the waiting ranks never see half a message), into a new file of a name
    of its own renamed into place: nothing that stands in the output directory is written through."""
    path.parent.mkdir(parents=True, exist_ok=True)
    nofollow.replace_file(path, (OK if error is None else error).encode("utf-8"))


def wait_for(path: Path, *, dataset_dir: str | Path, timeout_s: float, stop_requested: Callable[[], str],
             poll_s: float = 0.5, report_every_s: float = 60.0) -> str | None:
    """The other ranks: wait for rank 0's outcome; None when it succeeded, else its error message.
    stop_requested() names a stop signal received ("" for none): waiting then ends at once."""
    start = last_report = time.monotonic()
    while not path.is_file():
        now = time.monotonic()
        if signal_name := stop_requested():
            message = (f"{signal_name} received while waiting for rank 0 to prepare the data in {dataset_dir}: "
                       f"stopping (a rerun continues or reuses the preparation)")
        elif now - start > timeout_s:
            message = (f"rank 0 did not finish preparing the data in {dataset_dir} within data.prepare_wait_s="
                       f"{timeout_s:g} s; prepare it beforehand with scripts/prepare_data.py")
        else:
            message = ""
        if message:
            log.error(message)  # every rank reports this one: rank 0 may be unable to
            raise DataError(message)
        if now - last_report >= report_every_s:
            log.info("waiting for rank 0 to prepare the data in %s (%.0f s so far)", dataset_dir, now - start)
            last_report = now
        time.sleep(poll_s)
    outcome = path.read_text(encoding="utf-8")
    return None if outcome == OK else outcome
