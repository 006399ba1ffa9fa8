"""scripts/import_hf.py and model.init_from: a Hugging Face LlamaForCausalLM imported into our Transformer computes
the HF model's logits; export then import gives back the same tensors; what our model cannot express is refused
with one line naming the config.json field; model.init_from loads the weights (full, sharded, imported) under
FSDP1 and FSDP2 with meta init and a fresh optimizer; and a run starts from an imported Llama with its HF tokenizer."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from config import load_config
from fsdp_utils.checkpoint.errors import CheckpointMismatch
from fsdp_utils.checkpoint.io import load_model
from model import ModelConfig, Transformer
from scripts import import_hf
from tests.helpers import ROOT, TINY, read_metrics, run_train

transformers = pytest.importorskip("transformers")

TINY_CONFIG = ROOT / "config/train_tiny_fsdp.yaml"
# The dimensions of the TINY training args (tests/helpers.py), as a Hugging Face Llama.
TINY_LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=500000.0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
TINY_MODEL_ARGS = ["--model.ffn_hidden_dim=128", "--model.vocab_size=320", "--model.norm_eps=1e-6",
                   "--model.rope_theta=500000.0", "--model.tie_embeddings=false"]


def save_llama(path: Path, *, seed: int = 0, dtype=torch.float32, max_shard_size: str | None = None, **config):
    """A LlamaForCausalLM with every weight random (norms too, so a swapped norm would show), saved as safetensors."""
    torch.manual_seed(seed)
    # A copy: transformers may complete the rope mapping it is given, which the cases below share.
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**copy.deepcopy(config))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if name.endswith("norm.weight") else
                        0.3 * torch.randn_like(param))
    model.to(dtype).save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


CASES = {
    # GQA, untied, rope_theta 5e5, eps 1e-6, the weights in several safetensors shards.
    "gqa-untied-sharded": dict(TINY_LLAMA, max_shard_size="40KB"),
    # Plain multi-head attention, tied embeddings, bf16 weights on disk.
    "mha-tied-bf16": dict(vocab_size=333, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                          num_attention_heads=3, max_position_embeddings=16, tie_word_embeddings=True,
                          dtype=torch.bfloat16),
    # Multi-query attention.
    "mqa": dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, max_position_embeddings=20, rope_theta=1000.0),
    # Llama 3.1 / 3.2's rotary scaling, pretrained context 16 and sequences of 64: at head_dim 16 the fastest
    # frequency (wavelength 2 pi) is interpolated, the others slowed 8 times.
    "llama3-rope": dict(TINY_LLAMA, rope_theta=None, rope_parameters=LLAMA3_ROPE),
}


@pytest.mark.parametrize("case", CASES)
def test_imported_llama_computes_the_hf_logits(case, tmp_path):
    """The real test of the mapping (names, fusing, the rotary layout): our Transformer with the imported weights
    gives the HF model's logits, both in fp32 (the HF model reloaded from what it saved)."""
    args = dict(CASES[case])
    save_llama(tmp_path / "hf", **args)
    if case.endswith("sharded"):
        assert (tmp_path / "hf/model.safetensors.index.json").is_file()
    import_hf.import_hf(tmp_path / "hf", tmp_path / "llama.pth")
    ours, meta = load_model(tmp_path / "llama.pth")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, ours.cfg.max_seq_len), generator=generator)
    with torch.no_grad():
        expected, actual = hf(tokens).logits, ours(tokens)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)
    assert meta["train_state"]["step"] == 0 and ours.cfg.tie_embeddings == bool(args.get("tie_word_embeddings"))
    assert ours.cfg.rope_scaling_factor == (8.0 if case == "llama3-rope" else None)


