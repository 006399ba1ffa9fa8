"""train_fsdp.py with the test-only faults of FSDP_TEST_FAULTS installed (tests/fault_injection.py).
Launched by the tests in place of train_fsdp.py, with the same arguments."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import fault_injection  # noqa: E402

fault_injection.install(json.loads(os.environ.get(fault_injection.ENV, "{}")))

import train_fsdp  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_fsdp.main())
