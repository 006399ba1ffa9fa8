"""What the test launcher's fork server imports once (tests/launcher.py): torch and everything a training
job or a test's rank imports, so that a forked rank starts with it already loaded."""
import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401

import train_fsdp  # noqa: F401
from tests import fault_injection  # noqa: F401
