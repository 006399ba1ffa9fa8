"""Training jobs and data (real processes, gloo on the CPU): in-job preparation that outlasts the collective
timeout, a corpus too large to prepare in a job, and a mixture of prepared folders that resumes exactly
on another number of ranks."""
from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from benchmarks.benchmark_data import write_corpus
from data import PrepareSettings, load_prepared, prepare_data
from tests.helpers import ROOT, job_env, losses, run_job, run_train
from tests.test_data import make_documents
from tests.test_failures import Job, alive, poll, train_cmd
from tests.test_prepare import jsonl_lines

pytestmark = pytest.mark.slow


def test_in_job_preparation_longer_than_the_collective_timeout_trains(tmp_path):
    # Rank 0 prepares the corpus inside the job while rank 1 waits: on a file, not in a collective, which
    # would give up after run.timeout_s=5. Its tokenizer training, slowed by 8 s (a test fault), makes the
    # preparation outlast that timeout.
    corpus = write_corpus(tmp_path / "c.jsonl", 1)
    proc = run_train("--data.max_corpus_mb=0", "--run.timeout_s=5", "--data.num_workers=0", "--train.max_steps=2",
                     nproc=2, out_dir=tmp_path / "out", corpus=corpus, dataset_dir=tmp_path / "prepared", timeout=400,
                     faults={"tokenizer_training_delay_s": 8})
    seconds = json.loads((tmp_path / "prepared" / "meta.json").read_text())["seconds"]
    assert sum(seconds.values()) > 5, (f"the preparation must outlast run.timeout_s for the test to mean anything: "
                                       f"{seconds}")
    assert "Timed out" not in proc.stderr and sorted(losses(tmp_path / "out")) == [1, 2]


