"""Checkpoints: the manager (save, resume, retention), what a checkpoint holds (contents.py), the on-disk names,
checksums, metadata checks and safe reading, host staging and the background writer of asynchronous saves, and
reading checkpoints outside training."""
from .contents import Contents, TrainState  # noqa: F401
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointUnsafe  # noqa: F401
from .manager import CheckpointManager  # noqa: F401
from .names import FORMAT_VERSION  # noqa: F401
