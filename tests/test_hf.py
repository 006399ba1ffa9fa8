"""model.type=hf: transformers causal LMs trained by the same loop, launcher and checkpoints (CPU, gloo)."""
from __future__ import annotations

import builtins
import json
import math
from pathlib import Path

import pytest
import torch

from config import load_config
from data.errors import DataError
from data.tokenizer import load_tokenizer
from fsdp_utils.parallel.hf import hf_problems
from tests.helpers import ROOT, losses, run_train, worker_tracebacks

pytestmark = pytest.mark.slow  # every test here launches training processes

transformers = pytest.importorskip("transformers")

TINY_HF = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


def save_tiny(kind: str, path, *, tie: bool = False):
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY_HF, tie_word_embeddings=tie)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**TINY_HF, tie_word_embeddings=tie)
        model = transformers.Qwen2ForCausalLM(cfg)
    torch.manual_seed(0)
    model.save_pretrained(path)
    return model


def save_tokenizer(path, corpus) -> None:
    """A byte-level BPE tokenizer trained on the test corpus, saved the way transformers loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(path)


@pytest.mark.parametrize("kind,version,tie,optimizer", [("llama", 1, True, "adamw"), ("qwen2", 1, False, "adamw"),
                                                        ("llama", 2, False, "adamw"), ("qwen2", 2, False, "muon")])
def test_hf_model_trains_on_two_ranks_checkpoints_and_resumes(tmp_path, corpus, dataset_dir, kind, version, tie,
                                                              optimizer):
    save_tiny(kind, tmp_path / "hf", tie=tie)
    args = ["--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", f"--fsdp.version={version}",
            "--fsdp.sharding_strategy=FULL_SHARD", "--train.max_steps=6", "--checkpoint.interval=3",
            "--checkpoint.keep_last_n=0", f"--train.optimizer={optimizer}"]
    if kind == "qwen2":  # HF decoder layers (called with keyword arguments) under op-level checkpointing
        args.append("--fsdp.activation_checkpointing=selective_op")
    run_train(*args, nproc=2, out_dir=tmp_path / "full", corpus=corpus, dataset_dir=dataset_dir)
    full = losses(tmp_path / "full")
    # It learns: random weights start near ln(320) = 5.77 and the repetitive corpus is easy.
    assert math.isclose(full[1], math.log(320), rel_tol=0.05), full
    assert full[6] < full[1] - 0.5, full

    if kind == "llama" and version == 1:
        # A one-process run over the same global batches loads the same weights and takes the same steps.
        run_train(*args, nproc=1, out_dir=tmp_path / "one", corpus=corpus, dataset_dir=dataset_dir)
        for step, value in losses(tmp_path / "one").items():
            assert math.isclose(value, full[step], rel_tol=1e-5), (step, value, full[step])

    # Resume from step 3 in a fresh directory: steps 4..6 equal the uninterrupted run's bit for bit.
    run_train(*args, f"--resume_from={tmp_path / 'full' / 'fsdp_cpt3.pth'}", nproc=2, out_dir=tmp_path / "resumed",
              corpus=corpus, dataset_dir=dataset_dir)
    resumed = losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)

    ckpt = torch.load(tmp_path / "full" / "fsdp_cpt6.pth", weights_only=True)
    assert ckpt["model_config"]["type"] == "hf"
    keys = set(ckpt["model"])
    assert any(k.startswith("lm.model.layers.1.") for k in keys) and not any("_fsdp" in k for k in keys)
    if tie:
        # Tied embeddings stayed tied through sharding and training.
        assert torch.equal(ckpt["model"]["lm.lm_head.weight"], ckpt["model"]["lm.model.embed_tokens.weight"])
    if optimizer == "muon":
        # Muon has the decoder layers' projection weights; AdamW the embedding, lm_head, norms and Qwen2's biases.
        state = ckpt["optimizer"]["state"]
        projections = {k for k in keys if ".layers." in k and k.endswith("_proj.weight")}
        assert len(projections) == 2 * 7 and {k.removeprefix("lm.") for k in projections} <= {
            k.removeprefix("lm.") for k in state}
        muon = {k for k, v in state.items() if "momentum_buffer" in v}
        assert {k.removeprefix("lm.") for k in muon} == {k.removeprefix("lm.") for k in projections}, muon
        adamw = set(state) - muon
        assert any("embed_tokens" in k for k in adamw) and any("lm_head" in k for k in adamw)
        assert any(k.endswith("norm.weight") for k in adamw) and any(k.endswith("q_proj.bias") for k in adamw)


def test_hf_config_builds_random_model_and_hf_tokenizer_prepares_data(tmp_path, corpus):
    model = save_tiny("llama", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf", corpus)
    proc = run_train("--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", "--data.tokenizer=hf",
                     "--train.max_steps=3", nproc=2, out_dir=tmp_path / "out", corpus=corpus,
                     dataset_dir=tmp_path / "ds")
    # The startup summary's model line, as readable as ours (its numbers: tests/test_model_checks.py).
    (line,) = [line for line in (proc.stdout + proc.stderr).splitlines() if "] model: " in line]
    assert line.endswith(f"parameters (74,048 without embeddings), LlamaForCausalLM from {tmp_path / 'hf'}: 2 layers, "
                         "hidden 64, heads 4/2 kv, ffn 128, vocab 320"), line
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out" / "hf_tokenizer")
    assert tok.decode(tok.encode("the quick brown fox")) == "the quick brown fox"
    assert len(losses(tmp_path / "out")) == 3

    # hf_config: the same architecture from config.json alone, randomly initialised from run.seed.
    run_train("--model.type=hf", f"--model.hf_config={tmp_path / 'hf' / 'config.json'}", "--train.max_steps=2",
              nproc=1, out_dir=tmp_path / "cfg", corpus=corpus, dataset_dir=tmp_path / "ds2")
    assert model.config.num_hidden_layers == 2 and len(losses(tmp_path / "cfg")) == 2


def test_hf_config_errors(tmp_path, corpus, dataset_dir):
    proc = run_train("--model.type=hf", nproc=1, out_dir=tmp_path / "o", corpus=corpus, dataset_dir=dataset_dir,
                     check=False)
    assert proc.returncode == 2 and "model.hf_path" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_train("--model.type=hf", f"--model.hf_path={tmp_path / 'missing'}", nproc=1, out_dir=tmp_path / "o",
                     corpus=corpus, dataset_dir=dataset_dir, check=False)
    assert proc.returncode == 2 and "not found" in proc.stderr



@pytest.mark.parametrize("nproc", [1, 2])
def test_a_config_too_large_to_build_is_one_line(tmp_path, corpus, dataset_dir, nproc):
    """hidden_size 10^9 (6e18 parameters) and 10^6 layers (a skeleton that alone takes most of an hour to build):
    refused from config.json's sizes before any process group starts, once, whatever the ranks."""
    for key, value, limit in (("hidden_size", 10**9, "2**20 = 1048576"), ("num_hidden_layers", 10**6, "2**16 = 65536")):
        transformers.LlamaConfig(**{**TINY_HF, key: value}).save_pretrained(tmp_path / key)
        proc = run_train("--model.type=hf", f"--model.hf_config={tmp_path / key}", "--train.max_steps=2", nproc=nproc,
                         out_dir=tmp_path / "out", corpus=corpus, dataset_dir=dataset_dir, check=False, timeout=120)
        assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
            f"error: model.hf_config={tmp_path / key}: config.json's {key}={value} must be a positive integer of at "
            f"most {limit} (past any released model's)"], proc.stderr[-4000:]
        # One process exits 2 (a config error); torchrun reports a failed worker as 1.
        assert proc.returncode == (2 if nproc == 1 else 1) and worker_tracebacks(proc.stderr) == 0, proc.stderr[-4000:]


