"""Tests for config/: presets load, every problem is reported together with a suggestion, the batch split,
and the command line's exit codes for config errors (before any process group starts)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from config import Config, ConfigError, check_batch_split, load_config, save_config, summarize_config
from config.model_checks import model_problems
from tests.helpers import assert_refused_before_the_process_group, job_env, run_job

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "config" / "train_tiny_fsdp.yaml"
# The training presets; config/finetune_*.yaml name a model folder of the user's (tests/test_chat.py loads them).
PRESETS = sorted((ROOT / "config").glob("train*.yaml"))


# ---- presets ----------------------------------------------------------------------------------------


def test_tiny_preset_exists():
    assert TINY in PRESETS


@pytest.mark.parametrize("path", PRESETS, ids=[p.name for p in PRESETS])
def test_preset_loads_and_is_consistent(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # vocab_size 0 means "from the tokenizer"; with the data's vocabulary the model shape must be valid.
    model = cfg.model
    if model.vocab_size == 0:
        model.vocab_size = cfg.data.vocab_size
    assert model_problems(model) == []
    assert cfg.data.seq_len <= model.max_seq_len
    # Every preset runs as one process and on the 2 ranks used by the tests (a whole accumulation; with
    # micro_batch_size auto, a whole per-rank batch, checked without an error).
    for world_size in (1, 2):
        split = check_batch_split(cfg.train, world_size)
        assert split is None if cfg.train.micro_batch_size == "auto" else split >= 1


@pytest.mark.parametrize("path", PRESETS, ids=[p.name for p in PRESETS])
def test_a_smoke_run_of_a_preset_needs_one_flag(path):
    """--train.max_steps=10 alone: every preset warms up over at least 10 steps, and a warmup longer than the run
    is a warning (config_warnings), not an error."""
    cfg = load_config(path, ["--train.max_steps=10"])
    assert cfg.train.max_steps == 10


@pytest.mark.parametrize("value", [-5, 0])
@pytest.mark.parametrize("path", PRESETS, ids=[p.name for p in PRESETS])
def test_a_max_steps_that_is_not_positive_is_one_problem(path, value):
    # Not also "logging.memory_snapshot_step=0 is after train.max_steps=-5", with snapshots off.
    assert problems_of(f"--train.max_steps={value}", path=path) == [f"train.max_steps must be positive, got {value}"]


@pytest.mark.parametrize("name", ["train90M_fsdp.yaml", "train300M_fsdp.yaml", "train1B_fsdp.yaml",
                                  "train8B_fsdp.yaml"])
def test_gpu_presets_on_the_default_corpus_stay_within_a_few_epochs(name):
    # The default corpus (the standard library sources, data.files empty) is about 2.9M tokens with a 16k
    # vocabulary (measured: 5,000 steps of 131k tokens were ~230 epochs); a preset shipped with it must not
    # memorise it for hundreds of epochs: at most 4.
    cfg = load_config(ROOT / "config" / name)
    assert cfg.data.files == []
    tokens = cfg.train.max_steps * cfg.train.global_batch_size * cfg.data.seq_len
    assert tokens <= 4 * 2.9e6, tokens / 2.9e6
    assert cfg.train.micro_batch_size == "auto"


def test_tiny_preset_values():
    cfg = load_config(TINY)
    # The YAML's 3.0e-3 arrives as a float, and the batch split is 16 / (8 * 1) = 2 on one process.
    assert cfg.train.lr == 3e-3 and isinstance(cfg.train.lr, float)
    assert check_batch_split(cfg.train, 1) == 2
    assert cfg.output_dir == Path("checkpoints/tiny")  # run.output_dir empty -> checkpoints/<run.name>


# ---- overrides --------------------------------------------------------------------------------------


def test_overrides_are_parsed_as_yaml_scalars():
    cfg = load_config(TINY, ["--train.lr=1e-3", "--train.max_steps=70", "--logging.trackers=[]",
                             "--data.files=[a.txt, b.jsonl]", "--model.n_kv_heads=null", "--run.name=x"])
    assert cfg.train.lr == 1e-3  # YAML reads 1e-3 as a string (no dot); the float field accepts it
    assert cfg.train.max_steps == 70
    assert cfg.logging.trackers == []
    assert cfg.data.files == ["a.txt", "b.jsonl"]
    assert cfg.model.n_kv_heads is None and cfg.model.num_kv_heads == cfg.model.n_heads
    assert cfg.output_dir == Path("checkpoints/x")


def test_single_path_is_accepted_as_file_list():
    assert load_config(TINY, ["--data.files=/x/corpus.txt"]).data.files == ["/x/corpus.txt"]


def test_no_config_file_means_defaults():
    assert load_config(None, []).to_dict() == Config().to_dict()


# ---- train.epochs: the run's length counted on the data ------------------------------------------------------

EPOCHS = ["--train.max_steps=null", "--train.epochs=0.5"]  # the tiny preset gives train.max_steps


def test_epochs_or_max_steps_one_of_them_and_neither_is_1000_steps():
    assert load_config(None, []).train.max_steps == 1000 and load_config(None, []).train.epochs is None
    assert load_config(TINY, ["--train.max_steps=null"]).train.max_steps == 1000
    t = load_config(TINY, EPOCHS).train
    assert (t.max_steps, t.epochs) == (None, 0.5)
    assert problems_of("--train.epochs=2") == [
        "train.epochs=2 and train.max_steps=1000 are both set: give one (--train.max_steps=null drops a config "
        "file's)"]
    assert problems_of("--train.max_steps=null", "--train.epochs=0") == ["train.epochs must be positive, got 0"]
    # The checks against the step count wait for the data to count it: none of them fires before.
    cfg = load_config(TINY, [*EPOCHS, "--logging.profile_steps=[5,6]", "--train.lr_schedule=wsd"])
    assert "0.5 epochs" in summarize_config(cfg)[2]


def _counted(epochs: float, *, samples: int, saved=None, max_steps: str = "null"):
    """The config after run_length, and what it logged (rank 0), for `epochs` over `samples` training samples."""
    from fsdp_utils.train.resume import run_length
    from tests.distributed_harness import cpu_env

    cfg = load_config(TINY, [f"--train.max_steps={max_steps}", f"--train.epochs={epochs}"] if max_steps == "null"
                      else [f"--train.max_steps={max_steps}"])
    return run_length(cfg, saved, train_samples=samples, env=cpu_env(0, 1))


def test_epochs_are_counted_in_steps_once_and_a_resume_keeps_its_checkpoints_count(caplog):
    from fsdp_utils.checkpoint import TrainState

    tiny = load_config(TINY)
    batch, seq = tiny.train.global_batch_size, tiny.data.seq_len  # 16 and 128
    with caplog.at_level("INFO", logger="train"):
        # ceil(0.5 x 1,000 / 16) = ceil(31.25) = 32; 0.3 x 160 / 16 is 3 exactly (not the float's 3.0000000000000004)
        assert _counted(0.5, samples=1000).train.max_steps == 32
        assert _counted(0.3, samples=160).train.max_steps == 3
        assert _counted(0.001, samples=160).train.max_steps == 1  # at least one step
    assert caplog.messages[0] == (f"train.epochs=0.5: 32 steps (1,000 samples of {seq} tokens a pass, {batch} samples "
                                  f"a step)")
    resolved = _counted(0.5, samples=1000)
    assert (resolved.train.epochs, resolved.train.resolved_max_steps) == (None, 32)  # config.yaml: the count
    assert load_config(None, []).train.resolved_max_steps == 1000
    caplog.clear()
    with caplog.at_level("INFO", logger="train"):
        # Resumed under the same train.epochs on a corpus that grew (1,200 samples: 38 steps): the checkpoint's 32.
        saved = TrainState(step=10, max_steps=32, epochs=0.5)
        assert _counted(0.5, samples=1200, saved=saved).train.max_steps == 32
        said = "train.epochs=0.5: 32 steps, as the run's checkpoint recorded; this data would give 38 (1,200 samples " \
               f"of {seq} tokens a pass, {batch} samples a step): it changed since the run began"
        assert ("WARNING", said) in [(r.levelname, r.getMessage()) for r in caplog.records]
        # Another train.epochs counts afresh; a checkpoint without a count (saved before runs kept one) too.
        assert _counted(1, samples=1200, saved=saved).train.max_steps == 75
        assert _counted(0.5, samples=1200, saved=TrainState(step=10)).train.max_steps == 38
        # A given train.max_steps is the count, whatever the checkpoint says.
        assert _counted(0.5, samples=1200, saved=saved, max_steps="100").train.max_steps == 100


def test_a_count_from_epochs_is_checked_as_a_given_max_steps_is(caplog):
    from fsdp_utils.train.resume import run_length
    from tests.distributed_harness import cpu_env

    cfg = load_config(TINY, [*EPOCHS, "--logging.profile_steps=[5,40]"])
    with pytest.raises(ConfigError) as caught:
        run_length(cfg, None, train_samples=1000, env=cpu_env(0, 1))  # 32 steps
    assert caught.value.problems == [
        "train.epochs=0.5 gives train.max_steps=32: logging.profile_steps=[5, 40] ends after train.max_steps=32"]
    with caplog.at_level("INFO", logger="train"):  # the warmup of 100 steps is longer than the 32 counted
        run_length(load_config(TINY, [*EPOCHS, "--train.warmup_steps=100"]), None, train_samples=1000,
                   env=cpu_env(0, 1))
    assert any(m.startswith("train.warmup_steps=100 exceeds train.max_steps=32") for m in caplog.messages)


def test_save_config_round_trips(tmp_path):
    cfg = load_config(TINY, ["--train.lr=2e-3", "--model.vocab_size=320", "--fsdp.version=2"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").to_dict() == cfg.to_dict()


# ---- problems reported with the field's name and a suggestion ---------------------------------------


def problems_of(*overrides, path=TINY) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    # The message is the problems, one per line.
    assert str(info.value).splitlines() == info.value.problems
    return info.value.problems


def test_unknown_key_suggests_closest():
    assert problems_of("--train.lrr=1") == ["unknown key 'train.lrr' (did you mean 'train.lr'?)"]


def test_unknown_section_suggests_closest():
    assert problems_of("--trian.lr=1") == ["unknown key 'trian' (did you mean 'train'?)"]


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_step: 5\nfsdp:\n  sharding: FULL_SHARD\n")
    problems = problems_of(path=path)
    assert problems[0] == "unknown key 'train.max_step' (did you mean 'train.max_steps'?)"
    assert problems[1].startswith("unknown key 'fsdp.sharding' (did you mean 'fsdp.sharding_strategy")
    assert len(problems) == 2


def test_unknown_key_far_from_anything_has_no_suggestion():
    (problem,) = problems_of("--train.zzzzzzzz=1")
    assert problem == "unknown key 'train.zzzzzzzz'"


@pytest.mark.parametrize(("override", "yaml", "replacement"), [
    ("--train.eval_batches=8", "train:\n  eval_batches: 4\n", "train.eval_samples"),
    ("--logging.tensorboard=false", "logging:\n  tensorboard: true\n", "logging.trackers"),
    ("--logging.peak_flops=989e12", "logging:\n  peak_flops: 312e12\n", "logging.peak_tflops"),
])
def test_a_removed_field_names_its_replacement(tmp_path, override, yaml, replacement):
    (problem,) = problems_of(override)
    field = override[2:].partition("=")[0]
    assert problem.startswith(f"{field} is no longer a field: use {replacement}, ")
    assert "\n" not in problem
    path = tmp_path / "old.yaml"  # an older config file: the same line, not a suggestion of a near name
    path.write_text(yaml)
    assert problems_of(path=path) == [problem]


def test_misspelt_sharding_strategy_suggests_valid_one():
    (problem,) = problems_of("--fsdp.sharding_strategy=FULL_SHRAD")
    assert problem.startswith("fsdp.sharding_strategy='FULL_SHRAD' is not one of ")
    assert "(did you mean 'FULL_SHARD'?)" in problem


def literal_fields(cls: type, prefix: str) -> list[tuple[str, tuple, bool]]:
    """(field, choices, is a list) for every Literal-typed field under a section, subsections included."""
    found = []
    for name, hint in typing.get_type_hints(cls).items():
        is_list = typing.get_origin(hint) is list
        item = typing.get_args(hint)[0] if is_list else hint
        if typing.get_origin(item) is typing.Literal:
            found.append((f"{prefix}{name}", typing.get_args(item), is_list))
        elif dataclasses.is_dataclass(item):
            found += literal_fields(item, f"{prefix}{name}.")
    return found


LITERAL_FIELDS = literal_fields(Config, "")


def test_the_choices_are_typed_literal():
    # The fields the one choice check reads; a string choice typed plain str would escape it.
    names = {name for name, _, _ in LITERAL_FIELDS}
    assert {"fsdp.sharding_strategy", "train.precision", "train.lr_schedule", "checkpoint.format",
            "checkpoint.async_writer", "fsdp.activation_checkpointing", "train.lora.targets",
            "logging.trackers", "data.format"} <= names


@pytest.mark.parametrize(("name", "choices", "is_list"), LITERAL_FIELDS, ids=[f[0] for f in LITERAL_FIELDS])
def test_every_choice_refuses_a_value_outside_it(name, choices, is_list):
    # "zzz" is near no choice, so the message ends without a suggestion; train.lora is checked with LoRA on.
    lora = ["--train.lora.rank=4"] if name.startswith("train.lora.") else []
    value = "[zzz]" if is_list else "zzz"
    assert f"{name}='zzz' is not one of {', '.join(choices)}" in problems_of(f"--{name}={value}", *lora)


def test_lora_targets_are_not_checked_with_lora_off():
    assert load_config(TINY, ["--train.lora.targets=[zzz]"]).train.lora.rank == 0


def test_a_choice_of_another_type_is_a_type_problem():
    assert problems_of("--train.precision=16") == ["train.precision: expected a string, got the integer 16"]


def test_wrong_type_names_the_field():
    (problem,) = problems_of("--train.max_steps=abc")
    assert problem == "train.max_steps: expected an integer, got the string 'abc'"
    # A bool is not an int, although Python says isinstance(True, int).
    (problem,) = problems_of("--model.dim=true")
    assert problem == "model.dim: expected an integer, got the boolean True"
    (problem,) = problems_of("--model.dim=null")
    assert problem == "model.dim: expected an integer, got null"
    (problem,) = problems_of("--train.micro_batch_size=2.5")
    assert problem == "train.micro_batch_size: expected an integer or a string, got the number 2.5"


def test_a_number_in_quotes_is_reported_as_a_string(tmp_path):
    # YAML reads "128" as text: said as such, with the fix, whatever else the run would compare it with.
    path = tmp_path / "quoted.yaml"
    path.write_text('model:\n  dim: "128"\n  n_kv_heads: \'2\'\n')
    assert problems_of(path=path) == [
        "model.dim: expected an integer, got the string '128' (in quotes, a number is a string: write it without them)",
        "model.n_kv_heads: expected an integer, got the string '2' (in quotes, a number is a string: write it "
        "without them)"]


def test_all_problems_are_reported_together():
    problems = problems_of("--train.max_steps=abc", "--train.lrr=1", "--fsdp.sharding_strategy=FULL_SHRAD",
                           "--data.seq_len=4096")
    # Four independent mistakes -> four lines, each naming its field (4096 > the tiny model's 128).
    assert len(problems) == 4
    joined = "\n".join(problems)
    for field in ("train.max_steps", "train.lrr", "fsdp.sharding_strategy",
                  "data.seq_len=4096 exceeds model.max_seq_len=128"):
        assert field in joined


def test_value_checks():
    problems = problems_of("--model.dim=130", "--train.lr=0", "--train.global_batch_size=12",
                           "--train.micro_batch_size=8")
    joined = "\n".join(problems)
    assert "model.dim=130 must be divisible by model.n_heads=4" in joined  # 130 / 4 is not whole
    assert "train.lr must be positive, got 0.0" in joined
    assert "train.global_batch_size=12 is not a multiple of train.micro_batch_size=8" in joined
    assert len(problems) == 3


def test_missing_and_malformed_config_files(tmp_path):
    assert problems_of(path=tmp_path / "nope.yaml") == [f"config file not found: {tmp_path / 'nope.yaml'}"]
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert problems_of(path=tmp_path / "list.yaml") == [
        f"{tmp_path / 'list.yaml'}: top level must be a mapping of sections"]
    (tmp_path / "broken.yaml").write_text("train: [1, 2\n")
    (problem,) = problems_of(path=tmp_path / "broken.yaml")
    assert problem.startswith(f"{tmp_path / 'broken.yaml'}: not valid YAML")


def test_a_config_file_that_is_not_a_regular_file_says_what_it_is(tmp_path):
    """A FIFO (which a read would block on) and /dev/zero (which a read never ends) were "not found"; a name holding
    a line break is quoted, so that it cannot split the error line."""
    os.mkfifo(tmp_path / "fifo.yaml")
    hint = "give the YAML file, e.g. config/train_tiny_fsdp.yaml"
    assert problems_of(path=tmp_path / "fifo.yaml") == [f"{tmp_path / 'fifo.yaml'}: a FIFO, not a regular file; {hint}"]
    assert problems_of(path=Path("/dev/zero")) == [f"/dev/zero: a device, not a regular file; {hint}"]
    forged = tmp_path / "a\nerror: b.yaml"
    assert problems_of(path=forged) == ["config file not found: " + repr(str(forged))]


# Values that passed validation and then failed in the run (a ZeroDivisionError building the model,
# torch.optim's ValueError, OverflowError in a sleep or a seed, NaN at step 1) or silently changed
# meaning (a negative grace period or chunk size): each with the field's name and valid range.
OUT_OF_RANGE = {
    "--model.multiple_of=0": "model.multiple_of must be positive (it rounds the derived ffn_hidden_dim), got 0",
    "--model.dim=1099511627776": "model.dim must be at most 2**20 = 1048576, got 1099511627776",
    "--model.n_layers=100000": "model.n_layers must be at most 2**16 = 65536, got 100000",
    "--model.vocab_size=1000000000": "model.vocab_size must be at most 2**24 = 16777216, got 1000000000",
    "--model.max_seq_len=100000000": "model.max_seq_len must be at most 2**20 = 1048576, got 100000000",
    "--model.rope_theta=0": "model.rope_theta must be greater than 1, got 0.0",
    "--model.rope_scaling_factor=0.5": "model.rope_scaling_factor must be at least 1, got 0.5",
    "--model.rope_high_freq_factor=1": "model.rope_high_freq_factor must be greater than "
                                       "model.rope_low_freq_factor=1.0, got 1.0",
    "--model.rope_original_max_seq_len=0": "model.rope_original_max_seq_len must be positive, got 0",
    "--model.norm_eps=-1": "model.norm_eps must be positive, got -1.0",
    "--model.init_std=-0.02": "model.init_std must be positive, got -0.02",
    "--train.beta1=2": "train.beta1 must be in [0, 1), got 2.0",
    "--train.beta2=-1": "train.beta2 must be in [0, 1), got -1.0",
    "--train.loss_chunk_tokens=-5": "train.loss_chunk_tokens must be 0 (off) or positive, got -5",
    f"--run.seed={2**64}": f"run.seed: {2**64} does not fit a 64-bit integer (at most 2**63 - 1), in which the run "
                           "counts it",
    "--run.timeout_s=100000000000": "run.timeout_s must be in (0, 10**9] seconds, got 100000000000",
    "--run.preemption_grace_s=-1": "run.preemption_grace_s must be in (0, 10**9] seconds, got -1.0",
}


def test_out_of_range_values_are_reported_together():
    # ffn_hidden_dim=null: the hidden width is derived by rounding to multiple_of (which divided by zero).
    problems = problems_of("--model.ffn_hidden_dim=null", *OUT_OF_RANGE)
    assert sorted(problems) == sorted(OUT_OF_RANGE.values())


def test_integers_past_64_bits_are_refused_by_the_loader():
    """Integer fields reach int64 tensors, numpy keys and the checkpoint's counters: 2**63 steps passed every check
    (a positive integer) and would overflow them."""
    assert problems_of(f"--train.max_steps={2**63}") == [
        f"train.max_steps: {2**63} does not fit a 64-bit integer (at most 2**63 - 1), in which the run counts it"]
    # Any integer field, a list's items and an integer or a string (micro_batch_size) alike; the negative end too.
    assert problems_of(f"--train.micro_batch_size={2**64}", f"--logging.profile_steps=[1, {2**63}]",
                       f"--fsdp.hybrid_shard_group_size={-(2**63) - 1}") == [
        f"train.micro_batch_size: {2**64} does not fit a 64-bit integer (at most 2**63 - 1), in which the run "
        "counts it",
        f"fsdp.hybrid_shard_group_size: {-(2**63) - 1} does not fit a 64-bit integer (at most 2**63 - 1), in which "
        "the run counts it",
        f"logging.profile_steps[1]: {2**63} does not fit a 64-bit integer (at most 2**63 - 1), in which the run "
        "counts it"]


def test_the_run_s_token_count_fits_in_64_bits():
    # 16 sequences of 128 tokens a step: 2**63 - 1 tokens are 4,503,599,627,370,495 steps and a part of one.
    per_step = 16 * 128
    assert problems_of("--train.global_batch_size=16", "--data.seq_len=128",
                       f"--train.max_steps={(2**63 - 1) // per_step + 1}") == [
        f"train.max_steps={(2**63 - 1) // per_step + 1} of 2,048 tokens each (train.global_batch_size x data.seq_len) "
        "counts past 2**63 - 1 tokens; at most 4,503,599,627,370,495 steps"]
    cfg = load_config(TINY, ["--train.global_batch_size=16", "--data.seq_len=128",
                             f"--train.max_steps={(2**63 - 1) // per_step}"])  # the last step that fits
    assert cfg.train.max_steps * per_step <= 2**63 - 1


def test_range_limits_themselves_are_accepted():
    cfg = load_config(TINY, ["--model.dim=1048576", "--model.n_layers=65536", "--model.ffn_hidden_dim=4194304",
                             f"--run.seed={2**63 - 1}", "--run.timeout_s=1000000000", "--run.preemption_grace_s=0.5",
                             "--train.beta1=0", "--train.beta2=0.999", "--train.loss_chunk_tokens=0",
                             "--model.vocab_size=16777216", "--model.max_seq_len=1048576", "--model.rope_theta=1.5"])
    assert cfg.run.seed == 2**63 - 1 and cfg.model.vocab_size == 2**24 and cfg.model.max_seq_len == 2**20
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.hidden_dim) == (2**20, 2**16, 2**22)
    # The derived MLP width rounds up to model.multiple_of, bounded as ffn_hidden_dim is.
    assert problems_of("--model.ffn_hidden_dim=null", "--model.multiple_of=4194305") == [
        "model.multiple_of must be at most 2**22 = 4194304, got 4194305"]
    assert problems_of("--model.ffn_hidden_dim=4194305") == [
        "model.ffn_hidden_dim must be at most 2**22 = 4194304, got 4194305"]


def test_run_name_is_one_folder_name():
    # The output goes to checkpoints/<run.name>: a name that is a path would put it elsewhere (or nowhere).
    for name in ("..", ".", "''", "/etc", "a/b", "../../home", "a\\b", '"a\\nb"', "x" * 256):
        (problem,) = problems_of(f"--run.name={name}")
        assert problem.startswith("run.name=") and problem.endswith(
            "must be a plain folder name (1 to 255 bytes, not '.' or '..', no '/', '\\' or control characters): "
            "the output goes to checkpoints/<run.name>; set run.output_dir for another place"), (name, problem)
    for name in ("tiny", "llama-1B_v2.3", "..x", "x" * 255, "run@2026-11-27"):
        assert load_config(TINY, [f"--run.name={name}"]).output_dir == Path("checkpoints") / name


def test_llama3_rope_scaling_settings():
    # Llama 3.2's values load; the other settings alone would be ignored, so they are refused without a factor.
    cfg = load_config(TINY, ["--model.rope_scaling_factor=32", "--model.rope_low_freq_factor=1",
                             "--model.rope_high_freq_factor=4", "--model.rope_original_max_seq_len=8192"])
    assert cfg.model.llama3_scaling == {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_seq_len": 8192}
    assert load_config(TINY, []).model.llama3_scaling is None
    assert problems_of("--model.rope_low_freq_factor=0", "--model.rope_original_max_seq_len=4096") == [
        "model.rope_low_freq_factor=0.0 needs model.rope_scaling_factor (Llama 3 rotary scaling)",
        "model.rope_original_max_seq_len=4096 needs model.rope_scaling_factor (Llama 3 rotary scaling)"]
    assert problems_of("--model.rope_scaling_factor=8", "--model.rope_low_freq_factor=0") == [
        "model.rope_low_freq_factor must be positive, got 0.0"]


def test_bad_yaml_in_overrides_is_one_line_each_with_the_other_problems():
    problems = problems_of("--data.files=[a", "--run.name=!!python/object/apply:os.system [echo hacked]",
                           "--train.lrr=1")
    assert problems == [
        "override --data.files: not valid YAML: expected ',' or ']', but got '<stream end>' (line 1, column 3)",
        "override --run.name: not valid YAML: could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object/apply:os.system' (line 1, column 1)",
        "unknown key 'train.lrr' (did you mean 'train.lr'?)",
    ]


def alias_bomb(levels: int) -> str:
    """The "billion laughs" document: each level is a list of nine aliases of the level below, so the
    last one stands for 9 ** (levels + 1) strings (levels=8: 387 million) in a few hundred bytes."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\ndata:\n  files: *a{levels}\n"


