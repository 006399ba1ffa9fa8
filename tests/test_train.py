"""End-to-end runs of train_fsdp.py (real processes): a short run learns and writes its outputs; a data
problem ends every rank with one error line, no traceback and no hang."""
from __future__ import annotations

import math
import re

import pytest

from config import load_config
from data import load_prepared
from fsdp_utils.checkpoint.io import read_meta
from tests.helpers import losses, read_metrics, run_train

pytestmark = pytest.mark.slow  # every test here reads what a launched training run wrote

STEPS, EVAL_EVERY, LR, WARMUP = 30, 10, 1e-2, 2  # LR and WARMUP are the helper's TINY settings


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, corpus, dataset_dir):
    """30 steps of the helper's tiny model as ONE plain process (no torchrun), eval and TensorBoard on."""
    out = tmp_path_factory.mktemp("short_run")
    proc = run_train(f"--train.max_steps={STEPS}", f"--train.eval_interval={EVAL_EVERY}", "--train.eval_samples=4",
                     "--logging.trackers=[tensorboard]", nproc=1, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
    return out, proc


def test_single_process_run_without_torchrun(short_run):
    out, proc = short_run
    assert proc.returncode == 0
    assert "world size 1 on cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_loss_falls(short_run):
    out, _ = short_run
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # logging.interval=1: one row a step
    vocab = load_config(out / "config.yaml").model.vocab_size
    first, last5 = rows[0]["loss"], [r["loss"] for r in rows[-5:]]
    # At init the logits are near uniform: loss ~ ln(vocab) = ln(320) = 5.77.
    assert abs(first - math.log(vocab)) < 0.1
    # The small repetitive corpus is learnt fast: the last 5 steps' mean falls well below the first loss.
    assert sum(last5) / 5 < 0.5 * first


def test_validation_loss_logged_and_falls(short_run):
    out, _ = short_run
    val = {r["step"]: r["val_loss"] for r in read_metrics(out) if "val_loss" in r}
    assert sorted(val) == [10, 20, 30]  # every eval_interval steps (30 is also the last step)
    assert all(math.isfinite(v) for v in val.values())
    # Measured 2.53, 1.44, 1.12 against ln(320) = 5.77 at init.
    assert val[30] < val[10] < 0.6 * math.log(320)


def test_metrics_rows(short_run):
    out, _ = short_run
    rows = [r for r in read_metrics(out) if "loss" in r]
    # skipped_steps: train.skip_spikes (on by default) counts the spike-skipped steps, none in this quiet run.
    keys = {"step", "loss", "lr", "grad_norm", "tokens_per_sec_per_gpu", "mfu", "peak_mem_gib", "skipped_steps"}
    for row in rows:
        assert set(row) == keys and row["skipped_steps"] == 0
        assert row["grad_norm"] > 0 and math.isfinite(row["grad_norm"])
        assert row["tokens_per_sec_per_gpu"] > 0
        assert row["mfu"] is None  # no peak FLOP/s for a CPU (logging.peak_tflops=0)
        assert 0.01 < row["peak_mem_gib"] < 16  # the process's peak RSS: a tiny model's, far under the bound
    # Warmup-cosine: step 1 runs at LR * 1/WARMUP, step 2 at the peak, the last step near LR * min_lr_ratio.
    assert rows[0]["lr"] == pytest.approx(LR * 1 / WARMUP)
    assert rows[1]["lr"] == pytest.approx(LR)
    progress = (STEPS - 1 - WARMUP) / (STEPS - WARMUP)  # the last step is 0-based step 29
    assert rows[-1]["lr"] == pytest.approx(LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))))


def test_config_yaml_is_the_resolved_config(short_run, corpus):
    out, _ = short_run
    cfg = load_config(out / "config.yaml")  # loadable as a config file itself
    assert cfg.train.max_steps == STEPS and cfg.train.eval_interval == EVAL_EVERY
    assert cfg.model.vocab_size == 320  # resolved from the tokenizer (the preset says 0)
    assert cfg.model.dim == 64 and cfg.data.files == [str(corpus)]
    assert cfg.run.output_dir == str(out)


