"""Run every GPU test in one call, spread over the machine's GPUs.

    python tests/tools/run_gpu_tests.py                    # all tests marked `gpu`
    python tests/tools/run_gpu_tests.py -k matrix          # extra arguments go to pytest (selection only)
    python tests/tools/run_gpu_tests.py --shard 1/2        # then --shard 2/2: the suite in two calls of half the time

Tests marked `gpu_exclusive` (they measure GPU memory, or need more than 2 GPUs) run first, one pytest with
every GPU visible. The others run next, shared out as they go: several workers per pair of GPUs
(CUDA_VISIBLE_DEVICES; disjoint pairs where the machine has 4 or more; the tests train small models, so a
pair has room and compute for a few at once) each take the next test from one queue and run it in a pytest
process of its own, stopped with everything it started after --test_timeout seconds. A test that hangs
then fails alone, and a slow one does not hold back the tests dealt after it. The queue holds the longest
tests first (seconds recorded in tests/gpu_durations.json; tests without a record before all): the suite
takes about as long as its busiest worker, so a slow test must not be the last to start. --shard K/N runs the
K-th of N parts of about equal recorded time (the exclusive tests in the first), for machines or jobs with a time
limit shorter than the suite: the N calls together run every test once. Prints each test's outcome as it
finishes, one line per failure at the end and a closing `N passed, N failed, N skipped` line; exits non-zero
if anything failed. The logs and JUnit files of every pytest are kept in --log_dir.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DURATIONS = ROOT / "tests/gpu_durations.json"


def collect(marker: str, pytest_args: list[str]) -> list[str]:
    """Node ids of the tests selected by the marker expression (and the extra pytest arguments)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker, *pytest_args],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 5):  # 5: nothing collected
        sys.exit(f"error: collecting the GPU tests failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return [line for line in proc.stdout.splitlines() if "::" in line]


def run_pytest(tests: list[str], *, name: str, gpus: str, log_dir: Path, timeout: float) -> tuple[Path, bool]:
    """One pytest over `tests` on those GPUs: (its JUnit file, whether it was stopped at the timeout). Its own
    session, so that stopping it also stops the ranks and fork servers it started."""
    junit = log_dir / f"{name}.xml"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           f"--basetemp={log_dir / ('tmp-' + name)}", *tests]
    with (log_dir / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            return junit, False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\nrun_gpu_tests: stopped after {timeout:.0f} s\n")
            return junit, True


def results(junit: Path) -> tuple[dict[str, int], list[str]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    if not junit.exists():
        counts["failed"] = 1
        return counts, [f"{junit.stem}: no results (pytest crashed: see {junit.with_suffix('.log')})"]
    for case in junit_cases(junit):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome in ("failure", "error"):
            counts["failed"] += 1
            failures.append(f"{case.get('classname')}::{case.get('name')}")
        elif outcome == "skipped":
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failures


def outcome(junit: Path, stopped: bool) -> str:
    """One word for a finished single-test pytest, printed as it finishes (a run cut short still says how its
    finished tests went)."""
    if stopped:
        return "TIMEOUT"
    counts, _ = results(junit)
    return "FAILED" if counts["failed"] else "skipped" if counts["skipped"] and not counts["passed"] else "passed"


def longest_first(tests: list[str], durations: dict[str, float]) -> list[str]:
    """The queue's order: tests with no recorded duration first (new ones may be long), then the longest first;
    ties keep the collection order."""
    return sorted(tests, key=lambda test: (test in durations, -durations.get(test, 0.0)))


def deal_shards(exclusive: list[str], shared: list[str], durations: dict[str, float], *, num_shards: int,
                parallel: int) -> list[tuple[list[str], list[str]]]:
    """The suite cut into `num_shards` parts of about equal wall time, as (exclusive tests, shared tests) each:
    the exclusive tests all in the first (they run alone, one after another: their seconds count `parallel`
    times, against shared tests that run `parallel` at once); the shared ones longest first, each to the part
    with the least recorded seconds so far. A test with no record counts as the longest recorded. The same
    tests and records give the same parts, so the N calls of a suite split it alike."""
    longest = max(durations.values(), default=0.0)
    seconds = lambda test: durations.get(test, longest)  # noqa: E731
    parts: list[tuple[list[str], list[str]]] = [([], []) for _ in range(num_shards)]
    loads = [0.0] * num_shards
    parts[0][0].extend(exclusive)
    loads[0] = parallel * sum(seconds(test) for test in exclusive)
    for test in longest_first(shared, durations):
        lightest = loads.index(min(loads))
        parts[lightest][1].append(test)
        loads[lightest] += seconds(test)
    return parts


def parse_shard(text: str) -> tuple[int, int]:
    """K/N (1 <= K <= N) as (K, N); one error line otherwise."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise SystemExit(f"error: --shard must be K/N, e.g. 1/2; got {text!r}") from None
    if not 1 <= k <= n:
        raise SystemExit(f"error: --shard K/N needs 1 <= K <= N; got {text!r}")
    return k, n


def node_id(case: ET.Element) -> str:
    """A JUnit test case's pytest node id (tests/test_gpu.py::test_name[param])."""
    return f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"


def junit_cases(junit: Path) -> list[ET.Element]:
    """The test cases of a pytest's JUnit file; none where pytest wrote no file."""
    return list(ET.parse(junit).getroot().iter("testcase")) if junit.exists() else []


def junit_durations(junit: Path) -> dict[str, float]:
    """Seconds per test of a pytest's JUnit file, by node id."""
    return {node_id(case): float(case.get("time", 0)) for case in junit_cases(junit)}


def case_outcomes(junit: Path) -> dict[str, str]:
    """One word per test of a pytest's JUnit file, by node id: how each of a multi-test run went."""
    words = {"failure": "FAILED", "error": "FAILED", "skipped": "skipped"}
    return {node_id(case): next((words[child.tag] for child in case if child.tag in words), "passed")
            for case in junit_cases(junit)}


def measured_durations(runs: list[tuple[str, Path, bool]], timeout: float) -> dict[str, float]:
    """Seconds each test of run_shared took (its JUnit time; a test stopped at the timeout: the timeout)."""
    durations = {}
    for test, junit, stopped in runs:
        if stopped or not junit.exists():
            durations[test] = timeout
        else:
            durations[test] = round(sum(junit_durations(junit).values()), 1)
    return durations


def read_durations(path: Path) -> dict[str, float]:
    """{test node id: seconds} from a durations file; {} where there is none."""
    if not path.exists():
        return {}
    try:
        durations = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {path} is not a durations file ({err}): delete it or pass --durations") from err
    if not isinstance(durations, dict) or not all(isinstance(v, int | float) for v in durations.values()):
        raise SystemExit(f"error: {path} is not a durations file (test ids to seconds): delete it or pass --durations")
    return durations


def write_durations(log_dir: Path, durations: dict[str, float]) -> None:
    (log_dir / "durations.json").write_text(json.dumps(durations, indent=1, sort_keys=True) + "\n")


def run_shared(tests: list[str], *, pairs: list[str], workers_per_pair: int, log_dir: Path, timeout: float,
               on_done: Callable[[list[tuple[str, Path, bool]]], None] | None = None) -> list[tuple[str, Path, bool]]:
    """Every test in a pytest of its own, taken from one queue by workers_per_pair workers per GPU pair:
    [(test, its JUnit file, stopped at the timeout)] in the order they finished. `on_done(finished so far)`
    runs after each test, one call at a time."""
    log_dir.mkdir(parents=True, exist_ok=True)
    todo: queue.Queue[tuple[int, str]] = queue.Queue()
    for item in enumerate(tests):
        todo.put(item)
    done: list[tuple[str, Path, bool]] = []
    lock = threading.Lock()

    def worker(gpus: str) -> None:
        while True:
            try:
                index, test = todo.get_nowait()
            except queue.Empty:
                return
            junit, stopped = run_pytest([test], name=f"test{index:03d}", gpus=gpus, log_dir=log_dir, timeout=timeout)
            with lock:
                done.append((test, junit, stopped))
                print(f"[{len(done)}/{len(tests)}] {outcome(junit, stopped)} {test}", flush=True)
                if on_done is not None:
                    on_done(done)

    threads = [threading.Thread(target=worker, args=(pair,)) for pair in pairs for _ in range(workers_per_pair)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers_per_pair", type=int, default=3, help="parallel pytest processes per GPU pair")
    parser.add_argument("--test_timeout", type=float, default=400,
                        help="seconds one test may take before it is stopped and counted as failed")
    parser.add_argument("--log_dir", type=Path, default=Path("/tmp/gpu-tests"))
    parser.add_argument("--shard", default="1/1", help="K/N: run the K-th of N parts of about equal recorded time")
    parser.add_argument("--durations", type=Path, default=DURATIONS,
                        help="recorded seconds per test, which order the queue (longest first); LOG_DIR/durations.json "
                             "gets them with this run's, as tests finish: copy it here to refresh them")
    args, pytest_args = parser.parse_known_args(argv)
    shard, num_shards = parse_shard(args.shard)
    import torch

    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        print(f"error: the GPU suite needs at least 2 GPUs; this machine has {num_gpus}", file=sys.stderr)
        return 2
    if args.workers_per_pair < 1 or args.test_timeout <= 0:
        print("error: --workers_per_pair and --test_timeout must be positive", file=sys.stderr)
        return 2
    args.log_dir.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    recorded = read_durations(args.durations)
    pairs = [f"{i},{i + 1}" for i in range(0, num_gpus - 1, 2)]
    exclusive, shared = deal_shards(collect("gpu and gpu_exclusive", pytest_args),
                                    collect("gpu and not gpu_exclusive", pytest_args), recorded,
                                    num_shards=num_shards, parallel=len(pairs) * args.workers_per_pair)[shard - 1]
    part = f" (part {shard} of {num_shards})" if num_shards > 1 else ""
    print(f"{len(exclusive) + len(shared)} GPU tests{part} on {num_gpus} GPUs: {len(exclusive)} alone first, then "
          f"{len(shared)} over {len(pairs)} pair(s) x {args.workers_per_pair} workers", flush=True)
    merged = dict(recorded)

    runs: list[tuple[str, Path, bool]] = []
    if exclusive:
        junit, stopped = run_pytest(exclusive, name="exclusive", gpus=",".join(map(str, range(num_gpus))),
                                    log_dir=args.log_dir, timeout=args.test_timeout * len(exclusive))
        runs.append(("the exclusive tests", junit, stopped))
        for i, (test, word) in enumerate(case_outcomes(junit).items(), 1):
            print(f"[alone {i}/{len(exclusive)}] {word} {test}", flush=True)
        merged.update({test: round(t, 1) for test, t in junit_durations(junit).items() if test in exclusive})
        write_durations(args.log_dir, merged)

    def save_durations(finished: list[tuple[str, Path, bool]]) -> None:
        # Written as tests finish, over the recorded ones: a run cut short, or a -k selection, loses no record.
        # Only the test that just finished is read: the earlier ones are in `merged` already.
        merged.update(measured_durations(finished[-1:], args.test_timeout))
        write_durations(args.log_dir, merged)

    runs += run_shared(shared, pairs=pairs, workers_per_pair=args.workers_per_pair, log_dir=args.log_dir,
                       timeout=args.test_timeout, on_done=save_durations)

    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for test, junit, stopped in runs:
        counts, failures = results(junit)
        if stopped:
            failures = [f"{test} (stopped after the timeout)"]
            counts["failed"] = max(counts["failed"], 1)
        for key in totals:
            totals[key] += counts[key]
        for failure in failures:
            print(f"FAILED {failure}")
    seconds = time.perf_counter() - begin
    print(f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped{part} "
          f"in {seconds:.0f} s on {num_gpus} GPUs ({torch.cuda.get_device_name(0)}); logs in {args.log_dir}")
    return 1 if totals["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
