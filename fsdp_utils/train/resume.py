"""Where a run starts: afresh (from model.init_from's weights, if given), from --resume_from, or from
checkpoint.auto_resume's newest complete checkpoint; and what is said about it: a learning-rate curve that does not
continue, a world size that changed, a finished run given again."""
from __future__ import annotations

import logging

from config import Config

from ..checkpoint import CheckpointManager, CheckpointMismatch, TrainState
from ..distributed import DistEnv
from .build_run import BuiltRun
from .optim import LRSchedule

log = logging.getLogger("train")


def resume(ckpt: CheckpointManager, run: BuiltRun, cfg: Config, env: DistEnv, resume_from: str | None, *,
           elastic: bool) -> TrainState:
    """The training state to start from, with the model, optimizer and grad scaler loaded into `run`. A checkpoint
    past train.max_steps (a shorter run given a finished run's folder) is refused before anything is written."""
    out_dir = cfg.output_dir
    if resume_from is None and (existing := ckpt.complete_checkpoints()):
        # A fresh start would mix its checkpoints with these, and retention would delete them.
        if not cfg.checkpoint.auto_resume:
            raise CheckpointMismatch(f"{out_dir} already holds checkpoints of an earlier run (newest "
                                     f"{existing[0][1].name}); resume with --resume_from latest, or give this "
                                     "run another run.output_dir")
        resume_from = "latest"
        log.info("checkpoint.auto_resume: continuing from the newest complete checkpoint in %s", out_dir)
    if resume_from is None:
        if cfg.model.init_from:  # a resume (above) continues the run's own weights instead
            ckpt.load_weights(run.model, cfg.model.init_from)
            weights_changed(run)
        return TrainState()
    state = ckpt.load(run.model, run.optimizer, resume_from)
    weights_changed(run)
    if run.scaler is not None and state.grad_scaler:
        run.scaler.load_state_dict(state.grad_scaler)
    if state.step > cfg.train.max_steps:
        ckpt.close()
        raise CheckpointMismatch(nothing_to_train(ckpt, cfg, state.step))
    if env.is_main and state.step < cfg.train.max_steps:  # at max_steps the loop says there is nothing to train
        if (warning := LRSchedule.from_config(cfg.train).jump(state.step, state.lr)) is not None:
            log.warning("%s", warning)
        _log_world_change(ckpt, env, state, elastic=elastic)
    return state


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


def nothing_to_train(ckpt: CheckpointManager, cfg: Config, step: int) -> str:
    """The line of a run resumed at or past train.max_steps: the same command after the run finished, or another
    run (a smoke run with a lowered train.max_steps) given the finished run's folder."""
    max_steps = cfg.train.max_steps
    found = [path for saved, path in ckpt.complete_checkpoints() if saved == step]
    where = f"checkpoint {found[0]}" if found else f"checkpoint of step {step}"
    afresh = (f"to start a new run, give it its own folder (--run.name=NAME, or run.output_dir; this one is "
              f"{cfg.output_dir})")
    if step > max_steps:
        return (f"the run in {cfg.output_dir} already reached step {step} ({where}), past this command's "
                f"train.max_steps={max_steps}: {afresh}; to continue that run, raise train.max_steps above {step}")
    return (f"nothing to train: the run already reached train.max_steps={max_steps} ({where}); raise "
            f"train.max_steps to continue, or {afresh}")
