"""The data a run trains on: prepared folders as they are (data.sources), or data.files prepared once by
rank 0 while the other ranks wait for it on a file, not in a collective (preparing can outlast
run.timeout_s); and train.epochs counted in steps on it."""
from __future__ import annotations

import math
import uuid
from fractions import Fraction
from pathlib import Path

import torch.distributed as dist

from config import Config, TrainConfig
from data import (
    DataError,
    PreparedData,
    PrepareSettings,
    handoff,
    load_prepared,
    prepare_for_training,
)
from data.readers import expand_inputs
from data.store import META_NAME, format_problem, hold_for_reading, read_record
from safe_io.urls import is_url

from ..distributed import DistEnv, barrier
from ..guards.preemption import StopSignal


def prepare_dataset(cfg: Config, env: DistEnv, stop: StopSignal) -> list[tuple[PreparedData, float]]:
    """The prepared folders to train on, with their weights: data.sources as they are, or else data.files prepared
    once by rank 0 (later runs reuse them) and opened by all. Rank 0's outcome reaches the waiting ranks through a
    file, so a data error ends them all with the same message; a stop signal ends a waiting rank at once."""
    d = cfg.data
    if d.sources:
        for source in d.sources:
            hold_for_reading(Path(source.path))  # no preparation replaces it while this run reads it
        return [(check_format(load_prepared(source.path), d.format, d.document_masking), source.weight)
                for source in d.sources]
    settings = prepare_settings(cfg)
    dataset_dir = settings.folder
    job_id: list[str | None] = [uuid.uuid4().hex if env.is_main else None]
    dist.broadcast_object_list(job_id, src=0)  # quick: every rank arrives here straight after startup
    assert job_id[0] is not None
    outcome = handoff.outcome_path(cfg.output_dir, job_id[0])
    if env.is_main:
        error = None
        try:
            prepare_for_training(dataset_dir, settings, named_dir=bool(d.dataset_dir), max_input_mb=d.max_in_job_mb)
        except (DataError, ValueError, OSError) as err:
            error = str(err)
        handoff.publish(outcome, error)
    else:
        error = handoff.wait_for(outcome, dataset_dir=dataset_dir, timeout_s=d.prepare_wait_s,
                                 stop_requested=lambda: stop.name)
    barrier(env)  # quick too: rank 0 is done, and once all are past it nobody reads the outcome file
    if env.is_main:
        outcome.unlink(missing_ok=True)
    if error is not None:
        raise DataError(error)
    hold_for_reading(Path(dataset_dir))
    return [(check_format(load_prepared(dataset_dir), d.format, d.document_masking), 1.0)]


def data_problems(cfg: Config) -> list[str]:
    """What `prepare_dataset` refuses before it prepares anything, found without a process group: for --check.
    Each folder of data.sources complete and of data.format; else data.files' local files there (URLs are left to
    the run: reaching them takes the network)."""
    d = cfg.data
    try:
        for source in d.sources:
            check_format(load_prepared(source.path), d.format, d.document_masking)
        if not d.sources and (local := [entry for entry in d.files if not is_url(entry)]):
            expand_inputs(local)
    except DataError as err:
        return [str(err)]
    return []


def prepare_settings(cfg: Config) -> PrepareSettings:
    """What decides the prepared folder of data.files (or data.hf_dataset): the data section, run.seed (the
    validation split), and model.hf_path, whose tokenizer data.tokenizer=hf uses without data.hf_tokenizer."""
    return PrepareSettings(**vars(cfg.data), seed=cfg.run.seed, model_hf_path=cfg.model.hf_path)


def check_format(prepared: PreparedData, wanted: str, document_masking: bool = False) -> PreparedData:
    """The folder, if it holds data of data.format (a chat folder has masks, a text folder none) that
    data.document_masking can keep apart."""
    if (problem := format_problem(prepared.root, prepared.format, wanted)) is not None:
        raise DataError(f"data.format={wanted}: {problem}")
    if document_masking and wanted == "chat":
        # Masking cuts at every EOS: a template whose end-of-turn token is the EOS would cut inside conversations.
        meta = read_record(prepared.root / META_NAME)
        if meta.get("num_conversations_with_eos_inside", 0):
            raise DataError(f"data.document_masking: {meta['num_conversations_with_eos_inside']} conversations in "
                            f"{prepared.root} hold the tokenizer's EOS inside them (their template ends turns with "
                            "it), so masking at EOS would cut them apart; set data.document_masking: false")
    return prepared


def epoch_steps(t: TrainConfig, *, train_samples: int) -> int:
    """train.epochs in optimizer steps: epochs x the training split's samples (windows of data.seq_len tokens) over
    train.global_batch_size, rounded up (the last step may reach into the next pass), at least one."""
    assert t.epochs is not None, "called for train.epochs"
    epochs = Fraction(repr(t.epochs))  # as written: 0.3 epochs is 3/10, not the float just under it
    return max(1, math.ceil(epochs * train_samples / t.global_batch_size))