def test_corpus_too_large_for_the_job_is_one_line(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", 2)
    proc = run_train("--data.max_in_job_mb=1", nproc=2, out_dir=tmp_path / "out", corpus=corpus,
                     dataset_dir=tmp_path / "prepared", check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and errors == [
        f"error: the corpus is {corpus.stat().st_size / 2**20:.0f} MB, more than data.max_in_job_mb=1 prepares inside "
        "a training job: prepare it first with `python scripts/prepare_data.py CONFIG --data.dataset_dir=DIR`, then "
        "train with --data.dataset_dir=DIR"], proc.stderr[-3000:]
    assert not (tmp_path / "prepared" / "meta.json").exists()


def test_out_of_range_token_ids_stop_the_run_before_step_1(tmp_path, corpus):
    # A shard overwritten with ids past the vocabulary, its size unchanged: the embedding would fail on them with
    # an IndexError; the shard's hash check ends the run with one line before the first step.
    dataset_dir = tmp_path / "prepared"
    prepare_data(dataset_dir, PrepareSettings(files=(str(corpus),), vocab_size=320, num_workers=0),
                 show_progress=False)
    shard = dataset_dir / "train-00000.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[len(tokens) // 2 :] = 65535
    tokens.tofile(shard)
    proc = run_train("--data.files=[]", "--data.vocab_size=320", out_dir=tmp_path / "out", corpus=corpus,
                     dataset_dir=dataset_dir, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {shard}: bytes ") and "do not match the hash meta.json recorded" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not losses(tmp_path / "out")


def test_unwritable_dataset_dir_ends_every_rank_at_once(tmp_path, corpus):
    # Rank 0 cannot create the dataset folder; its outcome goes to the output directory, so rank 1 learns of
    # the failure instead of waiting until torchrun kills it.
    (tmp_path / "a_file").write_text("in the way")
    dataset_dir = tmp_path / "a_file" / "prepared"
    proc = run_train(nproc=2, out_dir=tmp_path / "out", corpus=corpus, dataset_dir=dataset_dir, check=False,
                     timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert errors == [f"error: cannot create {dataset_dir}: Not a directory"], proc.stderr[-3000:]
    # Every rank ends by itself: at most, torchrun asks the one that ends last to stop (SIGTERM) while it
    # is on its way out; it never has to force one out (SIGKILL) after its shutdown timeout.
    assert "SIGKILL" not in proc.stderr and "exitcode  : -9" not in proc.stderr, proc.stderr[-3000:]


def test_stop_signal_ends_a_rank_waiting_for_the_data(tmp_path):
    # Rank 0 prepares a corpus that takes a while; rank 1, waiting for it, gets SIGTERM and must end
    # at once with one line, not when torchrun finally kills it.
    corpus = write_corpus(tmp_path / "c.jsonl", 30)
    job = Job(train_cmd("--data.num_workers=1", "--data.vocab_size=8192", "--data.max_corpus_mb=0", nproc=2,
                        out_dir=tmp_path / "out", corpus=corpus, dataset_dir=tmp_path / "prepared"), tmp_path / "logs")
    try:
        poll(lambda: (tmp_path / "prepared" / "progress.json").exists(), job=job, timeout=120,
             what="rank 0 preparing the data")
        ranks = poll(lambda: (found := job.workers()) and len(found) == 2 and found, job=job, timeout=30,
                     what="2 ranks")
        time.sleep(1)  # rank 1 is past the job-id broadcast, polling for rank 0's outcome
        sent = time.monotonic()
        os.kill(ranks[1], signal.SIGTERM)
        while alive(ranks[1]) and time.monotonic() - sent < 10:
            time.sleep(0.05)
        assert not alive(ranks[1]), "rank 1 did not end within 10 s of SIGTERM"
        assert alive(ranks[0]), "rank 0 ended first: the test did not test a waiting rank"
        said = [line for line in job.stderr.splitlines() if "rank1]" in line and "waiting for rank 0" in line]
        assert len(said) == 1 and said[0].endswith(
            f"SIGTERM received while waiting for rank 0 to prepare the data in {tmp_path / 'prepared'}: stopping (a "
            f"rerun continues or reuses the preparation)"), job.stderr[-3000:]
        assert "Traceback" not in job.stderr
    finally:
        job.kill()


def test_mixture_trains_and_resumes_at_another_world_size(tmp_path, corpus):
    # Source a: prepared by the command, as users do; source b: another corpus with a's tokenizer.
    a, b = tmp_path / "a", tmp_path / "b"
    proc = run_job([str(ROOT / "scripts/prepare_data.py"), str(ROOT / "config/train_tiny_fsdp.yaml"),
                    f"--data.files=[{corpus}]", f"--data.dataset_dir={a}", "--data.vocab_size=320"], env=job_env())
    assert proc.returncode == 0 and f"train on it with: --data.dataset_dir={a}" in proc.stdout, proc.stderr
    (tmp_path / "b.jsonl").write_text(jsonl_lines(make_documents(300, seed=4)))
    prepare_data(b, PrepareSettings(files=(str(tmp_path / "b.jsonl"),), tokenizer_model=str(a / "tokenizer.model"),
                                    num_workers=1), show_progress=False)
    mixture = [f"--data.sources=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3}}]", "--data.files=[]",
               "--data.dataset_dir=", "--train.max_steps=6", "--train.global_batch_size=12", "--train.eval_interval=6",
               "--checkpoint.interval=3"]
    run_train(*mixture, nproc=2, out_dir=tmp_path / "two", corpus=corpus, dataset_dir=tmp_path / "unused")
    resumed = run_train(*mixture, f"--resume_from={tmp_path / 'two' / 'fsdp_cpt3.pth'}", nproc=3,
                        out_dir=tmp_path / "three", corpus=corpus, dataset_dir=tmp_path / "unused")
    num_train = load_prepared(a).num_train_tokens + load_prepared(b).num_train_tokens
    assert f"train {num_train:,} tokens" in resumed.stderr
    two, three = losses(tmp_path / "two"), losses(tmp_path / "three")
    assert sorted(three) == [4, 5, 6]
    for step in three:
        # The same samples in the same order on 3 ranks as on 2: equal up to the reduction order.
        assert three[step] == pytest.approx(two[step], rel=1e-4, abs=0), (step, two, three)