def test_llama3_rope_from_either_form_of_config_json(tmp_path, capsys):
    """rope_type llama3 in transformers 5's rope_parameters and in the older rope_scaling with a top-level rope_theta:
    the same model, printed with its scaling, computing the logits transformers computes for that folder. Without
    the scaling the logits differ (a control: the sequence reaches past the pretrained context)."""
    hf = save_llama(tmp_path / "hf", **CASES["llama3-rope"])
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "new.pth")]) == 0
    section = capsys.readouterr().out.split("model:\n")[1]
    assert section.endswith("  rope_theta: 10000.0\n  norm_eps: 1e-06\n  tie_embeddings: false\n"
                            "  rope_scaling_factor: 8.0\n  rope_low_freq_factor: 1.0\n  rope_high_freq_factor: 4.0\n"
                            "  rope_original_max_seq_len: 16\n")
    old_form = {"type": "llama3"} | {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    edit_config(tmp_path / "hf", rope_parameters=None, rope_scaling=old_form, rope_theta=10000.0)
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "old.pth")]) == 0
    (new, _), (old, _) = load_model(tmp_path / "new.pth"), load_model(tmp_path / "old.pth")
    assert new.cfg == old.cfg and new.cfg.llama3_scaling == {"factor": 8.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0, "original_max_seq_len": 16}
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    plain = Transformer(dataclasses.replace(old.cfg, rope_scaling_factor=None, rope_original_max_seq_len=8192))
    plain.load_state_dict(old.state_dict())
    tokens = torch.randint(0, old.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(reloaded(tokens).logits, expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(old(tokens), expected, atol=2e-5, rtol=1e-5)
        assert (plain(tokens) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("rope", [{}, dict(rope_scaling_factor=32.0, rope_low_freq_factor=2.0,
                                            rope_high_freq_factor=8.0, rope_original_max_seq_len=16)],
                         ids=["plain", "llama3-rope"])
def test_export_then_import_gives_the_same_tensors(tmp_path, corpus, rope):
    """Our checkpoint -> scripts/export_hf.py -> scripts/import_hf.py: bit-identical weights, the same model (its
    rotary scaling included)."""
    from data.tokenizer import train_tokenizer
    from fsdp_utils.checkpoint import FORMAT_VERSION, TrainState
    from scripts import export_hf

    cfg = ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96, max_seq_len=32,
                      rope_theta=20000.0, norm_eps=1e-6, **rope)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param))
    run = tmp_path / "run"
    run.mkdir()
    train_tokenizer(corpus.read_text().splitlines(), vocab_size=320, out_path=run / "tokenizer.model")
    payload = {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "rng": None,
               "format_version": FORMAT_VERSION, "world_size": 1, "model_config": dataclasses.asdict(cfg),
               "train_state": {k: v for k, v in dataclasses.asdict(TrainState()).items() if k != "rng"}}
    torch.save(payload, run / "fsdp_cpt0.pth")
    export_hf.export(run / "fsdp_cpt0.pth", tmp_path / "hf", tokenizer=run / "tokenizer.model")
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "back.pth")]) == 0
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert back["model"].keys() == payload["model"].keys()
    for name, tensor in payload["model"].items():
        assert torch.equal(back["model"][name], tensor), name
    assert ModelConfig(**back["model_config"]) == cfg
    exported = json.loads((tmp_path / "hf/config.json").read_text())["rope_parameters"]
    assert exported["rope_type"] == ("llama3" if rope else "default") and exported["rope_theta"] == 20000.0
    if rope:
        assert (exported["factor"], exported["low_freq_factor"], exported["high_freq_factor"],
                exported["original_max_position_embeddings"]) == (32.0, 2.0, 8.0, 16)


def test_init_from_compares_the_rope_scaling(tmp_path):
    """model.init_from of a Llama 3.2-like import: a model section without its scaling computes another function of
    the same weights, and is refused naming the field; a shorter max_seq_len is fine."""
    from fsdp_utils.checkpoint.base import CheckpointContext
    from fsdp_utils.checkpoint.io import read_meta

    save_llama(tmp_path / "hf", **CASES["llama3-rope"])
    path = tmp_path / "llama.pth"
    imported = import_hf.import_hf(tmp_path / "hf", path)
    meta = read_meta(path)

    def check(cfg: ModelConfig) -> None:
        context = CheckpointContext(tmp_path, None, "full", 0, dataclasses.asdict(cfg))  # type: ignore[arg-type]
        context.check_weights(meta, path)

    check(dataclasses.replace(imported, max_seq_len=32))
    with pytest.raises(CheckpointMismatch) as err:
        check(dataclasses.replace(imported, rope_scaling_factor=None, rope_original_max_seq_len=8192))
    assert str(err.value) == (f"model.init_from={path}: the model differs from the checkpoint's: "
                              "model.rope_scaling_factor=None here, 8.0 in the checkpoint")
    with pytest.raises(CheckpointMismatch, match="model.rope_high_freq_factor=8.0 here, 4.0 in the checkpoint"):
        check(dataclasses.replace(imported, rope_high_freq_factor=8.0))


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


