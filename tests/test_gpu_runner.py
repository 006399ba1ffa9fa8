"""tests/tools/run_gpu_tests.py's queue of single-test pytest runs, on the CPU: each test in a pytest of its own, a
failing one reported, a hanging one stopped at the timeout with the processes it started; the queue's order
(longest first, by the recorded durations)."""
from __future__ import annotations

import time

import pytest

from tests.helpers import alive
from tests.tools import run_gpu_tests

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
    seen = []  # how many had finished at each on_done call
    runs = run_gpu_tests.run_shared(tests, pairs=["0,1"], workers_per_pair=3, log_dir=tmp_path / "logs", timeout=8,
                                    on_done=lambda finished: seen.append(len(finished)))
    assert seen == [1, 2, 3]
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
    # What the next run's queue is ordered by: JUnit times, and the timeout for the stopped test.
    durations = run_gpu_tests.measured_durations(runs, timeout=8)
    assert durations[tests[2]] == 8 and 0 <= durations[tests[0]] < 8 and 0 <= durations[tests[1]] < 8
    assert [run_gpu_tests.outcome(junit, stopped) for _, junit, stopped in sorted(runs)] == [
        "FAILED", "TIMEOUT", "passed"]  # test_fails, test_hangs, test_passes


def test_queue_holds_unrecorded_tests_then_the_longest_first():
    tests = ["a", "b", "c", "d", "e"]
    durations = {"a": 10.0, "b": 90.5, "d": 10.0, "e": 30.0}
    # c has no record (a new test may be long): first; then by duration, ties in collection order.
    assert run_gpu_tests.longest_first(tests, durations) == ["c", "b", "e", "a", "d"]
    assert run_gpu_tests.longest_first(tests, {}) == tests


def test_shards_run_every_test_once_with_the_exclusive_ones_first_and_even_loads():
    durations = {"x": 10.0, "a": 100.0, "b": 90.0, "c": 50.0, "d": 40.0, "e": 30.0, "f": 20.0}
    shared = ["a", "b", "c", "d", "e", "f", "new"]  # "new": no record, counted as the longest (100)
    parts = run_gpu_tests.deal_shards(["x"], shared, durations, num_shards=2, parallel=4)
    assert parts[0][0] == ["x"] and parts[1][0] == []
    assert sorted(parts[0][1] + parts[1][1]) == sorted(shared)
    # "x" alone is worth 4 x 10 s of shared tests; the rest is dealt longest first to the lighter part.
    assert parts == [(["x"], ["a", "c", "d"]), ([], ["new", "b", "e", "f"])]  # 230 s and 240 s
    assert run_gpu_tests.deal_shards(["x"], shared, durations, num_shards=1, parallel=4) == [
        (["x"], run_gpu_tests.longest_first(shared, durations))]
    for bad in ("3/2", "0/2", "half", "1/2/3"):
        with pytest.raises(SystemExit) as err:
            run_gpu_tests.parse_shard(bad)
        assert str(err.value).startswith("error: --shard"), err.value
    assert run_gpu_tests.parse_shard("2/3") == (2, 3)


def test_junit_durations_are_keyed_by_node_id(tmp_path):
    junit = tmp_path / "r.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_gpu" name="test_a[1-2]" time="12.5"/>'
                     '</testsuite></testsuites>')
    assert run_gpu_tests.junit_durations(junit) == {"tests/test_gpu.py::test_a[1-2]": 12.5}
    assert run_gpu_tests.junit_durations(tmp_path / "none.xml") == {}


def test_each_test_of_a_multi_test_run_gets_its_outcome(tmp_path):
    junit = tmp_path / "r.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="tests.test_gpu" name="test_a" time="1"/>'
                     '<testcase classname="tests.test_gpu" name="test_b" time="1"><failure message="x"/></testcase>'
                     '<testcase classname="tests.test_gpu" name="test_c" time="1"><error message="x"/></testcase>'
                     '<testcase classname="tests.test_gpu" name="test_d" time="0"><skipped message="x"/></testcase>'
                     '</testsuite></testsuites>')
    assert run_gpu_tests.case_outcomes(junit) == {
        "tests/test_gpu.py::test_a": "passed", "tests/test_gpu.py::test_b": "FAILED",
        "tests/test_gpu.py::test_c": "FAILED", "tests/test_gpu.py::test_d": "skipped"}
    assert run_gpu_tests.case_outcomes(tmp_path / "none.xml") == {}


@pytest.mark.slow  # collect() starts a pytest
def test_durations_file_names_collected_gpu_tests_and_bad_files_are_one_line(tmp_path):
    recorded = run_gpu_tests.read_durations(run_gpu_tests.DURATIONS)
    # Only the files the record names are collected: each id it holds must be a GPU test there.
    collected = set(run_gpu_tests.collect("gpu", sorted({name.split("::")[0] for name in recorded})))
    assert recorded and set(recorded) <= collected, sorted(set(recorded) - collected)
    assert run_gpu_tests.read_durations(tmp_path / "none.json") == {}
    for text in ("{not json", '["a"]', '{"a": "slow"}'):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(SystemExit) as err:
            run_gpu_tests.read_durations(tmp_path / "bad.json")
        (line,) = str(err.value).splitlines()
        assert line.startswith(f"error: {tmp_path / 'bad.json'} is not a durations file"), line
