"""What a Hugging Face model folder (model.hf_path, model.hf_config) may hold, checked before any process group
starts (hf_problems, which train_fsdp.py --check runs) and again where rank 0 reads the weights: a deeply nested
config.json or index is one line naming the file, an index cannot lead to files outside the folder, and weight
files too small for the parameters config.json describes are refused before anything is built."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from config import load_config
from fsdp_utils.parallel.hf import HFModelError, hf_problems, load_hf_config, load_pretrained

transformers = pytest.importorskip("transformers")

TINY_HF = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


def save_tiny(folder: Path, **save_options) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF))
    model.save_pretrained(folder, **save_options)
    return model


def model_cfg(**fields):
    overrides = [f"--model.{key}={value}" for key, value in fields.items()]
    return load_config(None, ["--model.type=hf", "--run.device=cpu", *overrides]).model


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def deepen(path: Path, levels: int = 100_000) -> int:
    """Add a field nested `levels` deep (json.loads, which transformers reads with, raises RecursionError at 100,000),
    all on one line; return the column of its 64th bracket, the 65th level."""
    start = json.dumps(json.loads(path.read_text()))[:-1] + ', "extra": '
    path.write_text(start + "[" * levels + "]" * levels + "}")
    return len(start) + 64


def test_a_deeply_nested_config_json_is_one_line_naming_it(tmp_path):
    save_tiny(tmp_path / "hf")
    column = deepen(tmp_path / "hf/config.json")
    for cfg, where in ((model_cfg(hf_path=tmp_path / "hf"), f"model.hf_path={tmp_path / 'hf'}: "
                                                             f"{tmp_path / 'hf/config.json'}: "),
                       (model_cfg(hf_config=tmp_path / "hf/config.json"),
                        f"model.hf_config={tmp_path / 'hf/config.json'}: ")):
        assert hf_problems(cfg) == [f"{where}nested more than 64 levels deep (line 1, column {column})"]
        with pytest.raises(HFModelError):
            load_hf_config(cfg)


def test_a_deeply_nested_weight_index_is_one_line_naming_it(tmp_path):
    save_tiny(tmp_path / "hf", max_shard_size="40KB")
    index = tmp_path / "hf/model.safetensors.index.json"
    column = deepen(index)
    cfg = model_cfg(hf_path=tmp_path / "hf")
    line = f"model.hf_path={tmp_path / 'hf'}: {index}: nested more than 64 levels deep (line 1, column {column})"
    assert hf_problems(cfg) == [line]
    with pytest.raises(HFModelError) as err:  # where rank 0 reads the weights, too
        load_pretrained(cfg)
    assert str(err.value) == line


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/{tmp}/outside.safetensors", ".."])
def test_a_weight_index_cannot_name_files_outside_its_folder(tmp_path, shard):
    """transformers joins each name of the index to the folder: `../x` or an absolute path reads a file from
    elsewhere (here a real shard of the model, moved out, so reading it would succeed)."""
    model = save_tiny(tmp_path / "hf", max_shard_size="40KB")
    index = tmp_path / "hf/model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    first = min(weight_map.values())
    (tmp_path / "hf" / first).rename(tmp_path / "outside.safetensors")
    shard = shard.format(tmp=str(tmp_path).lstrip("/"))
    edit_json(index, weight_map={name: shard if file == first else file for name, file in weight_map.items()})
    cfg = model_cfg(hf_path=tmp_path / "hf")
    line = (f"model.hf_path={tmp_path / 'hf'}: {index}: names the shard {shard!r}, which is not a file of its folder "
            f"{tmp_path / 'hf'}: only files beside the index are read")
    assert hf_problems(cfg) == [line]
    with pytest.raises(HFModelError) as err:
        load_pretrained(cfg)
    assert str(err.value) == line
    # Moved back in and named as a file of the folder, the same shard loads.
    (tmp_path / "outside.safetensors").rename(tmp_path / "hf" / first)
    edit_json(index, weight_map=weight_map)
    assert hf_problems(cfg) == []
    loaded, saved = load_pretrained(cfg).state_dict(), model.state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[name], saved[name]) for name in saved)


@pytest.mark.parametrize("sizes", [dict(num_hidden_layers=2000), dict(vocab_size=2**24)])
def test_weight_files_too_small_for_config_json_s_sizes_are_refused_before_building(tmp_path, sizes):
    """2000 layers of the tiny model are at least 49 million parameters, a vocabulary of 2**24 at least 2.1
    billion: the folder's weights (about 400 kB) cannot hold them at a byte each; said before the skeleton of the
    model (minutes for thousands of layers) is built."""
    save_tiny(tmp_path / "hf")
    edit_json(tmp_path / "hf/config.json", **sizes)
    stored = (tmp_path / "hf/model.safetensors").stat().st_size
    hidden, vocab, layers = 64, sizes.get("vocab_size", 320), sizes.get("num_hidden_layers", 2)
    # Untied embedding and head; per layer q and o (64 x 64) and two MLP matrices (64 x 128).
    lower = 2 * vocab * hidden + layers * (2 * hidden * hidden + 2 * hidden * 128)
    cfg = model_cfg(hf_path=tmp_path / "hf")
    assert hf_problems(cfg) == [
        f"model.hf_path={tmp_path / 'hf'}: hidden_size 64, intermediate_size 128, num_hidden_layers {layers}, "
        f"vocab_size {vocab}: at least {lower:,} parameters, but its weight files hold {stored:,} bytes, less than a "
        "byte per parameter: the weights are cut short, or config.json describes a larger model than they hold"]
    # A quantized model's weights may hold a parameter in a bit: the bound is eight times lower.
    edit_json(tmp_path / "hf/config.json", quantization_config={"quant_method": "bitnet"})
    assert ("less than a bit per parameter" in hf_problems(cfg)[0]) == (stored * 8 < lower)


def test_a_model_folder_without_weights_is_said_at_the_check(tmp_path):
    transformers.LlamaConfig(**TINY_HF).save_pretrained(tmp_path / "hf")
    assert hf_problems(model_cfg(hf_path=tmp_path / "hf")) == [
        f"model.hf_path={tmp_path / 'hf'}: holds no weights (model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin, pytorch_model.bin.index.json); for a model built from its config.json alone, with random "
        "weights, set model.hf_config instead"]
    assert hf_problems(model_cfg(hf_config=tmp_path / "hf/config.json")) == []


def test_model_hf_config_reads_the_file_it_names(tmp_path):
    # A folder with the config.json of one model and, beside it, the file model.hf_config names.
    transformers.LlamaConfig(**TINY_HF).save_pretrained(tmp_path)
    (tmp_path / "three_layers.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()),
                                                            "num_hidden_layers": 3}))
    assert load_hf_config(model_cfg(hf_config=tmp_path / "three_layers.json")).num_hidden_layers == 3
    assert load_hf_config(model_cfg(hf_config=tmp_path)).num_hidden_layers == 2  # a folder: its config.json