REFUSED = {
    "attention bias": (dict(attention_bias=True), "attention_bias=True"),
    "mlp bias": (dict(mlp_bias=True), "mlp_bias=True"),
    "activation": (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    "rope scaling": (dict(rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5}),
                     "rope_parameters rope_type='yarn'"),
    "llama3 rope without its factor": (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}),
                                       "rope_parameters factor=None"),
    "llama3 rope shortening": (dict(rope_parameters=dict(LLAMA3_ROPE, factor=0.5)),
                               "model.rope_scaling_factor must be at least 1, got 0.5"),
    "old rope scaling": (dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}),
                         "rope_scaling rope_type='linear'"),
    "own head_dim": (dict(head_dim=32), "head_dim=32"),
    "another model": (dict(model_type="mistral"), "model_type='mistral'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_our_model_cannot_express_is_refused_in_one_line(case, tmp_path, capsys):
    save_llama(tmp_path / "hf", **TINY_LLAMA)
    changes, field = REFUSED[case]
    edit_config(tmp_path / "hf", **changes)
    capsys.readouterr()  # the setup's own output (transformers' save progress bar, unless a test turned it off)
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out.pth")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], lines
    assert not (tmp_path / "out.pth").exists()


def test_bad_weights_are_refused_in_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    save_llama(tmp_path / "hf", **TINY_LLAMA)
    weights = load_file(tmp_path / "hf/model.safetensors")
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, tmp_path / "hf/model.safetensors")
    capsys.readouterr()  # the setup's own output, as above
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out.pth")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {tmp_path / 'hf'}: the weights have no model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "hf/model.safetensors").unlink()
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out.pth")]) == 1
    assert "no model.safetensors or model.safetensors.index.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_deeply_nested_json_file_is_one_line_naming_it(name, tmp_path, capsys):
    """json.loads recurses once per level: 100,000 levels were a RecursionError traceback."""
    save_llama(tmp_path / "hf", max_shard_size="40KB", **TINY_LLAMA)
    path = tmp_path / "hf" / name
    start = json.dumps(json.loads(path.read_text()))[:-1] + ', "extra": '
    path.write_text(start + "[" * 100_000 + "]" * 100_000 + "}")
    capsys.readouterr()
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out.pth")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {path}: nested more than 64 levels deep (line 1, column {len(start) + 64})"]
    assert not (tmp_path / "out.pth").exists()


def test_a_weight_index_naming_a_file_outside_the_folder_is_refused(tmp_path, capsys):
    save_llama(tmp_path / "hf", max_shard_size="40KB", **TINY_LLAMA)
    index = tmp_path / "hf/model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    first = min(weight_map.values())
    (tmp_path / "hf" / first).rename(tmp_path / "outside.safetensors")
    index.write_text(json.dumps({"weight_map": {name: "../outside.safetensors" if file == first else file
                                                for name, file in weight_map.items()}}))
    capsys.readouterr()
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out.pth")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {index}: names the shard '../outside.safetensors', which is not a file of its folder "
        f"{tmp_path / 'hf'}: only files beside the index are read"]


# ---- model.init_from -----------------------------------------------------------------------------------


