"""The errors of a checkpoint that cannot be used, one class per way `latest` treats it, and the one line a failure
is told in."""
from __future__ import annotations

import pickle

import torch.distributed.checkpoint as dcp


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message (one line) names the file."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of a different model or setup: `latest` does not fall back past it."""


class CheckpointCorrupt(CheckpointError):
    """Damaged or incomplete files: `latest` moves such a checkpoint aside and falls back to the previous one."""


class CheckpointUnsafe(CheckpointError):
    """A checkpoint whose loading would run code: refused, never moved or deleted."""


def first_line(err: BaseException) -> str:
    """`Type: first line of the message` (at most 200 characters); for a DCP failure, its first rank's error."""
    if isinstance(err, dcp.CheckpointException) and err.failures:
        rank, failure = min(err.failures.items(), key=lambda item: item[0])
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {first_line(inner)}"
    if isinstance(err, pickle.UnpicklingError):  # torch's text advises weights_only=False: not for a damaged file
        return "UnpicklingError: the data does not decode"
    text = str(err).strip()
    line = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
    return line if len(line) <= 200 else line[:197] + "..."