def test_yaml_alias_bomb_is_refused(tmp_path):
    path = tmp_path / "bomb.yaml"
    for levels in (4, 8):  # 9**5 = 59,049 values: already past the limit; 9**9, the real bomb, refused as fast
        path.write_text(alias_bomb(levels))
        assert problems_of(path=path) == [
            f"{path}: its aliases repeat more than 10,000 values (an alias bomb?); write the values out instead"]
    assert len(alias_bomb(8)) < 1000
    # An override is YAML too.
    assert problems_of(f"--data.files={alias_bomb(4).replace(chr(10), ', ').join('{}')}") == [
        "override --data.files: its aliases repeat more than 10,000 values (an alias bomb?); write the values out "
        "instead"]
    # A value that contains itself would make the tree walk recurse forever.
    path.write_text("run: &r {name: x, seed: *r}\n")
    assert problems_of(path=path) == [f"{path}: an alias refers to a value that contains it"]


def test_modest_anchors_and_aliases_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("run: {name: &n corpus}\ndata: {text_field: *n, files: &f [a.txt, b.txt]}\n")
    cfg = load_config(path)
    assert cfg.data.text_field == "corpus" and cfg.data.files == ["a.txt", "b.txt"]


def test_deep_nesting_is_one_line(tmp_path):
    # YAML's composer recurses once per level: thousands of levels were a RecursionError, not a config error.
    path = tmp_path / "deep.yaml"
    path.write_text("data:\n  files: " + "[" * 5000 + "]" * 5000 + "\n")
    # Level 1 is the file's mapping, 2 the data section, the 63rd bracket (column 9 + 63) would be level 65.
    assert problems_of(path=path) == [f"{path}: nested more than 64 levels deep (line 2, column 72)"]
    path.write_text("".join(f"{'  ' * i}k{i}:\n" for i in range(200)))  # block style, one key per line
    assert problems_of(path=path) == [f"{path}: nested more than 64 levels deep (line 64, column 127)"]
    assert problems_of("--data.files=" + "[" * 5000 + "]" * 5000, "--train.lrr=1") == [
        "override --data.files: nested more than 64 levels deep (line 1, column 65)",
        "unknown key 'train.lrr' (did you mean 'train.lr'?)"]


