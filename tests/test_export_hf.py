"""scripts/export_hf.py: the exported LlamaForCausalLM computes our logits, the exported tokenizer encodes
like the run's SentencePiece model, a run trained with a Hugging Face tokenizer exports that tokenizer (chat
template included), and bad inputs or outputs give one error line and touch nothing."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fsdp_utils.checkpoint import FORMAT_VERSION, TrainState
from fsdp_utils.checkpoint.io import load_model, read_meta
from model import ModelConfig, Transformer
from scripts import export_hf
from tests.helpers import ROOT, job_env, random_model, run_job, run_train

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


# ---- a run trained with a Hugging Face tokenizer (data.tokenizer=hf) ------------------------------------

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, corpus) -> Path:
    """The checkpoint of a 2-step run of our model trained with a Hugging Face tokenizer (a byte-level BPE with a
    chat template, in tok/ beside the run's folder)."""
    from tests.test_hf import save_tokenizer

    root = tmp_path_factory.mktemp("hf_run")
    save_tokenizer(root / "tok", corpus)
    tok = transformers.AutoTokenizer.from_pretrained(root / "tok")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(root / "tok")
    run_train("--train.max_steps=2", "--data.tokenizer=hf", f"--data.hf_tokenizer={root / 'tok'}",
              out_dir=root / "run", corpus=corpus, dataset_dir=root / "data")
    assert (root / "run/hf_tokenizer").is_dir() and not (root / "run/tokenizer.model").exists()
    return root / "run/fsdp_cpt2.pth"


def assert_same_tokenizer(exported: Path, original: Path, corpus: Path) -> None:
    ours, theirs = (transformers.AutoTokenizer.from_pretrained(path) for path in (exported, original))
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert (ours.eos_token, ours.eos_token_id, ours.chat_template) == (theirs.eos_token, theirs.eos_token_id,
                                                                       CHAT_TEMPLATE)
    for text in (corpus.read_text()[:4000], "  two  spaces\tand\ttabs\n\nnewlines", "ünïcödé 日本 😀 <eos>", ""):
        ids = ours(text, add_special_tokens=False)["input_ids"]
        assert ids == theirs(text, add_special_tokens=False)["input_ids"] and ours.decode(ids) == theirs.decode(ids)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the quick fox"}]
    assert ours.apply_chat_template(messages, tokenize=False) == "<user>hello<eos><assistant>the quick fox<eos>"


def test_run_with_a_hugging_face_tokenizer(hf_run, corpus, tmp_path):
    """Export writes the run's own tokenizer (found by the hash the checkpoint records), with its chat template; the
    folder loads with AutoTokenizer and AutoModelForCausalLM, computes our logits and generates."""
    out = tmp_path / "hf"
    assert export_hf.main([str(hf_run), str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()} and not (out / "tokenizer.model").exists()
    assert_same_tokenizer(out, hf_run.parent / "hf_tokenizer", corpus)
    assert_same_tokenizer(out, hf_run.parent.parent / "tok", corpus)  # the folder the run was given
    for file in (hf_run.parent / "hf_tokenizer").iterdir():  # written as transformers wrote the run's: the same bytes
        assert (out / file.name).read_bytes() == file.read_bytes(), file.name
    ours, _ = load_model(hf_run)
    assert ours.cfg.vocab_size == len(transformers.AutoTokenizer.from_pretrained(out))  # model.vocab_size 0
    assert_same_logits(ours, out)

    tok, model = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    prompt = tok("the quick brown", return_tensors="pt", add_special_tokens=False)
    new = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    new = new[0, prompt["input_ids"].shape[1]:].tolist()
    assert 1 <= len(new) <= 5 and isinstance(tok.decode(new), str)
    # Greedy generation is our model's argmax, token by token.
    tokens = prompt["input_ids"]
    for token in new:
        with torch.no_grad():
            assert ours(tokens)[0, -1].argmax().item() == token
        tokens = torch.cat([tokens, torch.tensor([[token]])], dim=1)


def test_run_with_a_hugging_face_tokenizer_finds_its_own(hf_run, corpus, tmp_path, capsys):
    """--tokenizer takes a tokenizer folder (also a whole model folder: only the tokenizer's files are written); the
    tokenizer is found where the run keeps a replaced one; a missing or different one is one error line."""
    import shutil

    model_dir = tmp_path / "model_folder"  # a model folder with a tokenizer, as data.hf_tokenizer may name one
    shutil.copytree(hf_run.parent.parent / "tok", model_dir)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"not ours")
    assert export_hf.main([str(hf_run), str(tmp_path / "given"), "--tokenizer", str(model_dir)]) == 0
    assert_same_tokenizer(tmp_path / "given", model_dir, corpus)
    assert (tmp_path / "given/model.safetensors").read_bytes() != b"not ours"

    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copyfile(hf_run, lone / hf_run.name)
    assert export_hf.main([str(lone / hf_run.name), str(tmp_path / "a")]) == 1
    err = _error(capsys)
    assert "no tokenizer with its sha256" in err and "no tokenizer.model or hf_tokenizer there" in err, err
    assert "--tokenizer" in err and not (tmp_path / "a").exists()
    # Another tokenizer under the run's name is not taken; the run's own, kept under its hash's name, is.
    other = transformers.AutoTokenizer.from_pretrained(model_dir)
    other.chat_template = None
    other.save_pretrained(lone / "hf_tokenizer")
    assert export_hf.main([str(lone / hf_run.name), str(tmp_path / "a")]) == 1
    assert "hf_tokenizer is another" in _error(capsys)
    sha256 = read_meta(hf_run)["tokenizer_sha256"]
    shutil.copytree(hf_run.parent / "hf_tokenizer", lone / f"hf_tokenizer.{sha256[:8]}")
    assert export_hf.main([str(lone / hf_run.name), str(tmp_path / "a")]) == 0
    assert_same_tokenizer(tmp_path / "a", hf_run.parent / "hf_tokenizer", corpus)

    # evaluate.py and generate.py find it too (both take tokenizer folders).
    from scripts import evaluate, generate

    _, codec, _, _ = evaluate.load_for_eval(hf_run, device=torch.device("cpu"), tokenizer=None)
    assert type(codec).__name__ == "HFCodec" and codec.vocab_size == len(other)

    capsys.readouterr()
    assert generate.main([str(lone / hf_run.name), "--prompt", "the", "--device", "cpu", "--max_new_tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("the")

    (tmp_path / "empty").mkdir()
    for bad, why in ((tmp_path / "nothing", "no such tokenizer file or folder"),
                     (tmp_path / "empty", "not a Hugging Face tokenizer folder")):
        assert export_hf.main([str(hf_run), str(tmp_path / "b"), "--tokenizer", str(bad)]) == 1
        assert why in _error(capsys) and not (tmp_path / "b").exists()


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
    proc = run_job([str(ROOT / "scripts/export_hf.py"), str(tmp_path / "nope.pth"), str(tmp_path / "o")],
                   env=job_env(), timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1, proc.stderr


# ---- a Hugging Face model fine-tuned in place (model.type=hf) -----------------------------------------------

HF_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
               "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_chat_model(folder: Path, corpus: Path, *, template_in_config: bool = False) -> None:
    """A tiny random Qwen2 (biased q/k/v projections: not Llama's layout) with a byte-level BPE tokenizer and
    a chat template, in one folder as transformers saves them: the template in chat_template.jinja, or inside
    tokenizer_config.json as older releases keep it."""
    from tests.test_hf import save_tiny, save_tokenizer

    save_tiny("qwen2", folder)
    save_tokenizer(folder, corpus)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.chat_template = HF_TEMPLATE
    tok.save_pretrained(folder)
    if template_in_config:
        (folder / "chat_template.jinja").unlink()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HF_TEMPLATE}))
    assert transformers.AutoTokenizer.from_pretrained(folder).chat_template == HF_TEMPLATE


@pytest.fixture(scope="module")
def hf_finetune(tmp_path_factory, corpus) -> dict[str, Path]:
    """Checkpoints of 2-step full fine-tunes of a Hugging Face model with its own tokenizer: {"base": the model
    folder, "full": fsdp_cpt2.pth of one rank, "sharded": fsdp_sharded_cpt2/ of two ranks}."""
    root = tmp_path_factory.mktemp("hf_finetune")
    save_chat_model(root / "base", corpus)
    out = {"base": root / "base"}
    for fmt, nproc in (("full", 1), ("sharded", 2)):
        run_train("--model.type=hf", f"--model.hf_path={root / 'base'}", "--data.tokenizer=hf", "--train.max_steps=2",
                  f"--checkpoint.format={fmt}", nproc=nproc, out_dir=root / fmt, corpus=corpus,
                  dataset_dir=root / "data")
        out[fmt] = root / fmt / ("fsdp_cpt2.pth" if fmt == "full" else "fsdp_sharded_cpt2")
    return out


def checkpoint_tensors(ckpt: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint under transformers' names, read with torch's own tools alone (a sharded
    one converted by torch.distributed.checkpoint's dcp_to_torch_save)."""
    if ckpt.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(ckpt, tmp_path / "converted.pt")
        state = torch.load(tmp_path / "converted.pt", weights_only=True)["model"]
    else:
        state = torch.load(ckpt, weights_only=True)["model"]
    return {name.removeprefix("lm."): tensor for name, tensor in state.items()}


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_hf_finetune_exports_as_its_own_architecture(fmt, hf_finetune, tmp_path):
    """A fine-tuned Qwen2 exports as Qwen2: its base's config.json, the trained weights as safetensors, the run's
    tokenizer with its chat template; transformers' model of the folder computes the project's logits."""
    from safetensors.torch import load_file

    from fsdp_utils.parallel.hf import load_hf_checkpoint

    ckpt, out = hf_finetune[fmt], tmp_path / "out"
    assert export_hf.main([str(ckpt), str(out)]) == 0
    config, base_config = (json.loads((folder / "config.json").read_text()) for folder in (out, hf_finetune["base"]))
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert {k: v for k, v in config.items() if k != "dtype"} == {k: v for k, v in base_config.items() if k != "dtype"}
    saved, trained = load_file(out / "model.safetensors"), checkpoint_tensors(ckpt, tmp_path)
    assert set(saved) == set(trained) and all(torch.equal(saved[name], trained[name]) for name in saved)
    base = load_file(hf_finetune["base"] / "model.safetensors")
    assert not torch.equal(saved["model.layers.0.self_attn.q_proj.bias"], base["model.layers.0.self_attn.q_proj.bias"])

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == HF_TEMPLATE and (out / "chat_template.jinja").is_file()
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == "<user>hello<eos><assistant>"

    ours, _, _ = load_hf_checkpoint(ckpt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    tokens = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=0, atol=1e-6)


def test_hf_finetune_generates_and_evaluates_from_its_checkpoint(hf_finetune, tmp_path, capsys):
    """scripts/generate.py samples from the checkpoint with the run's tokenizer (greedy: transformers' greedy
    generation of the export, token for token; --chat: through the chat template); scripts/evaluate.py loads it
    with the architecture's context length."""
    from scripts import evaluate, generate

    ckpt, out = hf_finetune["sharded"], tmp_path / "out"
    assert export_hf.main([str(ckpt), str(out)]) == 0
    capsys.readouterr()
    tok, hf = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoModelForCausalLM.from_pretrained(out)
    for prompt, chat in (("the quick brown", False), ("hello", True)):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True) if chat else prompt
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        # (the whole prompt attended to: its <eos> is no padding)
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        if want[-1:] == [tok.eos_token_id]:
            want = want[:-1]
        assert generate.main([str(ckpt), "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "8",
                              "--device", "cpu", *(["--chat"] if chat else [])]) == 0
        assert capsys.readouterr().out == prompt + tok.decode(want) + "\n"

    model, codec, max_length, kind = evaluate.load_for_eval(ckpt, device=torch.device("cpu"), tokenizer=None)
    assert (type(codec).__name__, codec.vocab_size, max_length, kind) == ("HFCodec", len(tok), 64, "hf checkpoint")
    tokens = torch.randint(0, len(tok), (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=0, atol=1e-6)


def test_hf_finetune_finds_its_base_or_says_how(hf_finetune, tmp_path, capsys):
    """The architecture comes from the run's config.yaml (model.hf_path) or --base; a checkpoint without either,
    or a --base of another shape, is one error line."""
    import shutil

    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copyfile(hf_finetune["full"], lone / "fsdp_cpt2.pth")
    shutil.copytree(hf_finetune["full"].parent / "hf_tokenizer", lone / "hf_tokenizer")
    assert export_hf.main([str(lone / "fsdp_cpt2.pth"), str(tmp_path / "a")]) == 1
    err = _error(capsys)
    assert "config.yaml does not name its model.hf_path" in err and "--base" in err and not (tmp_path / "a").exists()
    # A config.yaml that came with the folder is read within the config loader's bounds: an alias bomb (a
    # million strings from six lines) is refused like a missing model.hf_path, not expanded into a path.
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 6)]
    (lone / "config.yaml").write_text("\n".join(levels) + "\nmodel:\n  type: hf\n  hf_path: *a5\n")
    assert export_hf.main([str(lone / "fsdp_cpt2.pth"), str(tmp_path / "a")]) == 1
    err = _error(capsys)
    assert "config.yaml does not name its model.hf_path" in err and len(err) < 1000
    (lone / "config.yaml").write_text(f"model:\n  type: hf\n  hf_path: {tmp_path / 'moved'}\n")
    assert export_hf.main([str(lone / "fsdp_cpt2.pth"), str(tmp_path / "a")]) == 1
    err = _error(capsys)
    assert f"model.hf_path={tmp_path / 'moved'} (from {lone / 'config.yaml'}): cannot read its config.json" in err
    assert err.endswith("pass --base MODEL_FOLDER (the Hugging Face model folder the run fine-tuned)")

    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((hf_finetune["base"] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert export_hf.main([str(lone / "fsdp_cpt2.pth"), str(tmp_path / "a"), "--base", str(other)]) == 1
    err = _error(capsys)
    assert f"--base {other} describes another model (intermediate_size=96 there, 128 in the checkpoint)" in err

    assert export_hf.main([str(lone / "fsdp_cpt2.pth"), str(tmp_path / "a"), "--base",
                           str(hf_finetune["base"] / "config.json")]) == 0
    assert (tmp_path / "a/model.safetensors").is_file()

    # The base folder is an input: --force never replaces the pretrained model the run started from.
    base = tmp_path / "base"
    shutil.copytree(hf_finetune["base"], base)
    before = {path.name: path.read_bytes() for path in base.iterdir() if path.is_file()}
    assert export_hf.main([str(lone / "fsdp_cpt2.pth"), str(base), "--base", str(base), "--force"]) == 1
    assert f"{base} holds the input {base}; choose another output directory" in _error(capsys)
    assert {path.name: path.read_bytes() for path in base.iterdir() if path.is_file()} == before


@pytest.mark.parametrize("template_in_config", [False, True])
def test_merged_lora_of_a_chat_model_keeps_its_chat_template(template_in_config, corpus, tmp_path):
    """--merge_lora writes the base's tokenizer with its chat template, wherever the base keeps it."""
    save_chat_model(tmp_path / "base", corpus, template_in_config=template_in_config)
    run_train("--model.type=hf", f"--model.hf_path={tmp_path / 'base'}", "--data.tokenizer=hf", "--train.max_steps=1",
              "--train.warmup_steps=1",
              "--train.lora.rank=4", "--fsdp.version=2", "--checkpoint.format=full", out_dir=tmp_path / "run",
              corpus=corpus, dataset_dir=tmp_path / "data")
    assert export_hf.main([str(tmp_path / "run/fsdp_cpt1.pth"), str(tmp_path / "merged"), "--merge_lora"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tok.chat_template == HF_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi<eos>"


@pytest.mark.parametrize("field", ["hf_path", "hf_config"])
def test_a_lora_checkpoint_naming_a_base_with_its_own_code_is_refused_without_a_question(field, corpus, tmp_path,
                                                                                          capsys, monkeypatch):
    """The base of a LoRA checkpoint comes from its metadata: a crafted one that names a folder with code of its
    own (auto_map), its fingerprint made to match, is one error line; transformers is never asked (it would ask on
    stdin) and the code never runs."""
    import builtins

    from config import ModelSection
    from fsdp_utils.parallel.lora import base_reference
    from tests.test_hf import save_tiny, with_own_code

    save_tiny("llama", tmp_path / "base")
    where = tmp_path / "base" if field == "hf_path" else tmp_path / "base/config.json"
    run_train("--model.type=hf", f"--model.{field}={where}", "--train.max_steps=1",
              "--train.warmup_steps=1", "--train.lora.rank=4",
              "--fsdp.version=2", "--checkpoint.format=full", out_dir=tmp_path / "run", corpus=corpus,
              dataset_dir=tmp_path / "data")
    payload = torch.load(tmp_path / "run/fsdp_cpt1.pth", weights_only=True)
    assert payload["lora"]["base"][field] == str(where)
    marker = tmp_path / "code_ran"
    with_own_code(tmp_path / "base", "config.json", {"AutoConfig": "own_code.OwnConfig",
                                                     "AutoModelForCausalLM": "own_code.OwnConfig"}, marker)
    model = ModelSection(type="hf", hf_path=str(where) if field == "hf_path" else "")
    payload["lora"]["base"]["fingerprint"] = base_reference(model, payload["model_config"],
                                                            seed=payload["lora"]["base"].get("seed"))["fingerprint"]
    crafted = tmp_path / "crafted/fsdp_cpt1.pth"
    crafted.parent.mkdir()
    torch.save(payload, crafted)
    questions: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": questions.append(prompt) or "y")
    capsys.readouterr()
    assert export_hf.main([str(crafted), str(tmp_path / "out"), "--merge_lora"]) == 1
    assert "its config.json needs the folder's own Python code (auto_map), which is never run" in _error(capsys)
    assert questions == [] and not marker.exists() and not (tmp_path / "out").exists()
