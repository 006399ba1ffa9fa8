"""The one error type of data/: its message names the culprit (file, line or row, setting) in one line."""
from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safe_io.nofollow import UnsafePath, kind_of


class DataError(ValueError):
    """A problem with the user's data or data settings; the message names the culprit."""


@contextmanager
def refusals_as_data_errors() -> Iterator[None]:
    """A path of the prepared folder that safe_io.nofollow refuses (UnsafePath, an OSError) raised as the
    DataError of the same line, at data/'s boundary (its entry points wear this as a decorator): their callers and
    data/'s own checks handle DataError alone."""
    try:
        yield
    except UnsafePath as err:
        raise DataError(str(err)) from None


def file_problem(path: Path | str) -> str | None:
    """Why `path` (a link followed: the user named it) is no file to read, in words for an error line ("no such
    file", "a FIFO, not a regular file", ...); None for a regular file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as err:
        return err.strerror or str(err)
    return None if stat.S_ISREG(mode) else f"{kind_of(mode)}, not a regular file"


def first_line(err: BaseException) -> str:
    """The first non-blank line of an exception's message (at most 200 characters): what a library said, in one
    line of ours."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else ""