# ---- what a model folder must not make us do: run its code, ask about it, or unpickle code -----------


def with_own_code(folder: Path, json_name: str, auto_map: dict, marker: Path) -> None:
    """Make the saved folder name Python code of its own (as remote-code models do) that touches `marker`."""
    meta = json.loads((folder / json_name).read_text())
    meta["auto_map"] = auto_map
    if json_name == "config.json":
        meta["model_type"] = "own_llama"  # a type transformers does not include: only the folder's code knows it
    else:
        meta["tokenizer_class"] = "OwnTokenizer"
    (folder / json_name).write_text(json.dumps(meta))
    (folder / "own_code.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import LlamaConfig, PreTrainedTokenizerFast\n"
        "class OwnConfig(LlamaConfig):\n    model_type = 'own_llama'\n"
        "class OwnTokenizer(PreTrainedTokenizerFast):\n    pass\n")


def test_a_folder_s_own_code_is_never_run_nor_asked_about(tmp_path, corpus, monkeypatch):
    """transformers asks on stdin whether to run such code when trust_remote_code is not given, and runs it
    on 'y': here every answer would be 'y', and no question may be asked."""
    questions = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": questions.append(prompt) or "y")
    marker = tmp_path / "code_ran"
    save_tiny("llama", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf", corpus)
    with_own_code(tmp_path / "hf", "config.json", {"AutoConfig": "own_code.OwnConfig"}, marker)
    with_own_code(tmp_path / "hf", "tokenizer_config.json", {"AutoTokenizer": ["own_code.OwnTokenizer", None]}, marker)

    # The folder is checked with the launch, before any process group starts (fsdp_utils/train/launch_checks.py).
    cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml", ["--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}"])
    assert hf_problems(cfg.model) == [f"model.hf_path={tmp_path / 'hf'}: its config.json needs the folder's own Python "
                                      "code (auto_map), which is never run; use a model type that transformers "
                                      "includes"]
    with pytest.raises(DataError) as info:
        load_tokenizer("hf", tmp_path / "hf")
    assert str(info.value) == (f"cannot load the tokenizer in {tmp_path / 'hf'}: it needs the folder's own Python "
                               f"code (auto_map), which is never run; use a tokenizer that transformers includes")
    assert questions == [] and not marker.exists()