def test_a_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  lr: 0.1\n  max_steps: 3\n  lr: 0.2\n")
    assert problems_of(path=path) == [
        f"{path}: key 'lr' is given twice (line 4, column 3), first at line 2, column 3; give each key once"]
    path.write_text("model: {dim: 64}\ntrain: {lr: 0.1}\nmodel: {dim: 128}\n")
    assert problems_of(path=path) == [
        f"{path}: key 'model' is given twice (line 3, column 1), first at line 1, column 1; give each key once"]
    assert problems_of("--data.sources=[{path: a, path: b}]") == [
        "override --data.sources: key 'path' is given twice (line 1, column 12), first at line 1, column 3; give "
        "each key once"]
    # A merge key (<<) brings in values that the mapping's own keys override: that is what it is for.
    path.write_text("train:\n  <<: {max_steps: 5, lr: 0.1}\n  lr: 0.2\n  warmup_steps: 5\n")
    cfg = load_config(path)
    assert (cfg.train.max_steps, cfg.train.lr) == (5, 0.2)


def test_an_integer_longer_than_python_reads_is_one_line_naming_the_key(tmp_path):
    # Python converts decimal strings of at most sys.get_int_max_str_digits() digits (4300 by default).
    digits = "9" * 5000
    assert problems_of(f"--model.dim={digits}", f"--data.files=[a, {digits}]") == [
        "model.dim: an integer of 5,000 digits, far out of range",
        "data.files[1]: an integer of 5,000 digits, far out of range"]
    path = tmp_path / "long.yaml"
    path.write_text(f"run:\n  seed: -{digits}\n")
    assert problems_of(path=path) == ["run.seed: an integer of 5,000 digits, far out of range"]
    # Other bases convert without a limit, but such a number could not be printed in an error message:
    # 16**5000 - 1 has 5000 * log10(16) = 6020.6 decimal digits, 2**20000 - 1 has 20000 * log10(2) = 6020.6.
    assert problems_of("--run.seed=0x" + "f" * 5000, "--model.dim=0b" + "1" * 20000) == [
        "run.seed: an integer of 6,021 digits, far out of range",
        "model.dim: an integer of 6,021 digits, far out of range"]


