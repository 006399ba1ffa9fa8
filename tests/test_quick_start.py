"""The README's quick start says what the code prints. Its quoted last line is the last training row of a recorded
run of the quick-start command (benchmarks/records/results/quickstart_tiny.json, that run's metrics.jsonl), and the
code today still computes that run: the same command with one flag, --train.max_steps=10 (a smoke run, which the
preset's 50-step warmup turns into a warning), takes the first 10 steps of the full run (the warmup's learning rates do
not depend on train.max_steps), so its step-10 row must be the record's, to the float.

When a change moves the numbers on purpose, run the quick start again from a fresh clone
(`torchrun --nproc_per_node=2 train_fsdp.py config/train_tiny_fsdp.yaml`), put its checkpoints/tiny/metrics.jsonl
into the record and its last training line into the README."""
from __future__ import annotations

import hashlib
import json
import re
import sys

import pytest

from tests.helpers import ROOT, TRAIN, job_env, read_metrics, run_job

RECORD = ROOT / "benchmarks/records/results/quickstart_tiny.json"
# The README's line: "[hh:mm:ss rank0] step 1000/1000 | loss 2.0200 | lr 3.00e-04 | grad_norm 0.748 | ..."
LOG_LINE = re.compile(r"\] step (\d+)/(\d+) \| loss (\S+) \| lr (\S+) \| grad_norm (\S+) \|")


def record() -> dict:
    return json.loads(RECORD.read_text())


def training_rows(rows: list[dict]) -> dict[int, dict]:
    return {row["step"]: row for row in rows if "loss" in row}


def quick_start_line() -> re.Match:
    """The training line the README quotes for its quick start (the first such line in the file)."""
    match = LOG_LINE.search((ROOT / "README.md").read_text())
    assert match, "the README quotes no training log line"
    return match


def test_the_readme_quotes_the_recorded_runs_last_step():
    line, rows = quick_start_line(), training_rows(record()["metrics"])
    step, max_steps = int(line.group(1)), int(line.group(2))
    assert step == max_steps == max(rows), "the README quotes the run's last step"
    row = rows[step]
    # As the training log formats them (fsdp_utils' TrainingLog): loss 4 decimals, lr 2, grad_norm 3.
    assert (line.group(3), line.group(4), line.group(5)) == (
        f"{row['loss']:.4f}", f"{row['lr']:.2e}", f"{row['grad_norm']:.3f}")
    assert record()["command"] in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_the_quick_start_command_still_computes_the_recorded_run(tmp_path):
    rec = record()
    python = sys.version.split()[0]
    if python != rec["python"]:  # the default corpus is this interpreter's standard library
        pytest.skip(f"the record's corpus is Python {rec['python']}'s standard library, this is {python}")
    # From an empty folder, as from a fresh clone: data/cache/ and checkpoints/tiny/ are made under it. Two ranks
    # forked as torchrun starts them (tests/launcher.py): the numbers are the ranks'.
    proc = run_job([str(TRAIN), str(ROOT / "config/train_tiny_fsdp.yaml"), "--train.max_steps=10"], nproc=2,
                   cwd=tmp_path, env=job_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "train.warmup_steps=50 exceeds train.max_steps=10: the run ends inside its warmup" in proc.stderr
    out = tmp_path / "checkpoints" / "tiny"
    tokenizer = hashlib.sha256((out / "tokenizer.model").read_bytes()).hexdigest()
    assert tokenizer == rec["tokenizer_sha256"], "the default corpus or its tokenizer training changed"
    got, want = training_rows(read_metrics(out))[10], training_rows(rec["metrics"])[10]
    for key in ("loss", "lr", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=0), (key, got, want)
