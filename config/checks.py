"""Value checks of a loaded config, each problem naming the field (and for a choice the closest valid one). The model's
dimensions are checked in model_checks.py, the data section's own settings in data/settings.py (which data/ checks with
them), the config against the launch (world size, GPUs, the output directory, the tokenizer's files) in launch.py."""
from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path

from data.settings import MAX_SECONDS
from model.float8_projection import FLOAT8_ALIGNMENT

from .errors import closest, range_problems
from .model_checks import model_problems
from .sections import CheckpointConfig, Config, FSDPConfig, LoggingConfig, RunConfig, TrainConfig

# Seeds reach numpy's generators (non-negative) and signed 64-bit keys of the data order; token counts are 64-bit.
MAX_SEED = 2**63 - 1


def validate(cfg: Config) -> list[str]:
    """Value checks that do not depend on the launch (see launch.py for those): every field typed
    Literal against its choices, then the values and how they combine, section by section."""
    p = [problem for section in dataclasses.fields(Config)
         for problem in choice_problems(getattr(cfg, section.name), section.name)]
    p += _model_problems(cfg) + _data_problems(cfg) + _train_problems(cfg) + _run_problems(cfg.run)
    p += _fsdp_problems(cfg.fsdp) + _checkpoint_problems(cfg.checkpoint)
    p += _logging_problems(cfg.logging, max_steps=_known_steps(cfg.train))
    return p


def _known_steps(t: TrainConfig) -> int:
    """train.max_steps, or 0 while train.epochs waits for the prepared data to be counted in steps: the checks
    against it are made then (run_length_problems)."""
    return t.max_steps or 0


def run_length_problems(cfg: Config) -> list[str]:
    """The checks against train.max_steps again, once train.epochs is counted in steps (fsdp_utils/train/resume.py);
    what else they check passed with the config."""
    steps = cfg.train.resolved_max_steps
    return (_profile_problems(cfg.logging, max_steps=steps) + _token_count_problems(cfg.train, cfg.data.seq_len)
            + _schedule_problems(cfg.train))


def _choices(section: type) -> dict[str, tuple]:
    """The fields of a section typed Literal, or a list of a Literal, with their choices."""
    found = {}
    for name, hint in typing.get_type_hints(section).items():
        if typing.get_origin(hint) is list:
            (hint,) = typing.get_args(hint)
        if typing.get_origin(hint) is typing.Literal:
            found[name] = typing.get_args(hint)
    return found


def choice_problems(section: object, where: str) -> list[str]:
    """Each Literal-typed field of one section (not of its subsections) against its choices."""
    p = []
    for name, options in _choices(type(section)).items():
        value = getattr(section, name)
        for item in value if isinstance(value, list) else [value]:
            if item not in options:
                p.append(f"{where}.{name}='{item}' is not one of {', '.join(options)}{closest(str(item), options)}")
    return p


def _logging_problems(lg: LoggingConfig, *, max_steps: int) -> list[str]:
    p: list[str] = []
    if lg.interval <= 0:
        p.append(f"logging.interval must be positive, got {lg.interval}")
    if len(set(lg.trackers)) < len(lg.trackers):
        p.append(f"logging.trackers names a tracker twice: {lg.trackers}")
    if lg.peak_tflops < 0:
        p.append(f"logging.peak_tflops must not be negative, got {lg.peak_tflops}")
    return p + _profile_problems(lg, max_steps=max_steps)


def _profile_problems(lg: LoggingConfig, *, max_steps: int) -> list[str]:
    """logging.profile_steps and the memory snapshot's settings."""
    p: list[str] = []
    if lg.profile_steps:
        if len(lg.profile_steps) != 2 or not 1 <= lg.profile_steps[0] <= lg.profile_steps[1]:
            p.append(f"logging.profile_steps must be [start, end] with 1 <= start <= end, got {lg.profile_steps}")
        elif lg.profile_steps[1] > max_steps > 0:  # a max_steps of 0 or less is reported on its own
            p.append(f"logging.profile_steps={lg.profile_steps} ends after train.max_steps={max_steps}")
    if lg.memory_snapshot_step < 0:
        p.append(f"logging.memory_snapshot_step must not be negative, got {lg.memory_snapshot_step}")
    elif lg.memory_snapshot_step and not lg.memory_snapshot:
        p.append("logging.memory_snapshot_step needs logging.memory_snapshot: true (the history is recorded "
                 "from the start of training)")
    elif lg.memory_snapshot_step > max_steps > 0:
        p.append(f"logging.memory_snapshot_step={lg.memory_snapshot_step} is after train.max_steps={max_steps}")
    return p + range_problems(lg, "logging", memory_snapshot_max_entries="> 0")