def test_a_base_60_number_is_one_line_naming_the_key(tmp_path):
    """YAML 1.1 reads 190:20:30 as 190 * 3600 + 20 * 60 + 30 = 685230, and 1:30.5 as 90.5: a time or a typo taken as
    a number. Refused under its key, in a file and in an override, whatever the field's type (run.name 12:30 would be
    the integer 750)."""
    path = tmp_path / "base60.yaml"
    path.write_text("run:\n  name: 12:30\ntrain:\n  max_steps: 190:20:30\n  lr: 1:30.5\n")
    fix = ("is read as a number in base 60 (YAML 1.1's sexagesimal); write the number in decimal, or quote the text "
           "for a string")
    assert problems_of(path=path) == [f"run.name: 12:30 {fix}", f"train.max_steps: 190:20:30 {fix}",
                                      f"train.lr: 1:30.5 {fix}"]
    assert problems_of("--train.max_steps=190:20:30", "--data.files=[a, 1:2]") == [
        f"data.files[1]: 1:2 {fix}", f"train.max_steps: 190:20:30 {fix}"]
    assert load_config(TINY, ["--run.name='12:30'"]).run.name == "12:30"  # quoted: the text


def test_numbers_are_read_in_the_digits_0_to_9_only():
    # float() reads other scripts' digits: '٣e-4' (Arabic-Indic three) would be the learning rate 0.0003.
    assert problems_of("--train.lr=٣e-4") == ["train.lr: expected a number, got the string '٣e-4'"]
    # No hint to remove quotes that are not there: '٣' is a string however it is written.
    assert problems_of("--train.max_steps=٣") == ["train.max_steps: expected an integer, got the string '٣'"]
    assert load_config(TINY, ["--train.lr=3e-4"]).train.lr == 3e-4


