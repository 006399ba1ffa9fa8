"""Run a script of this project (train_fsdp.py, benchmarks/benchmark.py) with the test-only faults of
FSDP_TEST_FAULTS installed (tests/fault_injection.py): `python tests/with_faults.py SCRIPT ARGS...`, also as
torchrun's program. The tests launch it in place of the script."""
from __future__ import annotations

import json
import os
import runpy
import sys

from tests import fault_injection

if __name__ == "__main__":
    fault_injection.install(json.loads(os.environ.get(fault_injection.ENV, "{}")))
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