def _full_weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _init_from_ranks(rank: int, world_size: int, *, tmp: str, corpus: str, dataset_dir: str) -> None:
    """Two ranks, meta init: FSDP1 starts from an import and saves a sharded checkpoint; FSDP2 starts from that;
    a rerun of the first resumes its own checkpoint instead of starting again from the import."""
    from tests.distributed_harness import cpu_env
    from tests.helpers import set_up

    env = cpu_env(rank, world_size)
    imported = torch.load(Path(tmp) / "llama.pth", weights_only=True)["model"]

    def config(out: str, *extra: str):
        cfg = load_config(TINY_CONFIG, [*TINY, *TINY_MODEL_ARGS, f"--run.output_dir={Path(tmp) / out}",
                                        f"--data.files=[{corpus}]", f"--data.dataset_dir={dataset_dir}", *extra])
        assert cfg.fsdp.meta_init
        return cfg

    first_cfg = config("a", "--fsdp.version=1", f"--model.init_from={Path(tmp) / 'llama.pth'}", "--train.max_steps=1",
                       "--train.warmup_steps=1", "--checkpoint.format=sharded", "--checkpoint.async_save=false")
    first = set_up(first_cfg, env)
    weights = _full_weights(first.model)
    assert first.state.step == 0 and not first.optimizer.state
    assert weights.keys() == imported.keys() and all(torch.equal(weights[k], imported[k]) for k in imported)
    import train_fsdp
    from fsdp_utils.guards.preemption import StopSignal

    train_fsdp.train(first, StopSignal([], grace_s=60))
    trained = _full_weights(first.model)

    second = set_up(config("b", "--fsdp.version=2", f"--model.init_from={Path(tmp) / 'a/fsdp_sharded_cpt1'}"), env)
    weights = _full_weights(second.model)
    assert second.state.step == 0 and not second.optimizer.state
    assert all(torch.equal(weights[k], trained[k]) for k in trained)
    second.ckpt.close()

    again = set_up(config("a", "--fsdp.version=1", f"--model.init_from={Path(tmp) / 'llama.pth'}",
                          "--train.max_steps=2", "--checkpoint.format=sharded"), env)
    assert again.state.step == 1 and torch.equal(_full_weights(again.model)["norm.weight"], trained["norm.weight"])
    again.ckpt.close()


@pytest.mark.slow  # spawns two ranks
def test_init_from_on_two_ranks(tmp_path, corpus, dataset_dir):
    from tests.distributed_harness import run_ranks

    save_llama(tmp_path / "hf", **TINY_LLAMA)
    import_hf.import_hf(tmp_path / "hf", tmp_path / "llama.pth")
    run_ranks(_init_from_ranks, world_size=2, timeout_s=240, tmp=str(tmp_path), corpus=str(corpus),
              dataset_dir=str(dataset_dir))


@pytest.mark.slow
def test_resume_from_an_import_and_init_from_other_dimensions(tmp_path, corpus, dataset_dir, world_of_one):
    """--resume_from an import: its weights, step 0, a fresh optimizer, and training goes on (the model section
    must be the import's exactly, max_seq_len included). model.init_from a model of other dimensions: one error
    naming the field."""
    from tests.helpers import set_up

    save_llama(tmp_path / "hf", **TINY_LLAMA)
    import_hf.import_hf(tmp_path / "hf", tmp_path / "llama.pth")
    imported = torch.load(tmp_path / "llama.pth", weights_only=True)["model"]

    def config(out: str, *extra: str):
        return load_config(TINY_CONFIG, [*TINY, *TINY_MODEL_ARGS, "--fsdp.version=2", f"--data.files=[{corpus}]",
                                         f"--run.output_dir={tmp_path / out}", f"--data.dataset_dir={dataset_dir}",
                                         *extra])

    run = set_up(config("a", "--model.max_seq_len=64", "--train.max_steps=1", "--train.warmup_steps=1"), world_of_one,
                 resume_from=str(tmp_path / "llama.pth"))
    weights = _full_weights(run.model)
    assert run.state.step == 0 and not run.optimizer.state
    assert all(torch.equal(weights[k], imported[k]) for k in imported)
    import train_fsdp
    from fsdp_utils.guards.preemption import StopSignal

    train_fsdp.train(run, StopSignal([], grace_s=60))
    assert run.state.step == 1 and run.optimizer.state

    with pytest.raises(CheckpointMismatch) as err:
        set_up(config("b", "--model.n_kv_heads=4", f"--model.init_from={tmp_path / 'llama.pth'}"), world_of_one)
    assert str(err.value) == (f"model.init_from={tmp_path / 'llama.pth'}: the model differs from the checkpoint's: "
                              "model.n_kv_heads=4 here, 2 in the checkpoint")