def _model_problems(cfg: Config) -> list[str]:
    p: list[str] = []
    m = cfg.model
    if m.vocab_size and m.vocab_size < 0:
        p.append(f"model.vocab_size must be 0 (take it from the tokenizer) or positive, got {m.vocab_size}")
    if m.type == "llama":
        p += model_problems(dataclasses.replace(m, vocab_size=m.vocab_size or 1))  # 0: the tokenizer's
        if cfg.data.tokenizer == "hf" and not cfg.data.hf_tokenizer:
            p.append("data.tokenizer=hf with model.type=llama needs data.hf_tokenizer (a folder with a Hugging Face "
                     "tokenizer)")
    elif m.type == "hf":
        p += _hf_model_problems(cfg)
    for where, path in (("model.init_from", m.init_from), ("data.hf_tokenizer", cfg.data.hf_tokenizer)):
        if path and not Path(path).exists():
            p.append(f"{where}: not found: {path}")
    return p


def _hf_model_problems(cfg: Config) -> list[str]:
    p: list[str] = []
    m = cfg.model
    if bool(m.hf_path) == bool(m.hf_config):
        p.append("model.type=hf needs exactly one of model.hf_path (pretrained folder) or model.hf_config "
                 "(config.json)")
    for name in ("hf_path", "hf_config"):
        if getattr(m, name) and not Path(getattr(m, name)).exists():
            p.append(f"model.{name}: not found: {getattr(m, name)}")
    if cfg.data.tokenizer == "hf" and not m.hf_path and not cfg.data.hf_tokenizer:
        p.append("data.tokenizer=hf needs data.hf_tokenizer or model.hf_path (a folder with the tokenizer files)")
    return p