def test_keys_that_are_not_names(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("1: 2\ntrain: {null: 1, 1.5: 2, lr: 0.1}\n")
    assert problems_of(path=path) == ["top level: key 1 is not a name", "train: key None is not a name",
                                      "train: key 1.5 is not a name"]


def test_config_files_that_are_not_text_or_far_too_large(tmp_path):
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"train:\n  lr: \xff\xfe\xfd\n")  # not UTF-8
    (problem,) = problems_of(path=binary)
    assert problem.startswith(f"{binary}: not valid YAML: ") and "\n" not in problem
    huge = tmp_path / "fsdp_cpt100.pth"
    with huge.open("wb") as f:  # sparse: 17 MiB by its size, nothing on disk
        f.truncate(17 * 2**20)
    assert problems_of(path=huge) == [f"{huge}: 17,825,792 bytes is not a config file (at most 16,777,216); "
                                      f"give the YAML file, e.g. config/train_tiny_fsdp.yaml"]


# ---- batch split ------------------------------------------------------------------------------------


def test_batch_split_gives_accumulation_steps():
    cfg = load_config(TINY, ["--train.global_batch_size=16", "--train.micro_batch_size=2"])
    assert check_batch_split(cfg.train, 1) == 8  # 16 / (2 * 1)
    assert check_batch_split(cfg.train, 2) == 4  # 16 / (2 * 2)
    assert check_batch_split(cfg.train, 8) == 1  # 16 / (2 * 8)