# ---- end to end: continued pretraining of an imported Llama with its own tokenizer ---------------------


@pytest.mark.slow  # launches a training job
def test_continue_pretraining_an_imported_llama_with_its_tokenizer(tmp_path, corpus):
    """train_fsdp.py with model.init_from=<import> and the Llama folder's HF tokenizer: the loss of step 1, taken
    on the imported weights, is the HF model's own loss on that step's batch (read back from the prepared data)."""
    from data import load_prepared
    from data.mixture import open_datasets
    from tests.test_hf import save_tokenizer

    hf_dir = tmp_path / "hf"
    save_llama(hf_dir, **TINY_LLAMA)
    save_tokenizer(hf_dir, corpus)
    assert import_hf.main([str(hf_dir), str(tmp_path / "llama.pth")]) == 0
    out, data_dir = tmp_path / "out", tmp_path / "data"
    run_train("--train.max_steps=2", *TINY_MODEL_ARGS, f"--model.init_from={tmp_path / 'llama.pth'}",
              "--data.tokenizer=hf", f"--data.hf_tokenizer={hf_dir}", out_dir=out, corpus=corpus,
              dataset_dir=data_dir)
    rows = [row for row in read_metrics(out) if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2] and all(math.isfinite(row["loss"]) for row in rows)

    prepared = load_prepared(data_dir)
    assert prepared.vocab_size == len(transformers.AutoTokenizer.from_pretrained(hf_dir))
    train, _ = open_datasets([(prepared, 1.0)], seq_len=32, seed=1234)
    x, y = train.batch(0, 8)  # step 1's global batch: samples 0-7 (global batch 8)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)


