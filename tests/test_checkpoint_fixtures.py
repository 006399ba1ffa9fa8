"""Checkpoints written by an earlier version of the code still resume, and the steps after the resume give the
losses that version's uninterrupted run gave (tests/fixtures/checkpoints_2026_12/README.md says how they were
made)."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.helpers import ROOT, TRAIN, job_env, losses, read_metrics, run_job

pytestmark = pytest.mark.slow  # each test trains two steps in a launched job

FIXTURES = ROOT / "tests/fixtures/checkpoints_2026_12"
# The run that wrote the fixtures, but for its output folder, its checkpoint format and the prepared data's folder.
FIXTURE_ARGS = [
    "--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.max_seq_len=32",
    "--data.seq_len=32", "--train.global_batch_size=4", "--train.micro_batch_size=1", "--train.warmup_steps=1",
    "--train.eval_interval=0", "--logging.interval=1", "--logging.trackers=[]", "--train.max_steps=4",
    "--checkpoint.interval=2", "--checkpoint.keep_last_n=5", "--run.device=cpu",
]


@pytest.mark.parametrize(("fmt", "checkpoint", "nproc"), [
    ("full", "full/fsdp_cpt2.pth", 2),
    ("full", "full/fsdp_cpt2.pth", 1),
    ("sharded", "sharded/fsdp_sharded_cpt2", 2),
    ("sharded", "sharded/fsdp_sharded_cpt2", 1),  # saved by 2 ranks, resumed by one
])
def test_a_checkpoint_of_the_earlier_code_resumes_exactly(fmt, checkpoint, nproc, tmp_path):
    # The fixture is copied: a resume must not depend on writing into the repository.
    shutil.copytree(FIXTURES, tmp_path / "fixture")
    fixture = tmp_path / "fixture"
    out = tmp_path / "run"
    argv = [str(TRAIN), str(ROOT / "config/train_tiny_fsdp.yaml"), *FIXTURE_ARGS, f"--run.output_dir={out}",
            f"--data.files=[{fixture / 'corpus.txt'}]", f"--data.tokenizer_model={fixture / 'tokenizer.model'}",
            f"--data.dataset_dir={tmp_path / 'prepared'}", f"--checkpoint.format={fmt}",
            f"--resume_from={fixture / checkpoint}"]
    proc = run_job(argv, nproc=nproc, env=job_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    # expected.json: steps 3 and 4 of the uninterrupted 4-step run that saved the fixture at step 2.
    expected = json.loads((FIXTURES / "expected.json").read_text())[fmt]
    got = {row["step"]: row for row in read_metrics(out) if "loss" in row}
    assert sorted(losses(out)) == [3, 4]
    for step, want in expected.items():
        row = got[int(step)]
        # The same arithmetic in the same order: equal but for the last bits of another CPU's vector units.
        assert math.isclose(row["loss"], want["loss"], rel_tol=1e-5), (step, row["loss"], want["loss"])
        assert math.isclose(row["grad_norm"], want["grad_norm"], rel_tol=1e-4), (step, row, want)