def _data_problems(cfg: Config) -> list[str]:
    """The data section's own checks (data/settings.py), and those against the model."""
    d, m = cfg.data, cfg.model
    p = d.problems()
    if m.type == "llama" and d.seq_len > m.max_seq_len > 0:
        p.append(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if m.type == "hf" and d.document_masking != m.reset_positions:
        # transformers detects packed documents only where position_ids restart, and masks at every restart.
        p.append(f"model.type=hf: data.document_masking={d.document_masking} needs model.reset_positions="
                 f"{d.document_masking} (transformers masks documents exactly where their positions restart)")
    return p


def _batch_problems(t: TrainConfig) -> list[str]:
    p: list[str] = []
    for name in ("max_steps", "global_batch_size"):
        if (value := getattr(t, name)) is not None and value <= 0:
            p.append(f"train.{name} must be positive, got {value}")
    if t.epochs is not None and t.max_steps is not None:
        p.append(f"train.epochs={t.epochs:g} and train.max_steps={t.max_steps} are both set: give one "
                 "(--train.max_steps=null drops a config file's)")
    elif t.epochs is not None and t.epochs <= 0:
        p.append(f"train.epochs must be positive, got {t.epochs:g}")
    if isinstance(t.micro_batch_size, str):
        if t.micro_batch_size != "auto":
            p.append(f"train.micro_batch_size must be a positive integer or auto, got '{t.micro_batch_size}'")
    elif t.micro_batch_size <= 0:
        p.append(f"train.micro_batch_size must be positive, got {t.micro_batch_size}")
    elif t.global_batch_size % t.micro_batch_size:
        p.append(f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                 f"train.micro_batch_size={t.micro_batch_size}")
    return p + range_problems(t, "train", auto_micro_batch_margin="[0, 1)", auto_micro_batch_cpu="> 0",
                              eval_samples="> 0")


def _train_problems(cfg: Config) -> list[str]:
    t = cfg.train
    p = _batch_problems(t) + _token_count_problems(t, cfg.data.seq_len)
    # beta1, beta2: AdamW's decay rates; 1 never forgets, past it the moments diverge.
    p += range_problems(t, "train", warmup_steps=">= 0", eval_interval=">= 0", grad_clip=">= 0", weight_decay=">= 0",
                        lr="> 0", beta1="[0, 1)", beta2="[0, 1)")
    if t.loss_chunk_tokens < 0:
        p.append(f"train.loss_chunk_tokens must be 0 (off) or positive, got {t.loss_chunk_tokens}")
    p += _schedule_problems(t)
    if t.float8 != "none" and cfg.fsdp.version == 1:
        p.append(f"train.float8={t.float8} needs fsdp.version: 2 (torchao's FP8 training, FP8 all-gather of the "
                 f"sharded weights included, is built for FSDP2's fully_shard)")
    if t.float8_output:
        p += _float8_output_problems(cfg)
    if t.compile_tuning and not t.compile:
        p.append("train.compile_tuning=true tunes the compiled kernels and needs train.compile: true")
    p += range_problems(t, "train", max_bad_steps=">= 0", spike_sigmas="> 0")
    if t.spike_window < 2:
        p.append(f"train.spike_window must be at least 2, got {t.spike_window}")
    return p + _muon_problems(cfg) + _lora_problems(cfg) + _eval_tasks_problems(t)


# The one line for Muon under FSDP1 (fsdp_utils/train/muon.py says it too, from the run's FSDP adapter).
MUON_FSDP1_PROBLEM = ("train.optimizer=muon needs fsdp.version: 2: FSDP1 flattens each unit's parameters into one 1-D "
                      "shard, so no rank holds the rows of a matrix that Muon orthogonalizes whole")


def _muon_problems(cfg: Config) -> list[str]:
    t = cfg.train
    if t.optimizer != "muon":
        return []
    p = range_problems(t, "train", muon_momentum="[0, 1)", muon_ns_steps="> 0")
    if cfg.fsdp.version == 1:
        p.append(MUON_FSDP1_PROBLEM)
    if t.lora.rank > 0:
        p.append("train.optimizer=muon cannot train train.lora's adapters (their low-rank factors are no weight "
                 "matrices Muon is made for): LoRA trains with train.optimizer: adamw")
    return p


def _token_count_problems(t: TrainConfig, seq_len: int) -> list[str]:
    """The tokens of train.max_steps fit the checkpoint's 64-bit counter of them."""
    steps, per_step = _known_steps(t), t.global_batch_size * seq_len
    if steps > 0 and per_step > 0 and steps * per_step > MAX_SEED:
        return [f"train.max_steps={steps} of {per_step:,} tokens each (train.global_batch_size x data.seq_len) counts "
                f"past 2**63 - 1 tokens; at most {MAX_SEED // per_step:,} steps"]
    return []


def _float8_output_problems(cfg: Config) -> list[str]:
    """train.float8_output: FP8 matmuls take sizes in multiples of 16. With model.vocab_size 0 the vocabulary is the
    tokenizer's: a SentencePiece model trained for the run has data.vocab_size pieces; one read from files
    (data.tokenizer_model, data.tokenizer=hf, data.sources) is checked at launch (launch.py) and again when the
    model is built."""
    if cfg.model.type != "llama":
        return [f"train.float8_output=true is for our model (model.type: llama), not model.type: {cfg.model.type}"]
    d = cfg.data
    sizes = {"model.dim": cfg.model.dim, "data.seq_len": d.seq_len,
             "train.loss_chunk_tokens": cfg.train.loss_chunk_tokens, "model.vocab_size": cfg.model.vocab_size}
    if not cfg.model.vocab_size and d.tokenizer == "sentencepiece" and not d.tokenizer_model and not d.sources:
        sizes["data.vocab_size (the tokenizer's, which model.vocab_size 0 takes)"] = d.vocab_size
    return [float8_size_problem(name, value) for name, value in sizes.items() if value % FLOAT8_ALIGNMENT]


def float8_size_problem(name: str, value: int) -> str:
    """The one line for a size train.float8_output cannot take."""
    return (f"train.float8_output=true needs {name} in a multiple of {FLOAT8_ALIGNMENT} (FP8 matmuls), got {value}: "
            f"the next is {-(-value // FLOAT8_ALIGNMENT) * FLOAT8_ALIGNMENT}")


def _lora_problems(cfg: Config) -> list[str]:
    lora, p = cfg.train.lora, []
    if lora.rank < 0:
        p.append(f"train.lora.rank must be 0 (off) or positive, got {lora.rank}")
    if lora.rank <= 0:
        return p
    p += range_problems(lora, "train.lora", alpha="> 0", dropout="[0, 1)")
    p += choice_problems(lora, "train.lora")  # checked only with LoRA on, like the rest of train.lora
    if not lora.targets:
        p.append("train.lora.targets is empty: name the projections to adapt, e.g. [all] or [q, v]")
    if cfg.train.float8 != "none":
        p.append(f"train.float8={cfg.train.float8} cannot be combined with train.lora (the FP8 converter replaces the "
                 f"linear layers that carry the adapters): set train.float8: none for LoRA fine-tuning")
    if cfg.fsdp.version == 1 and not cfg.fsdp.use_orig_params:
        p.append("train.lora needs fsdp.use_orig_params: true with fsdp.version 1 (frozen and trainable "
                 "parameters are told apart by their original names)")
    return p


def _schedule_problems(t: TrainConfig) -> list[str]:
    p: list[str] = []
    if t.min_lr is not None and t.min_lr_ratio is not None:
        p.append(f"train.min_lr={t.min_lr} and train.min_lr_ratio={t.min_lr_ratio} are both set: give one (min_lr is "
                 "the floor itself, min_lr_ratio the floor as a fraction of train.lr)")
    elif t.min_lr is not None and not 0 <= t.min_lr <= t.lr:
        p.append(f"train.min_lr must be in [0, train.lr={t.lr}], got {t.min_lr}")
    elif t.min_lr_ratio is not None and not 0 <= t.min_lr_ratio <= 1:
        p.append(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if not 0 < t.decay_fraction <= 1:
        p.append(f"train.decay_fraction must be in (0, 1], got {t.decay_fraction}")
    elif t.lr_schedule == "wsd" and 0 <= t.warmup_steps <= (steps := _known_steps(t)) and steps > 0:  # longer: warned
        decay = t.wsd_decay_steps
        if t.warmup_steps + decay > steps:
            p.append(f"train.lr_schedule=wsd: train.warmup_steps={t.warmup_steps} plus the decay's "
                     f"{decay} steps (train.decay_fraction={t.decay_fraction} of train.max_steps={steps}) "
                     f"exceed train.max_steps; shorten the warmup or the decay")
    return p


def config_warnings(cfg: Config) -> list[str]:
    """What a config allows but a run seldom means, said as warnings at startup and by --check: a short smoke run of
    a preset (train.max_steps lowered alone) must still start."""
    t, w = cfg.train, []
    if t.warmup_steps > (steps := _known_steps(t)) > 0:
        w.append(f"train.warmup_steps={t.warmup_steps} exceeds train.max_steps={steps}: the run ends inside its "
                 f"warmup, at {steps / t.warmup_steps:.0%} of train.lr; for a real run, set train.warmup_steps "
                 f"below train.max_steps")
    return w


def _eval_tasks_problems(t: TrainConfig) -> list[str]:
    """The shape of train.eval_tasks*; whether lm-eval knows the tasks is checked at launch
    (fsdp_utils/train/launch_checks.py)."""
    p: list[str] = []
    if t.eval_tasks_limit < 0:
        p.append(f"train.eval_tasks_limit must be 0 (all documents) or positive, got {t.eval_tasks_limit}")
    if any(not name.strip() for name in t.eval_tasks):
        p.append("train.eval_tasks: a task name is empty")
    if t.eval_tasks and t.eval_interval == 0:
        p.append("train.eval_tasks run at every train.eval_interval, which is 0 (off); set train.eval_interval")
    p += [f"train.eval_tasks_path: not found: {path}" for path in t.eval_tasks_path if not Path(path).exists()]
    return p


def _run_name_problem(name: str) -> str | None:
    """run.name names a folder of checkpoints/: one path component, so that the output stays inside it."""
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    too_long = len(name.encode("utf-8", "surrogatepass")) > 255  # a file name's limit on Linux filesystems
    if name in ("", ".", "..") or too_long or any(c in separators or not c.isprintable() for c in name):
        return (f"run.name={name!r} must be a plain folder name (1 to 255 bytes, not '.' or '..', no '/', '\\' or "
                f"control characters): the output goes to checkpoints/<run.name>; set run.output_dir for another place")
    return None


def _run_problems(r: RunConfig) -> list[str]:
    p: list[str] = []
    if (problem := _run_name_problem(r.name)) is not None:
        p.append(problem)
    for name in r.stop_signals:
        if name not in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"):
            p.append(f"run.stop_signals: '{name}' is not one of SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP")
    if not 0 <= r.seed <= MAX_SEED:
        p.append(f"run.seed must be in [0, 2**63 - 1], got {r.seed}")
    for name in ("timeout_s", "preemption_grace_s"):
        if not 0 < getattr(r, name) <= MAX_SECONDS:
            p.append(f"run.{name} must be in (0, 10**9] seconds, got {getattr(r, name)}")
    return p


def _fsdp_problems(f: FSDPConfig) -> list[str]:
    p: list[str] = []
    if f.version not in (1, 2):
        p.append(f"fsdp.version must be 1 or 2, got {f.version}")
    return p + range_problems(f, "fsdp", ac_every_n_layers="> 0", hybrid_shard_group_size=">= 0")


def _checkpoint_problems(c: CheckpointConfig) -> list[str]:
    p = range_problems(c, "checkpoint", interval=">= 0", keep_last_n=">= 0")
    if isinstance(c.async_save, str) and c.async_save != "auto":
        p.append(f"checkpoint.async_save must be auto, true or false, got '{c.async_save}'")
    elif c.async_save is True and c.format == "full":
        p.append("checkpoint.async_save=true needs checkpoint.format=sharded (full checkpoints are written "
                 "synchronously)")
    return p