MALFORMED = {  # config.json field values of the wrong kind: (changes, the field the error line names)
    "context as a string": (dict(max_position_embeddings="64"), "max_position_embeddings='64'"),
    "context infinite": (dict(max_position_embeddings=math.inf), "max_position_embeddings=inf"),
    "context null": (dict(max_position_embeddings=None), "max_position_embeddings=None"),
    "context fractional": (dict(max_position_embeddings=63.5), "max_position_embeddings=63.5"),
    "eps as a list": (dict(rms_norm_eps=[1e-6]), "rms_norm_eps=[1e-06]"),
    "eps NaN": (dict(rms_norm_eps=math.nan), "rms_norm_eps=nan"),
    "eps null": (dict(rms_norm_eps=None), "rms_norm_eps=None"),
    "theta infinite": (dict(rope_parameters={"rope_type": "default", "rope_theta": math.inf}), "rope_theta=inf"),
    "theta as a string": (dict(rope_parameters={"rope_type": "default", "rope_theta": "5e5"}), "rope_theta='5e5'"),
    "tie as a string": (dict(tie_word_embeddings="false"), "tie_word_embeddings='false'"),
    "kv heads as a string": (dict(num_key_value_heads="2"), "num_key_value_heads='2'"),
    "kv heads fractional": (dict(num_key_value_heads=2.5), "num_key_value_heads=2.5"),
    "vocabulary infinite": (dict(vocab_size=math.inf), "vocab_size=inf"),
    "rope factor NaN": (dict(rope_parameters=dict(LLAMA3_ROPE, factor=math.nan)), "rope_parameters factor=nan"),
    "rope mapping as a list": (dict(rope_parameters=[1, 2]), "rope_parameters=[1, 2]"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_config_fields_are_one_line_naming_the_field(case, tmp_path, capsys):
    save_llama(tmp_path / "hf", **TINY_LLAMA)
    changes, field = MALFORMED[case]
    path = tmp_path / "hf/config.json"
    # Written as given: a null stays in the file, NaN and Infinity as Python's json writes them.
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    capsys.readouterr()
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out.pth")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and field in lines[0], lines
    assert not (tmp_path / "out.pth").exists()


@pytest.mark.slow  # launches a training job
def test_config_written_by_the_import_trains_as_it_is(tmp_path, corpus):
    """--config writes a whole training config (the tiny preset with the imported model, its weights and its
    tokenizer) that train_fsdp.py runs with no model, tokenizer or init_from flag: the loss of step 1 is the HF
    model's own loss on that step's batch. Problems are found before anything is written."""
    from data import load_prepared
    from data.mixture import open_datasets
    from tests import launcher
    from tests.helpers import TRAIN, job_env
    from tests.test_hf import save_tokenizer

    hf_dir, written = tmp_path / "hf", tmp_path / "cfg/llama.yaml"
    save_llama(hf_dir, **TINY_LLAMA)
    preset = ROOT / "config/train_tiny_fsdp.yaml"
    args = [str(hf_dir), str(tmp_path / "llama.pth"), "--config", str(written), "--base_config", str(preset)]
    assert import_hf.main(args) == 1  # no tokenizer in the folder yet: nothing written
    assert not (tmp_path / "llama.pth").exists() and not written.exists()
    save_tokenizer(hf_dir, corpus)
    assert import_hf.main(args) == 0

    out, data_dir = tmp_path / "out", tmp_path / "data"
    cmd = [str(TRAIN), str(written), f"--data.files=[{corpus}]", f"--data.dataset_dir={data_dir}",
           f"--run.output_dir={out}", "--train.max_steps=1", "--train.warmup_steps=1", "--train.eval_interval=0",
           "--logging.trackers=[]"]
    proc = launcher.launch(cmd, nproc=1, env=job_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cfg = load_config(written)
    assert (cfg.run.name, cfg.model.dim, cfg.model.rope_theta, cfg.data.seq_len) == ("llama", 64, 500000.0, 64)
    prepared = load_prepared(data_dir)
    train, _ = open_datasets([(prepared, 1.0)], seq_len=64, seed=cfg.run.seed)
    x, y = train.batch(0, cfg.train.global_batch_size)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert read_metrics(out)[0]["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("fault", [None, KeyboardInterrupt()], ids=["written", "interrupted"])
def test_an_import_leaves_no_temporary_file_and_every_file_of_the_users(tmp_path, monkeypatch, fault):
    """The checkpoint, its record and the training config are written under names of their own: the user's files
    and links at `.tmp-` names beside them stay as they are (a link is never written through), and an interrupted
    import leaves nothing of its own behind."""
    from tests.test_checkpoint_input import unchanged, users_files

    save_llama(tmp_path / "hf", **TINY_LLAMA)
    out = tmp_path / "out" / "llama.pth"
    users = users_files(out.parent, ".tmp-llama.pth@", ".tmp-.llama.pth.json", ".tmp-train.yaml@")
    if fault is None:
        import_hf.import_hf(tmp_path / "hf", out)
        import_hf.write_training_config(out.parent / "train.yaml", ROOT / "config/train_tiny_fsdp.yaml", [])
        written = {"llama.pth", ".llama.pth.json", "train.yaml"}
    else:
        def interrupted(obj, f, *args, **kwargs):
            f.write(b"half a checkpoint")
            raise fault

        monkeypatch.setattr(torch, "save", interrupted)
        with pytest.raises(KeyboardInterrupt):
            import_hf.import_hf(tmp_path / "hf", out)
        written = set()
    assert {p.name for p in out.parent.iterdir()} == {p.name for p in users} | written
    assert unchanged(users)
    if fault is None:
        assert not (out.parent / "train.yaml").is_symlink()
        tiny = load_config(ROOT / "config/train_tiny_fsdp.yaml")
        assert load_config(out.parent / "train.yaml").model == tiny.model
        assert load_model(out)[1]["train_state"]["step"] == 0