def test_tensorboard_events(short_run):
    out, _ = short_run
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "val/loss"} <= tags
    rows = [r for r in read_metrics(out) if "loss" in r]
    tb_loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    # The same values as metrics.jsonl, stored as float32.
    assert [s for s, _ in tb_loss] == [r["step"] for r in rows]
    assert [v for _, v in tb_loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [e.step for e in acc.Scalars("val/loss")] == [10, 20, 30]


def test_final_checkpoint_written(short_run):
    out, _ = short_run
    # checkpoint.interval=0: only the final save, named by its step.
    assert sorted(p.name for p in out.glob("fsdp_cpt*.pth")) == [f"fsdp_cpt{STEPS}.pth"]


# ---- data errors ------------------------------------------------------------------------------------

OUR_FRAMES = re.compile(r'File ".*(train_fsdp|data/|fsdp_utils/|config/)')


@pytest.mark.parametrize("nproc", [1, 2], ids=["python", "torchrun2"])
@pytest.mark.parametrize("problem", ["missing", "empty"])
def test_data_error_is_one_line(problem, nproc, tmp_path):
    if problem == "missing":
        path, message = "/nonexistent.txt", "error: data file not found: /nonexistent.txt"
    else:
        path = tmp_path / "empty.txt"
        path.write_text("")
        message = f"error: no text found in {path}"
    # A fresh dataset_dir: a failed preparation must not touch the session's shared cache. The timeout
    # turns a hang (a rank waiting in a collective for one that quit) into a failure, not a stuck suite.
    proc = run_train(f"--data.files=[{path}]", nproc=nproc, out_dir=tmp_path / "out", corpus=tmp_path / "unused.txt",
                     dataset_dir=tmp_path / "prepared", check=False, timeout=90)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, proc.stderr[-3000:]  # user errors exit 1 (config errors 2)
    # One line for the whole job: rank 0 reports, rank 1 gets the same outcome by broadcast and stays quiet.
    assert errors == [message], proc.stderr[-3000:]
    if nproc == 1:
        assert "Traceback" not in proc.stderr
    else:
        # torchrun prints its own launcher traceback (ChildFailedError) whenever a rank exits non-zero;
        # none of the frames may come from this project's code.
        assert not OUR_FRAMES.search(proc.stderr), proc.stderr[-3000:]
        assert "DataError" not in proc.stderr
    assert not (tmp_path / "out").exists()  # the run made the folder, and leaves none behind



def test_a_finished_run_started_again_says_there_is_nothing_to_train(tmp_path, corpus, dataset_dir):
    """The same command after the run reached train.max_steps: one line saying so and how to start afresh, exit 0,
    nothing written. A shorter run given the finished run's folder (a smoke run after the quick start, resumed
    by checkpoint.auto_resume): one error line saying how to start afresh, no learning-rate warning, nothing
    written either."""
    out = tmp_path / "out"
    run_train("--train.max_steps=2", nproc=1, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
    checkpoint = out / "fsdp_cpt2.pth"

    def files():  # but run.lock, each run's own
        return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "run.lock"}

    before = files()
    afresh = f"to start a new run, give it its own folder (--run.name=NAME, or run.output_dir; this one is {out})"
    line = (f"nothing to train: the run already reached train.max_steps=2 (checkpoint {checkpoint}); raise "
            f"train.max_steps to continue, or {afresh}")
    # checkpoint.auto_resume, then explicitly, then with other settings: the run's record of them stays as it was
    for extra, nproc in (((), 1), (("--resume_from", "latest"), 2), (("--train.lr=0.5",), 1)):
        proc = run_train("--train.max_steps=2", *extra, nproc=nproc, out_dir=out, corpus=corpus,
                         dataset_dir=dataset_dir)
        assert proc.returncode == 0 and proc.stderr.count(line) == 1, proc.stderr[-3000:]
        assert "step 1/" not in proc.stderr and "Traceback" not in proc.stderr
        assert files() == before
    for warmup in ("--train.warmup_steps=2", "--train.warmup_steps=1"):  # a lowered max_steps, with a warmup past it
        steps = 1
        proc = run_train(f"--train.max_steps={steps}", warmup, nproc=1, out_dir=out, corpus=corpus,
                         dataset_dir=dataset_dir, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and errors == [
            f"error: the run in {out} already reached step 2 (checkpoint {checkpoint}), past this command's "
            f"train.max_steps={steps}: {afresh}; to continue that run, raise train.max_steps above 2"], proc.stderr
        assert "learning rate jumps" not in proc.stderr and "step 1/" not in proc.stderr
        assert files() == before  # config.yaml too: the finished run's, not this command's


def test_epochs_are_counted_once_and_a_resume_on_another_world_size_keeps_the_count(tmp_path, corpus, dataset_dir):
    """train.epochs=0.5 on 2 ranks: ceil(0.5 x the training samples / 8) steps, said at the start, trained to the
    last and recorded in the checkpoints. Its step-10 checkpoint resumed on 1 rank, on a corpus that has grown since
    (0.5 epochs of it are more steps), runs to the same last step and says why."""
    epochs = ["--train.max_steps=null", "--train.epochs=0.5", "--checkpoint.interval=10", "--checkpoint.keep_last_n=0"]
    first = tmp_path / "first"
    proc = run_train(*epochs, nproc=2, out_dir=first, corpus=corpus, dataset_dir=dataset_dir)
    prepared = load_prepared(dataset_dir)
    tokens = sum(path.stat().st_size for path in prepared.train_files) // prepared.dtype.itemsize
    samples = (tokens - 1) // 32  # windows of data.seq_len=32 tokens, each with one more token for its last target
    steps = math.ceil(0.5 * samples / 8)  # global batch 8 (tests/helpers.py TINY)
    assert f"train.epochs=0.5: {steps} steps ({samples:,} samples of 32 tokens a pass, 8 samples a step)" in proc.stderr
    assert sorted(losses(first)) == list(range(1, steps + 1))
    assert f"step {steps}/{steps} " in proc.stderr  # the log line's count, which the ETA reads
    assert {key: read_meta(first / f"fsdp_cpt{steps}.pth")["train_state"][key] for key in ("max_steps", "epochs")} \
        == {"max_steps": steps, "epochs": 0.5}
    assert load_config(first / "config.yaml").train.max_steps == steps  # the count, loadable

    grown = tmp_path / "grown.txt"
    grown.write_text(corpus.read_text() * 2)
    resumed = tmp_path / "resumed"
    proc = run_train(*epochs, f"--resume_from={first / 'fsdp_cpt10.pth'}", f"--data.tokenizer_model="
                     f"{prepared.tokenizer_path}", nproc=1, out_dir=resumed, corpus=grown, dataset_dir=tmp_path / "ds")
    found = re.search(rf"train.epochs=0.5: {steps} steps, as the run's checkpoint recorded; this data would give "
                      rf"(\d+) \(", proc.stderr)
    assert found and int(found[1]) > steps, proc.stderr[-3000:]
    assert sorted(losses(resumed)) == list(range(11, steps + 1))


def test_a_run_that_fails_before_its_first_step_leaves_no_folder_it_made(tmp_path, corpus):
    """A tokenizer the corpus cannot give: the run.lock and the folder the run made go; a folder that was there, with
    a file of the user's in it, stays (with run.lock, the lock of the next run)."""
    too_large = ("--data.vocab_size=100000", "--train.max_steps=2")
    proc = run_train(*too_large, out_dir=tmp_path / "new", corpus=corpus, dataset_dir=tmp_path / "prepared",
                     check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "data.vocab_size=100000 is too large" in errors[0], errors
    assert not (tmp_path / "new").exists()
    there = tmp_path / "there"
    there.mkdir()
    (there / "notes.txt").write_text("the user's own file")
    proc = run_train(*too_large, out_dir=there, corpus=corpus, dataset_dir=tmp_path / "prepared", check=False)
    assert proc.returncode == 1 and sorted(p.name for p in there.iterdir()) == ["notes.txt", "run.lock"]
    assert (there / "notes.txt").read_text() == "the user's own file"


def records(out) -> list[str]:
    return sorted(p.name for p in out.glob("config*.yaml"))


def test_a_resume_keeps_config_yaml_and_records_other_settings_beside_it(tmp_path, corpus, dataset_dir):
    """config.yaml holds the settings the run started with, whatever comes after. A resume with the same settings
    adds nothing; one with others adds config.1.yaml, whose first line says from which step they hold."""
    out, args = tmp_path / "out", ("--train.max_steps=4", "--checkpoint.interval=2", "--checkpoint.keep_last_n=0")
    proc = run_train(*args, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, check=False,
                     faults={"nan_at_step": 3})  # stopped after the save of step 2
    assert proc.returncode == 1 and "non-finite loss" in proc.stderr
    first = (out / "config.yaml").read_bytes()
    run_train(*args, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)  # the same command: from step 2 to 4
    assert records(out) == ["config.yaml"] and (out / "config.yaml").read_bytes() == first
    run_train("--train.max_steps=6", "--train.lr=0.5", *args[1:], out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
    assert records(out) == ["config.1.yaml", "config.yaml"] and (out / "config.yaml").read_bytes() == first
    assert (out / "config.1.yaml").read_text().splitlines()[0] == (
        f"# this run's settings from step 4 on (resumed from {out / 'fsdp_cpt4.pth'}); config.yaml holds those it "
        "started with")
    started, resumed = load_config(out / "config.yaml").train, load_config(out / "config.1.yaml").train
    assert (started.lr, started.max_steps, resumed.lr, resumed.max_steps) == (LR, 4, 0.5, 6)


def test_a_fresh_run_keeps_the_users_files_in_its_folder_aside(tmp_path, corpus, dataset_dir):
    """The folder chosen for a new run holds the user's own config.yaml, metrics.jsonl and tensorboard/: each is kept
    as kept-<name> with a warning, and the run writes its own."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("the user's config\n")
    (out / "metrics.jsonl").write_text('{"users": 1}\n')
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "notes.txt").write_text("the user's notes\n")
    proc = run_train("--train.max_steps=2", "--logging.trackers=[tensorboard]", nproc=1, out_dir=out, corpus=corpus,
                     dataset_dir=dataset_dir)
    assert (out / "kept-config.yaml").read_text() == "the user's config\n"
    assert (out / "kept-metrics.jsonl").read_text() == '{"users": 1}\n'
    assert (out / "kept-tensorboard" / "notes.txt").read_text() == "the user's notes\n"
    assert [row["step"] for row in read_metrics(out)] == [1, 2]
    assert load_config(out / "config.yaml").train.max_steps == 2
    for name in ("config.yaml", "metrics.jsonl", "tensorboard"):
        assert f"{name} is in the way of this run's {name} and is not something this run made" in proc.stderr
