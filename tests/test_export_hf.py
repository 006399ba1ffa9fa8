"""scripts/export_hf.py: the exported LlamaForCausalLM computes our logits, the exported tokenizer encodes
like the run's SentencePiece model, and bad inputs or outputs give one error line and touch nothing."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_utils.checkpoint import FORMAT_VERSION, TrainState
from fsdp_utils.checkpoint.io import load_model
from model import ModelConfig, Transformer
from scripts import export_hf
from tests.helpers import ROOT, random_model, run_train

pytestmark = pytest.mark.slow  # trains and exports real checkpoints

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, dataset_dir) -> dict[str, Path]:
    """Checkpoints written by real (2-step) training runs: {"full": fsdp_cpt2.pth, "sharded": fsdp_sharded_cpt2/}."""
    out = {}
    for fmt in ("full", "sharded"):
        run_dir = tmp_path_factory.mktemp(f"run_{fmt}")
        run_train("--train.max_steps=2", f"--checkpoint.format={fmt}", out_dir=run_dir, corpus=corpus,
                  dataset_dir=dataset_dir)
        out[fmt] = run_dir / ("fsdp_cpt2.pth" if fmt == "full" else "fsdp_sharded_cpt2")
        assert out[fmt].exists()
    return out


def write_checkpoint(path: Path, cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A full checkpoint of a randomly initialised model, in train_fsdp.py's payload format. Norm weights
    are random too, so swapping two norms in the export would show."""
    model = random_model(cfg, seed)
    payload = {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "rng": None,
               "format_version": FORMAT_VERSION, "world_size": 1, "model_config": dataclasses.asdict(cfg),
               "train_state": {k: v for k, v in dataclasses.asdict(TrainState()).items() if k != "rng"}}
    torch.save(payload, path)
    return model.eval()


def assert_same_logits(ours: Transformer, out_dir: Path, *, atol: float = 1e-5) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    cfg = ours.cfg
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, actual = ours(tokens), hf(tokens).logits.float()
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0 if atol <= 1e-5 else atol)


CASES = {
    "tied-gqa": ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24,
                            tie_embeddings=True),
    "untied-mha": ModelConfig(vocab_size=333, dim=48, n_layers=2, n_heads=3, max_seq_len=16, rope_theta=500.0,
                              norm_eps=1e-6),
    "untied-mqa": ModelConfig(vocab_size=320, dim=64, n_layers=3, n_heads=4, n_kv_heads=1, ffn_hidden_dim=96,
                              max_seq_len=20),
    # Llama 3's rotary scaling, on sequences three times its original context.
    "llama3-rope": ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24,
                               rope_theta=500000.0, rope_scaling_factor=32.0, rope_original_max_seq_len=8),
}


@pytest.mark.parametrize("case", CASES)
def test_random_model_logits_match(case, runs, tmp_path):
    cfg = CASES[case]
    ckpt = tmp_path / "fsdp_cpt0.pth"
    ours = write_checkpoint(ckpt, cfg)
    tokenizer = runs["full"].parent / "tokenizer.model"  # 320 pieces; "untied-mha" pads the vocabulary past it
    assert export_hf.main([str(ckpt), str(tmp_path / "hf"), "--tokenizer", str(tokenizer)]) == 0
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["tie_word_embeddings"] == cfg.tie_embeddings
    assert (config["num_key_value_heads"], config["intermediate_size"], config["head_dim"]) == (
        cfg.num_kv_heads, cfg.hidden_dim, cfg.head_dim)
    assert config["rope_parameters"]["rope_theta"] == cfg.rope_theta and config["rms_norm_eps"] == cfg.norm_eps
    assert config["rope_parameters"].get("factor") == cfg.rope_scaling_factor
    assert_same_logits(ours, tmp_path / "hf")


def test_bf16_export(runs, tmp_path):
    ckpt = tmp_path / "fsdp_cpt0.pth"
    ours = write_checkpoint(ckpt, CASES["tied-gqa"])
    tokenizer = runs["full"].parent / "tokenizer.model"
    assert export_hf.main([str(ckpt), str(tmp_path / "hf"), "--dtype", "bf16", "--tokenizer", str(tokenizer)]) == 0
    assert json.loads((tmp_path / "hf/config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(hf.model.layers[0].mlp.up_proj.weight,
                               ours.layers[0].feed_forward.w13.weight.chunk(2)[1].bfloat16())


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_trained_checkpoint(fmt, runs, corpus, tmp_path):
    ckpt, out = runs[fmt], tmp_path / "hf"
    assert export_hf.main([str(ckpt), str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    ours, _ = load_model(ckpt)
    assert_same_logits(ours, out)
    # The Hugging Face tokenizer encodes and decodes like the run's SentencePiece model.
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = [corpus.read_text()[:4000], "  two  spaces\tand\ttabs\n\nnewlines", "ünïcödé 日本 😀 </s> <s>",
             " lead", ""]
    for text in texts:
        ids = hf_tok(text)["input_ids"]
        assert ids == sp.encode(text), text
        assert hf_tok.decode(ids) == sp.decode(ids) == text
    assert hf_tok.eos_token_id == sp.eos_id()


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    return err


def test_errors(runs, tmp_path, capsys):
    ckpt = runs["full"]
    assert export_hf.main([str(tmp_path / "missing.pth"), str(tmp_path / "a")]) == 1
    assert "no such file" in _error(capsys)
    text = tmp_path / "notes.pth"
    text.write_text("hello")
    foreign = tmp_path / "foreign.pth"
    torch.save({"weights": torch.zeros(2)}, foreign)
    for bad in (text, foreign, tmp_path):  # a text file, another torch file, a folder without meta.json
        assert export_hf.main([str(bad), str(tmp_path / "a")]) == 1
        assert "not a" in _error(capsys)
    assert not (tmp_path / "a").exists()

    # A non-empty OUT_DIR is kept without --force and replaced with it.
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert export_hf.main([str(ckpt), str(out)]) == 1
    assert "--force" in _error(capsys)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert export_hf.main([str(ckpt), str(out), "--force"]) == 0
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    # An empty OUT_DIR needs no --force.
    (tmp_path / "empty").mkdir()
    assert export_hf.main([str(ckpt), str(tmp_path / "empty")]) == 0

    # Never replace the folder holding the input, even with --force.
    assert export_hf.main([str(ckpt), str(ckpt.parent), "--force"]) == 1
    assert "input" in _error(capsys) and ckpt.is_file()

    # No tokenizer next to the checkpoint.
    lone = tmp_path / "lone" / "fsdp_cpt0.pth"  # step 0, as write_checkpoint saves it
    lone.parent.mkdir()
    write_checkpoint(lone, CASES["tied-gqa"])
    assert export_hf.main([str(lone), str(tmp_path / "b")]) == 1
    assert "--tokenizer" in _error(capsys) and not (tmp_path / "b").exists()
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))


def test_cli_error_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/export_hf.py"), str(tmp_path / "nope.pth"),
                           str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1, proc.stderr
