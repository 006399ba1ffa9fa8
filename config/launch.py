"""The config against the launch, checked before any process group starts: the world sizes whose ranks can share
the global batch (an elastic job's too), the hybrid-shard grid, the GPUs visible, the output directory, and the
vocabulary that files already hold for train.float8_output. What needs the library's parts (FP8 hardware, tracker
packages, a Hugging Face folder, lm-eval tasks, a checkpoint to resume) is in fsdp_utils/train/launch_checks.py."""
from __future__ import annotations

import os
from pathlib import Path

from model.float8_projection import FLOAT8_ALIGNMENT

from .checks import float8_size_problem
from .errors import ConfigError
from .sections import Config, TrainConfig


def check_batch_split(t: TrainConfig, world_size: int, micro_batch: int | None = None) -> int | None:
    """Gradient accumulation steps for this world size and micro-batch (train.micro_batch_size unless given);
    ConfigError when the split is not whole. With micro_batch_size=auto and no micro_batch: only checks that
    the global batch splits over the ranks, and returns None (the micro-batch is measured later)."""
    if micro_batch is None and t.micro_batch_size == "auto":
        if t.global_batch_size % world_size:
            raise ConfigError([
                f"train.global_batch_size={t.global_batch_size} is not divisible by the world size {world_size} "
                f"(train.micro_batch_size=auto splits each rank's share of it); pick a multiple of {world_size}"
            ])
        return None
    micro = micro_batch or t.micro_batch_size
    assert isinstance(micro, int), "micro_batch_size=auto returned above"
    per_step = micro * world_size
    if t.global_batch_size % per_step:
        raise ConfigError([
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size * world size "
            f"= {micro} * {world_size} = {per_step}; pick a global batch that is a multiple of {per_step}"
        ])
    return t.global_batch_size // per_step


def fitting_world_sizes(t: TrainConfig) -> list[int]:
    """Every world size at which train.global_batch_size splits into whole micro-batches on every rank."""
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 1  # auto: each rank's share whole
    if t.global_batch_size % micro:
        return []
    per_micro = t.global_batch_size // micro
    return [w for w in range(1, per_micro + 1) if per_micro % w == 0]


def unfit_world(t: TrainConfig, world_size: int) -> list[str]:
    """The problems of this world size's batch split ([] when it fits); the config loader has made sure that
    some world size fits (the global batch is a multiple of the micro-batch)."""
    try:
        check_batch_split(t, world_size)
    except ConfigError as err:
        return err.problems
    return []


def launch_problems(cfg: Config, *, world_size: int | None, local_world_size: int, num_gpus: int) -> list[str]:
    """Checks of the config against the launch (world size, GPUs, the output directory): every problem
    that can be found before the process group starts. world_size None (not known yet: an elastic job's
    check before it starts) leaves out the checks against it."""
    p: list[str] = []
    if world_size is not None:
        try:
            check_batch_split(cfg.train, world_size)
        except ConfigError as err:
            p += err.problems
    f = cfg.fsdp
    if f.sharding_strategy == "HYBRID_SHARD" and world_size is not None:
        group = f.hybrid_shard_group_size or local_world_size
        if world_size % group:
            where = f"fsdp.hybrid_shard_group_size={group}" if f.hybrid_shard_group_size else \
                f"fsdp.hybrid_shard_group_size=0 (the processes per node, {group})"
            p.append(f"{where} does not divide the world size {world_size}; pick a divisor of {world_size}")
    if cfg.run.device == "cuda" and num_gpus == 0:
        p.append("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    elif cfg.train.precision == "fp16" and (cfg.run.device == "cpu" or num_gpus == 0):
        # torch's gradient scaler turns itself off on the CPU, whose fp16 matmuls are also many times slower.
        where = "run.device=cpu" if cfg.run.device == "cpu" else "the CPU (no CUDA device is visible)"
        p.append(f"train.precision=fp16 on {where}: fp16 needs loss scaling, which runs on GPUs only; use "
                 f"train.precision=bf16 (or auto: fp32 on the CPU)")
    elif cfg.run.device != "cpu" and 0 < num_gpus < local_world_size:
        p.append(f"{local_world_size} processes on this node but only {num_gpus} CUDA devices are visible; "
                 f"start at most {num_gpus} (--nproc_per_node), or use run.device=cpu")
    p += output_dir_problems(cfg.output_dir)
    return p + float8_output_vocabulary_problems(cfg)


def output_dir_problems(out: Path) -> list[str]:
    """run.output_dir is a directory (or can be made one) that this user may write into."""
    existing = out
    while not os.path.exists(existing) and existing != existing.parent:  # the nearest part that exists
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == out else f"cannot be created: {existing} is a file"
        return [f"run.output_dir={out} {what}, not a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"run.output_dir={out} is not writable ({existing}: permission denied or a read-only filesystem)"]
    return []


def float8_output_vocabulary_problems(cfg: Config) -> list[str]:
    """train.float8_output with model.vocab_size 0 takes the tokenizer's vocabulary: where files already hold it
    (the prepared folder of data.sources[0], whose tokenizer every source shares; data.tokenizer_model;
    data.tokenizer=hf's folder) it is read and checked before any process group starts, not when the model is built
    after the data is prepared. A tokenizer that cannot be read is left to the data checks."""
    from data.errors import DataError  # the tokenizer's packages are imported only when a launch needs them
    from data.store import META_NAME, read_json
    from data.tokenizer import load_tokenizer

    d = cfg.data
    if not cfg.train.float8_output or cfg.model.type != "llama" or cfg.model.vocab_size:
        return []
    try:
        if d.sources:
            where, vocab = f"data.sources[0]'s tokenizer ({d.sources[0].path})", read_json(
                Path(d.sources[0].path) / META_NAME).get("vocab_size")
        elif d.tokenizer == "hf" and d.hf_tokenizer:
            where, vocab = f"data.hf_tokenizer ({d.hf_tokenizer})", load_tokenizer("hf", Path(d.hf_tokenizer)
                                                                                 ).get_piece_size()
        elif d.tokenizer_model:
            where, vocab = f"data.tokenizer_model ({d.tokenizer_model})", load_tokenizer(
                "sentencepiece", Path(d.tokenizer_model)).get_piece_size()
        else:
            return []  # trained to data.vocab_size: the config checks it
    except (DataError, OSError):
        return []
    if not isinstance(vocab, int) or not vocab % FLOAT8_ALIGNMENT:
        return []
    return [float8_size_problem(f"the vocabulary of {where}, which model.vocab_size 0 takes,", vocab)]