@pytest.mark.parametrize("world_size", [3, 16])
def test_batch_split_that_is_not_whole_is_an_error(world_size):
    cfg = load_config(TINY, ["--train.global_batch_size=16", "--train.micro_batch_size=2"])
    with pytest.raises(ConfigError) as info:
        check_batch_split(cfg.train, world_size)
    # 16 % (2 * 3) = 4 and 16 % (2 * 16) = 16: neither is whole.
    (problem,) = info.value.problems
    assert f"= 2 * {world_size} = {2 * world_size}" in problem and "train.global_batch_size=16" in problem


# ---- the command line -------------------------------------------------------------------------------


def run_cli(*args: str, env: dict | None = None, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """`python train_fsdp.py ARGS` (a forked rank: tests/launcher.py). No torchrun variables unless given: a world
    of one."""
    start = time.perf_counter()
    proc = run_job([str(ROOT / "train_fsdp.py"), *args], env=job_env(env), timeout=timeout)
    return proc, time.perf_counter() - start


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_cli_unknown_key_exits_2_with_one_error_line():
    proc, _ = run_cli(str(TINY), "--train.lrr=1")
    assert proc.returncode == 2
    assert error_lines(proc) == ["error: unknown key 'train.lrr' (did you mean 'train.lr'?)"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name,value", [("RANK", "٠"), ("WORLD_SIZE", "²"), ("LOCAL_RANK", "x")])
def test_a_rank_variable_that_is_not_a_whole_number_is_one_error_line(name, value, monkeypatch, capsys):
    """torchrun sets them in ASCII digits; one set by hand in other digits (int() reads '٠' as 0, and fails on '²'
    with a traceback) ends the script before anything starts."""
    import train_fsdp

    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        train_fsdp.main.__wrapped__([str(TINY), "--check"])  # without @record, which wants a real stderr
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"error: {name}={value} is not a whole number from {int(name == 'WORLD_SIZE')} "
                                       "to 2147483647 (torchrun sets it; unset it to run one process)\n")


@pytest.mark.parametrize("argv,hint", [
    (["--resum_from", "latest"], "unrecognised argument '--resum_from' (did you mean '--resume_from'?)"),
    (["--resum_from=latest"], "unrecognised argument '--resum_from=latest' (did you mean '--resume_from'?)"),
    (["--chek"], "unrecognised argument '--chek' (did you mean '--check'?)"),
    (["--zzzz"], "unrecognised argument '--zzzz': overrides look like --section.key=value"),
])
def test_a_misspelt_option_of_the_command_line_suggests_the_closest(argv, hint, capsys):
    import train_fsdp

    with pytest.raises(SystemExit) as info:
        train_fsdp.parse_args([str(TINY), *argv])
    assert info.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(f": error: {hint}")


@pytest.mark.slow
def test_cli_missing_config_file_exits_2():
    proc, _ = run_cli("config/no_such_preset.yaml")
    assert proc.returncode == 2
    assert error_lines(proc) == ["error: config file not found: config/no_such_preset.yaml"]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_batch_split_impossible_for_world_size_exits_before_process_group():
    # WORLD_SIZE=3 without the other ranks: if the check came after init_process_group, rank 0 would
    # wait for ranks 1 and 2 until run.timeout_s (600 s). The tiny preset: 16 % (8 * 3) != 0.
    proc, seconds = run_cli(str(TINY), env={"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"}, timeout=120)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert "train.global_batch_size=16" in line and "= 8 * 3 = 24" in line
    assert "Traceback" not in proc.stderr
    assert seconds < 60  # python + torch import is a few seconds; no rendezvous was attempted


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_cli_out_of_range_and_bad_yaml_exit_2_before_the_process_group(nproc, tmp_path):
    """Several bad values at once: one `error:` line each, printed once (rank 0) even with 2 ranks (forked as
    torchrun starts them: tests/launcher.py), exit status 2, and the run never starts (nothing is written to the
    output directory)."""
    bad = ["--model.rope_theta=0", "--train.beta1=2", "--model.multiple_of=0", "--model.ffn_hidden_dim=null",
           "--data.files=[a", "--run.preemption_grace_s=-1"]
    out = tmp_path / "out"
    start = time.perf_counter()
    proc = run_job([str(ROOT / "train_fsdp.py"), str(TINY), f"--run.output_dir={out}", *bad], nproc=nproc,
                   env=job_env(), timeout=120)
    assert sorted(error_lines(proc)) == sorted([
        "error: model.rope_theta must be greater than 1, got 0.0",
        "error: train.beta1 must be in [0, 1), got 2.0",
        "error: model.multiple_of must be positive (it rounds the derived ffn_hidden_dim), got 0",
        "error: override --data.files: not valid YAML: expected ',' or ']', but got '<stream end>' (line 1, column 3)",
        "error: run.preemption_grace_s must be in (0, 10**9] seconds, got -1.0",
    ]), proc.stderr[-4000:]
    if nproc == 1:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    else:
        assert_refused_before_the_process_group(proc)
    assert not out.exists()
    assert time.perf_counter() - start < 60  # no rendezvous waited for


def test_help_shows_the_override_syntax_and_the_reference():
    proc = subprocess.run([sys.executable, str(ROOT / "train_fsdp.py"), "--help"], capture_output=True, text=True,
                          check=True)
    assert "--section.key=value" in proc.stdout and "docs/configuration.md" in proc.stdout


def test_the_console_gets_a_summary_of_the_config_not_all_of_it():
    cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml", ["--train.max_steps=70", "--fsdp.version=2"])
    lines = summarize_config(cfg)
    assert len(lines) <= 5
    text = "\n".join(lines)
    assert "70 steps" in text and "version 2" in text and "config.yaml" in text
    assert "document" not in text and "positions" not in text


def test_the_summary_says_documents_are_masked():
    cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml", ["--data.document_masking=true"])
    (data,) = [line for line in summarize_config(cfg) if line.startswith("data:")]
    assert data.endswith(", format text, document masking")
    cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml",
                      ["--data.document_masking=true", "--model.reset_positions=true"])
    (data,) = [line for line in summarize_config(cfg) if line.startswith("data:")]
    assert data.endswith(", format text, document masking, positions restart at each document")
