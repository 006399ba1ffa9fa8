"""Where a run starts: afresh (from model.init_from's weights, if given), from --resume_from, or from
checkpoint.auto_resume's newest complete checkpoint; how long it runs (train.epochs counted in steps, once); and what is
said about it: a learning-rate curve that does not continue, a world size that changed, a finished run given again."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from config import Config, ConfigError, TrainConfig, config_warnings
from config.checks import run_length_problems

from ..checkpoint import CheckpointManager, CheckpointMismatch, TrainState
from ..checkpoint.contents import optimizer_switch
from ..checkpoint.errors import CheckpointError
from ..checkpoint.io import read_meta
from ..checkpoint.manager import newer_work, odd_checkpoint_problem
from ..checkpoint.metadata import MAX_COUNT
from ..checkpoint.retention import complete_checkpoints, odd_checkpoints
from ..distributed import DistEnv
from .build_run import BuiltRun
from .optim import LRSchedule
from .run_data import epoch_steps

log = logging.getLogger("train")


def resume(ckpt: CheckpointManager, run: BuiltRun, cfg: Config, env: DistEnv, resume_from: str | None, *,
           elastic: bool, train_samples: int) -> tuple[Config, TrainState]:
    """The config with the run's length decided (run_length) and the training state to start from (the checkpoint
    manager's own), with every part of its contents loaded. A checkpoint past the run's last step (a shorter run given a
    finished run's folder) is refused before anything is written."""
    state = _start(ckpt, run, cfg, resume_from)
    epochs = cfg.train.epochs
    cfg = run_length(cfg, state if ckpt.loaded is not None else None, train_samples=train_samples, env=env)
    max_steps = cfg.train.resolved_max_steps
    state.max_steps, state.epochs = max_steps, epochs  # recorded in every checkpoint from here on
    if ckpt.loaded is None:
        return cfg, state
    if state.step > max_steps:
        ckpt.close()
        raise CheckpointMismatch(nothing_to_train(cfg, state.step, epochs=epochs))
    if problem := counters_problem(state, cfg):
        ckpt.close()
        raise CheckpointMismatch(f"{ckpt.loaded[0]}: {problem}")
    if env.is_main and state.step < max_steps:  # at max_steps the loop says there is nothing to train
        if (warning := LRSchedule.from_config(cfg.train).jump(state.step, state.lr)) is not None:
            log.warning("%s", warning)
        _log_world_change(ckpt, env, state, elastic=elastic)
    return cfg, state


def _start(ckpt: CheckpointManager, run: BuiltRun, cfg: Config, resume_from: str | None) -> TrainState:
    """The fresh state (model.init_from's weights loaded, if given), or the checkpoint's, loaded."""
    if resume_from is None:
        resume_from = planned_resume(cfg, None)
        if resume_from is not None:
            log.info("checkpoint.auto_resume: continuing from the newest complete checkpoint in %s", cfg.output_dir)
    if resume_from is None:
        if cfg.model.init_from:  # a resume (above) continues the run's own weights instead
            ckpt.load_weights(cfg.model.init_from)
            weights_changed(run)
        return ckpt.contents.state
    state = ckpt.load(resume_from)
    weights_changed(run)
    return state


def run_length(cfg: Config, saved: TrainState | None, *, train_samples: int, env: DistEnv) -> Config:
    """The one place the run's length is decided: train.max_steps as given, or train.epochs counted in steps on this
    data (`train_samples` a pass); a run resumed under the train.epochs its checkpoint recorded keeps that checkpoint's
    count, which a corpus changed since would move (said in a warning). Returns the config with train.max_steps set to
    it (train.epochs cleared: config.yaml and the trackers get the count), checked as a given train.max_steps is."""
    t = cfg.train
    if t.epochs is None:
        return cfg
    counted = epoch_steps(t, train_samples=train_samples)
    kept = kept_length(t, saved) if saved is not None else None
    steps = kept if kept is not None else counted
    resolved = _with_length(cfg, steps)
    if problems := run_length_problems(resolved):
        raise ConfigError([f"train.epochs={t.epochs:g} gives train.max_steps={steps}: {problem}"
                           for problem in problems])
    if env.is_main:
        how = (f"{train_samples:,} samples of {cfg.data.seq_len} tokens a pass, {t.global_batch_size} samples a "
               f"step")
        if steps == counted:
            log.info("train.epochs=%g: %s steps (%s)", t.epochs, f"{steps:,}", how)
        else:
            log.warning("train.epochs=%g: %s steps, as the run's checkpoint recorded; this data would give %s (%s): it "
                        "changed since the run began", t.epochs, f"{steps:,}", f"{counted:,}", how)
        for line in config_warnings(resolved):
            if line not in config_warnings(cfg):  # those that the count brings
                log.warning("%s", line)
    return resolved


def counters_problem(state: TrainState, cfg: Config) -> str | None:
    """Whether the checkpoint's data position and token count leave room for the steps up to the run's last (`cfg`
    with its length decided): each step adds a global batch to them, and they are 64-bit integers wherever they are
    used (the data order's indices, the next checkpoint). What does not, or None."""
    t = cfg.train
    remaining = t.resolved_max_steps - state.step
    tokens_per_step = t.global_batch_size * cfg.data.seq_len  # as the loop's TrainState.advance counts them
    for field, per_step in (("samples_seen", t.global_batch_size), ("tokens_seen", tokens_per_step)):
        counter = getattr(state, field)
        if counter + remaining * per_step > MAX_COUNT:
            return (f"train_state.{field} {counter} leaves no room for the {remaining:,} steps to train.max_steps="
                    f"{t.resolved_max_steps} ({per_step:,} each): it would pass 2**63-1, the most a checkpoint holds")
    return None


def kept_length(t: TrainConfig, saved: TrainState) -> int | None:
    """The run's length a resume keeps from its checkpoint: the count of the train.epochs the checkpoint recorded, when
    the command gives the same; None where the run's length is not the checkpoint's to give."""
    return saved.max_steps if t.epochs is not None and saved.epochs == t.epochs and saved.max_steps > 0 else None


def _with_length(cfg: Config, steps: int) -> Config:
    """The config with train.max_steps set to the run's length (train.epochs cleared)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps, epochs=None))


def planned_resume(cfg: Config, resume_from: str | None) -> str | None:
    """What a run resumes from: --resume_from as given; else `latest` where the output directory holds a complete
    checkpoint (checkpoint.auto_resume), or None, a fresh start. A fresh start is refused where checkpoints are."""
    if resume_from is None and (existing := complete_checkpoints(cfg.output_dir)):
        # A fresh start would mix its checkpoints with these, and retention would delete them.
        if not cfg.checkpoint.auto_resume:
            raise CheckpointMismatch(f"{cfg.output_dir} already holds checkpoints of an earlier run (newest "
                                     f"{existing[0][1].name}); resume with --resume_from latest, or give this "
                                     "run another run.output_dir")
        return "latest"
    return resume_from


def resume_refusals(cfg: Config, resume_from: str | None) -> list[str]:
    """What `resume` (and the manager's load) would refuse, found from the output directory and the checkpoint's
    metadata alone, without a process group: for --check. A checkpoint that does not read is left to the run,
    which checks it whole (and with `latest` falls back to the one before); so is a run's length that train.epochs
    counts on the data."""
    try:
        planned = planned_resume(cfg, resume_from)
    except CheckpointError as err:
        return [str(err)]
    if planned is None:
        return []
    out_dir = cfg.output_dir
    if planned == "latest":
        if odd := odd_checkpoints(out_dir):
            return [odd_checkpoint_problem(odd[0])]
        if not (found := complete_checkpoints(out_dir)):
            return []  # said by launch_checks.resume_problems
        path = found[0][1]
    else:
        path = Path(planned)
    try:
        saved = TrainState.from_record(read_meta(path)["train_state"])
    except (CheckpointError, OSError, TypeError):
        return []
    if problem := optimizer_switch(saved.optimizer, cfg.train.optimizer, path):
        return [problem]
    steps = cfg.train.max_steps if cfg.train.epochs is None else kept_length(cfg.train, saved)
    if steps is not None and saved.step > steps:
        return [nothing_to_train(_with_length(cfg, steps), saved.step, epochs=cfg.train.epochs)]
    if steps is not None and (problem := counters_problem(saved, _with_length(cfg, steps))):
        return [f"{path}: {problem}"]
    if planned != "latest" and (newer := newer_work(path, saved.step, out_dir)):
        return [newer]
    return []


def weights_changed(run: BuiltRun) -> None:
    """The weights changed outside an optimizer step: the converters redo their post-step work (FP8 scales)."""
    for converter in run.converters:
        converter.refresh(run.model)


def _log_world_change(ckpt: CheckpointManager, env: DistEnv, state: TrainState, *, elastic: bool) -> None:
    """Where an elastic job's restart, or a resume at another world size, continues from."""
    assert ckpt.loaded is not None, "called after a load"
    path, saved_world = ckpt.loaded
    if saved_world != env.world_size or elastic:
        log.info("world %d -> %d at step %d: resumed from checkpoint %s", saved_world, env.world_size, state.step,
                 path)


def nothing_to_train(cfg: Config, step: int, *, epochs: float | None = None) -> str:
    """The line of a run resumed at or past its last step: the same command after the run finished, or another run (a
    smoke run with a lowered train.max_steps) given the finished run's folder. `epochs`: the train.epochs that
    counted the run's train.max_steps."""
    max_steps = cfg.train.resolved_max_steps
    found = [path for saved, path in complete_checkpoints(cfg.output_dir) if saved == step]
    where = f"checkpoint {found[0]}" if found else f"checkpoint of step {step}"
    afresh = (f"to start a new run, give it its own folder (--run.name=NAME, or run.output_dir; this one is "
              f"{cfg.output_dir})")
    length, knob, past = f"train.max_steps={max_steps}", "train.max_steps", f"train.max_steps above {step}"
    if epochs is not None:
        length, knob, past = f"train.epochs={epochs:g} ({max_steps} steps)", "train.epochs", "train.epochs"
    if step > max_steps:
        return (f"the run in {cfg.output_dir} already reached step {step} ({where}), past this command's "
                f"{length}: {afresh}; to continue that run, raise {past}")
    return (f"nothing to train: the run already reached {length} ({where}); raise {knob} to continue, or {afresh}")
