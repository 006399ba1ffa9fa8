"""scripts/run_gpu_tests.py's queue of single-test pytest runs, on the CPU: each test in a pytest of its own, a
failing one reported, a hanging one stopped at the timeout with the processes it started."""
from __future__ import annotations

import sys
import time

import pytest

from tests.helpers import ROOT, alive

sys.path.insert(0, str(ROOT / "scripts"))
import run_gpu_tests  # noqa: E402

SAMPLE = '''
import subprocess, time
from pathlib import Path

def test_passes():
    pass

def test_fails():
    assert 1 == 2

def test_hangs(tmp_path_factory):
    child = subprocess.Popen(["sleep", "300"])  # stopped with it
    (Path(__file__).parent / "child.pid").write_text(str(child.pid))
    time.sleep(300)
'''


@pytest.mark.slow
def test_queue_runs_each_test_alone_and_stops_a_hanging_one_with_its_children(tmp_path):
    (tmp_path / "sample").mkdir()
    module = tmp_path / "sample" / "test_sample.py"
    module.write_text(SAMPLE)
    tests = [f"{module}::test_passes", f"{module}::test_fails", f"{module}::test_hangs"]
    start = time.monotonic()
    runs = run_gpu_tests.run_shared(tests, pairs=["0,1"], workers_per_pair=3, log_dir=tmp_path / "logs", timeout=8)
    assert time.monotonic() - start < 40
    outcome = {test.rsplit("::", 1)[1]: (run_gpu_tests.results(junit), stopped) for test, junit, stopped in runs}
    assert outcome["test_passes"] == (({"passed": 1, "failed": 0, "skipped": 0}, []), False)
    (counts, failures), stopped = outcome["test_fails"]
    assert counts["failed"] == 1 and not stopped and failures[0].endswith("test_fails")
    (counts, _), stopped = outcome["test_hangs"]
    assert stopped and counts["failed"] == 1  # no JUnit file: counted as failed
    child = int((tmp_path / "sample" / "child.pid").read_text())
    time.sleep(0.5)
    assert not alive(child)