class Payload:
    """Unpickles by touching `marker`: what a tampered pytorch_model.bin could do with plain torch.load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.eval, (f"__import__('pathlib').Path({str(self.marker)!r}).touch()",)


def test_refused_or_damaged_weights_end_every_rank_with_one_line(tmp_path, corpus, dataset_dir):
    """Rank 0 alone reads the weights: its failure must reach rank 1 (which would otherwise wait in the
    weights' broadcast) and be reported once, in one line, without a traceback."""
    model = save_tiny("llama", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    marker = tmp_path / "code_ran"
    torch.save({**model.state_dict(), "extra": Payload(marker)}, tmp_path / "hf" / "pytorch_model.bin")
    proc = run_train("--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", "--train.max_steps=2", nproc=2,
                     out_dir=tmp_path / "out", corpus=corpus, dataset_dir=dataset_dir, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: model.hf_path={tmp_path / 'hf'}: its pickled weights (.bin) were refused: they hold "
                      f"something other than tensors (loading them would run code) or are damaged; use .safetensors "
                      f"weights from a source you trust"], proc.stderr[-4000:]
    assert proc.returncode == 1 and worker_tracebacks(proc.stderr) == 0, proc.stderr[-4000:]
    assert not marker.exists()

    # Damaged, cut to 100 bytes: too small for the parameters config.json describes, said before the process group.
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"\0" * 100)
    proc = run_train("--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", "--train.max_steps=2", nproc=1,
                     out_dir=tmp_path / "out1", corpus=corpus, dataset_dir=dataset_dir, check=False, timeout=120)
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: model.hf_path={tmp_path / 'hf'}: ") and "weight files hold 100 bytes" in line
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
