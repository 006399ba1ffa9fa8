"""Problems found before the process group starts: each ends the run with one `error:`
line, printed once even with 2 ranks, exit status 2, and no traceback from the workers (under a real
torchrun the one traceback is torchrun's own report that a worker failed). The 2-rank jobs run as forked
ranks (tests/launcher.py), which get torchrun's variables and are stopped as torchrun stops them; one runs
under a real torchrun, for its report."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from config import ConfigError, load_config
from tests.helpers import ROOT, TINY, TRAIN, assert_refused_before_the_process_group, job_env, run_job, run_train

CONFIG = ROOT / "config/train_tiny_fsdp.yaml"


def launch(*args: str, config: Path = CONFIG, nproc: int, tmp_path: Path, corpus: Path, dataset_dir: Path,
           torchrun: bool = False):
    """train_fsdp.py as `nproc` forked ranks, as torchrun would start them (or a one-rank job, as python would), or
    under a real torchrun (`torchrun`, or FSDP_TEST_LAUNCH=process); into tmp_path/out unless args say
    otherwise."""
    argv = [str(TRAIN), str(config), *TINY, f"--run.output_dir={tmp_path / 'out'}", f"--data.files=[{corpus}]",
            f"--data.dataset_dir={dataset_dir}", *args]
    start = time.monotonic()
    proc = run_job(argv, nproc=nproc, env=job_env(), timeout=180, real_processes=torchrun)
    proc.seconds = time.monotonic() - start
    return proc


def assert_refused(proc, needle: str, *, nproc: int) -> str:
    """One error line holding `needle`, the workers' status 2, no traceback of ours, and no waiting."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-4000:]
    if nproc == 1:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    else:
        assert_refused_before_the_process_group(proc)
    # Rank 1 waits for torchrun to stop it once rank 0 has failed, never its full minute.
    assert proc.seconds < 50, f"took {proc.seconds:.0f} s"
    return errors[0]


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory, corpus, dataset_dir) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    run_train("--train.max_steps=1", "--train.warmup_steps=1", "--checkpoint.format=sharded", nproc=1, out_dir=out,
              corpus=corpus, dataset_dir=dataset_dir)
    return out / "fsdp_sharded_cpt1"


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A directory this test's processes cannot create anything in: read-only by its mode, or, for root
    (whom modes do not stop), by the immutable attribute."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
    elif subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("running as root, and chattr +i (the only way to refuse root a write here) is not available")
    yield path
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    path.chmod(0o755)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_output_dir_not_writable(nproc, read_only_dir, corpus, dataset_dir, tmp_path):
    out = read_only_dir / "run"
    proc = launch(f"--run.output_dir={out}", nproc=nproc, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
    assert_refused(proc, f"run.output_dir={out} is not writable", nproc=nproc)


@pytest.mark.slow
def test_output_dir_is_a_file(corpus, dataset_dir, tmp_path):
    out = tmp_path / "a-file"
    out.write_text("not a directory")
    proc = launch(f"--run.output_dir={out}", nproc=1, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
    assert_refused(proc, f"run.output_dir={out} is a file", nproc=1)
    assert out.read_text() == "not a directory"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu(corpus, dataset_dir, tmp_path):
    proc = launch("--run.device=cuda", nproc=2, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
    assert_refused(proc, "run.device=cuda but no CUDA device is visible", nproc=2)


@pytest.mark.slow
def test_fp16_on_the_cpu_is_refused_naming_bf16_by_check_and_by_a_run(corpus, dataset_dir, tmp_path):
    for extra in (("--check",), ()):
        proc = launch("--train.precision=fp16", *extra, nproc=1, tmp_path=tmp_path, corpus=corpus,
                      dataset_dir=dataset_dir)
        line = assert_refused(proc, "train.precision=fp16 on run.device=cpu", nproc=1)
        assert "train.precision=bf16" in line, line
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_epochs_and_max_steps_both_set_are_one_line_by_check_and_by_a_run(corpus, dataset_dir, tmp_path):
    for extra in (("--check",), ()):  # the tiny preset sets train.max_steps
        proc = launch("--train.epochs=2", *extra, nproc=1, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
        line = assert_refused(proc, "train.epochs=2 and train.max_steps=1000 are both set: give one", nproc=1)
        assert line.endswith("(--train.max_steps=null drops a config file's)"), line


def test_fp16_is_refused_wherever_the_run_lands_on_the_cpu(tmp_path):
    from config import launch_problems

    def problems(*overrides: str, num_gpus: int) -> list[str]:
        cfg = load_config(CONFIG, [*overrides, f"--run.output_dir={tmp_path}"])
        return [p for p in launch_problems(cfg, world_size=1, local_world_size=1, num_gpus=num_gpus) if "fp16" in p]

    assert len(problems("--train.precision=fp16", "--run.device=auto", num_gpus=0)) == 1  # auto without GPUs: the CPU
    assert problems("--train.precision=fp16", "--run.device=auto", num_gpus=1) == []
    assert problems("--train.precision=fp16", "--run.device=cuda", num_gpus=1) == []
    assert len(problems("--train.precision=fp16", "--run.device=cpu", num_gpus=1)) == 1
    assert problems("--train.precision=bf16", "--run.device=cpu", num_gpus=0) == []


@pytest.mark.slow
def test_hybrid_group_size_not_dividing_the_world(corpus, dataset_dir, tmp_path):
    proc = launch("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.hybrid_shard_group_size=3", nproc=2,
                  tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir, torchrun=True)
    assert_refused(proc, "fsdp.hybrid_shard_group_size=3 does not divide the world size 2", nproc=2)


@pytest.mark.slow
def test_non_finite_numbers(corpus, dataset_dir, tmp_path):
    # Every spelling YAML has for them, through the config loader; one of them as users launch it.
    for value in ("nan", "inf", "-inf", ".nan", ".inf", "-.Inf"):
        with pytest.raises(ConfigError) as err:
            load_config(CONFIG, [*TINY, f"--train.lr={value}"])
        (line,) = err.value.problems
        assert line.startswith("train.lr: must be a finite number"), (value, line)
    proc = launch("--train.lr=nan", nproc=2, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
    assert_refused(proc, "train.lr: must be a finite number", nproc=2)


@pytest.mark.slow
def test_a_directory_as_the_config(corpus, dataset_dir, tmp_path):
    proc = launch(config=ROOT / "config", nproc=1, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
    assert_refused(proc, f"{ROOT / 'config'} is a directory; give a config file", nproc=1)


@pytest.mark.slow
def test_a_random_file_to_resume_from(corpus, dataset_dir, tmp_path):
    junk = tmp_path / "notes.pth"
    junk.write_bytes(os.urandom(4096))
    proc = launch(f"--resume_from={junk}", nproc=1, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
    assert_refused(proc, f"{junk}: not a checkpoint (not a file written by torch.save)", nproc=1)


@pytest.mark.slow
def test_a_sharded_checkpoint_missing_a_file(sharded_checkpoint, corpus, dataset_dir, tmp_path):
    damaged = tmp_path / sharded_checkpoint.name
    shutil.copytree(sharded_checkpoint, damaged)
    (damaged / "__0_0.distcp").unlink()
    proc = launch(f"--resume_from={damaged}", nproc=2, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
    assert_refused(proc, f"{damaged / '__0_0.distcp'}: missing", nproc=2)


@pytest.mark.slow
def test_resume_from_latest_with_nothing_to_resume_is_refused_by_check(sharded_checkpoint, corpus, dataset_dir,
                                                                        tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".tmp-fsdp_cpt2.pth").write_bytes(b"partial")  # an interrupted save is nothing to resume from
    for extra in (("--check",), ()):  # --check says it, and a run stops there too, before the process group
        proc = launch("--resume_from=latest", *extra, nproc=1, tmp_path=tmp_path, corpus=corpus,
                      dataset_dir=dataset_dir)
        assert_refused(proc, f"--resume_from latest: no complete checkpoint in {out} (run.output_dir)", nproc=1)
    shutil.copytree(sharded_checkpoint, out / sharded_checkpoint.name)
    proc = launch("--resume_from=latest", "--check", "--checkpoint.format=sharded", nproc=1, tmp_path=tmp_path,
                  corpus=corpus, dataset_dir=dataset_dir)
    assert proc.returncode == 0 and "error" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_model_too_large_for_host_memory(corpus, dataset_dir, tmp_path):
    # 11 TB of fp32 weights on a CPU: refused before the model is built, not by the allocator or the OOM killer.
    proc = launch("--model.dim=65536", "--model.n_heads=64", "--model.n_kv_heads=8", "--model.n_layers=64", nproc=1,
                  tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: the model (dim 65536, 64 layers, ffn 174848, vocab 320: ") and \
        " GiB of host memory for its fp32 weights alone, " in errors[0], errors[0]
    assert proc.seconds < 50


@pytest.mark.slow
def test_every_launch_problem_at_once(corpus, dataset_dir, tmp_path):
    """The launch's problems come together, one line each (the config's own come in one list too)."""
    (tmp_path / "file").write_text("x")
    proc = launch("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.hybrid_shard_group_size=3",
                  f"--run.output_dir={tmp_path / 'file'}", "--resume_from=/no/such/checkpoint",
                  nproc=1, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_the_cuda_allocator_grows_segments_unless_the_user_configured_it(monkeypatch):
    from fsdp_utils.distributed import ALLOCATOR_VARIABLES, prefer_expandable_segments

    for name in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    prefer_expandable_segments()
    assert all(os.environ[name] == "expandable_segments:True" for name in ALLOCATOR_VARIABLES)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's: left as it is
    prefer_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512" and "PYTORCH_ALLOC_CONF" not in os.environ


@pytest.mark.slow
def test_check_refuses_what_the_run_would_refuse_before_its_first_step(corpus, dataset_dir, tmp_path):
    """--check runs the checks the run makes before its first step that need no GPU: with a finished run's folder,
    each refusal of the run is --check's too, in the run's words (exit 2 here, where the run exits 1 or 2)."""
    out = tmp_path / "out"
    run_train("--train.max_steps=2", "--checkpoint.interval=1", "--checkpoint.keep_last_n=0", nproc=1, out_dir=out,
              corpus=corpus, dataset_dir=dataset_dir)
    refusals = {
        "a lowered train.max_steps": ("--train.max_steps=1",),
        "a fresh start over checkpoints": ("--train.max_steps=4", "--checkpoint.auto_resume=false"),
        "an older checkpoint over newer": ("--train.max_steps=4", f"--resume_from={out / 'fsdp_cpt1.pth'}"),
        "a missing data file": ("--train.max_steps=4", f"--data.files=[{tmp_path / 'missing.txt'}]"),
    }
    for what, args in refusals.items():
        run = launch(*args, nproc=1, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
        line = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert run.returncode in (1, 2) and len(line) == 1, (what, run.stderr[-3000:])
        checked = launch("--check", *args, nproc=1, tmp_path=tmp_path, corpus=corpus, dataset_dir=dataset_dir)
        assert assert_refused(checked, line[0].removeprefix("error: "), nproc=1) == line[0], what
    passed = launch("--check", "--train.max_steps=4", nproc=1, tmp_path=tmp_path, corpus=corpus,
                    dataset_dir=dataset_dir)
    assert passed.returncode == 0 and "error" not in passed.stderr, passed.stderr[-3000:]
