"""Run every GPU test in one call, spread over the machine's GPUs.

    python scripts/run_gpu_tests.py                    # all tests marked `gpu`
    python scripts/run_gpu_tests.py -k matrix          # extra arguments go to pytest (selection only)

Tests marked `gpu_exclusive` (they measure GPU memory, or need more than 2 GPUs) run first, one pytest with
every GPU visible. The others run next in parallel pytest processes ("workers"): each worker sees one pair
of GPUs (CUDA_VISIBLE_DEVICES), disjoint pairs where the machine has 4 or more, several workers per pair
(the tests train small models: a pair has room and compute for a few at once). The tests are dealt to the
workers in turn. Prints one line per failure and a closing `N passed, N failed, N skipped` line; exits
non-zero if anything failed. The logs and JUnit files of every worker are kept in --log_dir.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collect(marker: str, pytest_args: list[str]) -> list[str]:
    """Node ids of the tests selected by the marker expression (and the extra pytest arguments)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker, *pytest_args],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 5):  # 5: nothing collected
        sys.exit(f"error: collecting the GPU tests failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return [line for line in proc.stdout.splitlines() if "::" in line]


def start(tests: list[str], *, name: str, gpus: str, log_dir: Path) -> tuple[subprocess.Popen, Path]:
    junit = log_dir / f"{name}.xml"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    log = (log_dir / f"{name}.log").open("w")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           f"--basetemp={log_dir / ('tmp-' + name)}", *tests]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), junit


def results(junit: Path) -> tuple[dict[str, int], list[str]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    if not junit.exists():
        return counts, [f"{junit.stem}: no results (the worker crashed: see {junit.with_suffix('.log')})"]
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome in ("failure", "error"):
            counts["failed"] += 1
            failures.append(f"{case.get('classname')}::{case.get('name')}")
        elif outcome == "skipped":
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers_per_pair", type=int, default=3, help="parallel pytest processes per GPU pair")
    parser.add_argument("--log_dir", type=Path, default=Path("/tmp/gpu-tests"))
    args, pytest_args = parser.parse_known_args(argv)
    import torch

    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        print(f"error: the GPU suite needs at least 2 GPUs; this machine has {num_gpus}", file=sys.stderr)
        return 2
    if args.workers_per_pair < 1:
        print("error: --workers_per_pair must be at least 1", file=sys.stderr)
        return 2
    args.log_dir.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    exclusive = collect("gpu and gpu_exclusive", pytest_args)
    shared = collect("gpu and not gpu_exclusive", pytest_args)
    pairs = [f"{i},{i + 1}" for i in range(0, num_gpus - 1, 2)]
    print(f"{len(exclusive) + len(shared)} GPU tests on {num_gpus} GPUs: {len(exclusive)} alone first, then "
          f"{len(shared)} over {len(pairs)} pair(s) x {args.workers_per_pair} workers", flush=True)

    junits = []
    if exclusive:
        proc, junit = start(exclusive, name="exclusive", gpus=",".join(map(str, range(num_gpus))), log_dir=args.log_dir)
        proc.wait()
        junits.append(junit)
    workers = len(pairs) * args.workers_per_pair
    running = []
    for w in range(min(workers, len(shared))):
        tests = shared[w::workers]
        running.append(start(tests, name=f"worker{w}", gpus=pairs[w % len(pairs)], log_dir=args.log_dir))
    for proc, junit in running:
        proc.wait()
        junits.append(junit)

    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for junit in junits:
        counts, failures = results(junit)
        for key in totals:
            totals[key] += counts[key]
        for failure in failures:
            print(f"FAILED {failure}")
    seconds = time.perf_counter() - begin
    print(f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped "
          f"in {seconds:.0f} s on {num_gpus} GPUs ({torch.cuda.get_device_name(0)}); logs in {args.log_dir}")
    return 1 if totals["failed"] or any(not j.exists() for j in junits) else 0


if __name__ == "__main__":
    sys.exit(main())
