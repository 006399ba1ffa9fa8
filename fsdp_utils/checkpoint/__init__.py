"""Checkpoints: the manager (save, resume, retention), the on-disk format and its safe reader, host
staging and the background writer of asynchronous saves, and reading checkpoints outside training."""
from .format import FORMAT_VERSION, CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointUnsafe  # noqa: F401
from .manager import CheckpointManager, TrainState  # noqa: F401
