"""scripts/generate.py on a checkpoint from a real (short) training run: a fixed seed gives the same text,
another seed other text, greedy decoding ignores the seed, and the output starts with the prompt."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from scripts import generate
from tests.helpers import ROOT, job_env, run_job, run_train

pytestmark = pytest.mark.slow  # samples from a trained checkpoint

pytest.importorskip("sentencepiece")
PROMPT = "The quick brown"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus, dataset_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("run_generate")
    run_train("--train.max_steps=4", out_dir=run_dir, corpus=corpus, dataset_dir=dataset_dir)
    return run_dir / "fsdp_cpt4.pth"


def cli(checkpoint: Path, *args: str) -> str:
    """scripts/generate.py as a forked process (tests/launcher.py), as `python` would run it."""
    argv = [str(ROOT / "scripts/generate.py"), str(checkpoint), "--prompt", PROMPT, "--device", "cpu", *args]
    proc = run_job(argv, env=job_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# Temperature 1.5 over the whole vocabulary, 40 tokens: two seeds agreeing everywhere is practically impossible.
SAMPLING = ("--temperature", "1.5", "--top_k", "0", "--max_new_tokens", "40")


def test_seeded_sampling_is_deterministic(checkpoint):
    first, second = cli(checkpoint, *SAMPLING, "--seed", "3"), cli(checkpoint, *SAMPLING, "--seed", "3")
    assert first == second
    assert first.startswith(PROMPT) and len(first.rstrip("\n")) > len(PROMPT)
    other = generate.generate(checkpoint, PROMPT, temperature=1.5, top_k=0, max_new_tokens=40, seed=4, device="cpu")
    assert other + "\n" != first
    # The in-process API and the script agree.
    assert generate.generate(checkpoint, PROMPT, temperature=1.5, top_k=0, max_new_tokens=40, seed=3,
                             device="cpu") + "\n" == first


def test_greedy_ignores_the_seed(checkpoint):
    runs = {generate.generate(checkpoint, PROMPT, temperature=0, max_new_tokens=30, seed=seed, device="cpu")
            for seed in (0, 1, 2)}
    assert len(runs) == 1 and runs.pop().startswith(PROMPT)


def test_top_k_1_is_greedy_and_long_prompts_are_cropped(checkpoint, corpus):
    prompt = corpus.read_text()[:400]  # well over max_seq_len=32 tokens
    greedy = generate.generate(checkpoint, prompt, temperature=0, max_new_tokens=40, device="cpu")
    assert greedy.startswith(prompt)
    assert generate.generate(checkpoint, prompt, temperature=0.7, top_k=1, max_new_tokens=40, seed=9,
                             device="cpu") == greedy


def test_errors(checkpoint, tmp_path, capsys):
    def error(*args: str) -> str:
        assert generate.main([*args]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err, err
        return err

    assert "no such file" in error(str(tmp_path / "missing.pth"), "--prompt", "x")
    (tmp_path / "notes.pth").write_text("hello")
    assert "not a checkpoint" in error(str(tmp_path / "notes.pth"), "--prompt", "x")
    assert error(str(checkpoint), "--prompt", "x", "--temperature", "-1") == \
        "error: --temperature must be 0 (greedy) or a finite number of at least 1e-06, got -1.0"
    # nan reached torch.multinomial with a real checkpoint: a traceback, not an error line.
    assert error(str(checkpoint), "--prompt", "x", "--temperature", "nan").startswith("error: --temperature must be 0")
    assert "no such tokenizer" in error(str(checkpoint), "--prompt", "x", "--tokenizer", str(tmp_path / "none.model"))
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copyfile(checkpoint, lone / checkpoint.name)
    assert "--tokenizer" in error(str(lone / checkpoint.name), "--prompt", "x")


def test_sampling_arguments_out_of_range_are_one_line(tmp_path, capsys):
    """nan passes a plain `temperature < 0` test and would reach torch.multinomial (a traceback); so would a seed
    past 64 bits (torch's overflow). All problems come in one line, before the checkpoint is even looked at."""
    for temperature in ("nan", "inf", "-0.5", "1e-30"):
        assert generate.main([str(tmp_path / "missing.pth"), "--prompt", "x", "--temperature", temperature]) == 1
        err = capsys.readouterr().err
        assert err == (f"error: --temperature must be 0 (greedy) or a finite number of at least 1e-06, got "
                       f"{float(temperature)}\n")
    assert generate.main([str(tmp_path / "missing.pth"), "--prompt", "x", "--max_new_tokens", "0", "--top_k", "-1",
                          "--seed", str(2**64)]) == 1
    assert capsys.readouterr().err == ("error: --max_new_tokens must be positive, got 0; --top_k must be 0 (all "
                                       f"tokens) or positive, got -1; --seed must be in [0, 2**63 - 1], got {2**64}\n")


def test_a_prompt_that_is_not_utf8_is_one_line(tmp_path, capsys):
    """$'import os\\xff' on the command line reaches Python as a surrogate escape (os.fsdecode), which SentencePiece
    refused with a RuntimeError traceback. The fixture's trained checkpoint, with its tokenizer beside it."""
    fixture = ROOT / "tests/fixtures/checkpoints_2026_12"
    shutil.copytree(fixture / "full", tmp_path / "run")
    shutil.copyfile(fixture / "tokenizer.model", tmp_path / "run/tokenizer.model")
    for chat in ([], ["--chat"]):
        assert generate.main([str(tmp_path / "run/fsdp_cpt2.pth"), "--prompt", os.fsdecode(b"import os\xff"),
                              "--device", "cpu", *chat]) == 1
        assert capsys.readouterr().err == "error: --prompt is not valid UTF-8 text (at character 9)\n"
