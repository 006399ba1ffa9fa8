"""Train a decoder-only language model with FSDP.

    torchrun --nproc_per_node=2 train_fsdp.py config/train_tiny_fsdp.yaml        # 2 ranks (gloo on CPU, NCCL on GPU)
    python train_fsdp.py config/train_tiny_fsdp.yaml --train.max_steps=50        # one process
    torchrun --nproc_per_node=8 train_fsdp.py config/train1B_fsdp.yaml --resume_from latest

This file is the training script, to read top to bottom: `main` (the command line, every check that needs no
process group, the process group, teardown), `set_up` (the data, the model of DecoderBlocks wrapped by FSDP, the
optimizer and the micro-batch plan, the learning-rate schedule, the checkpoint manager and the resume)
and `train`, the loop: each step a batch of micro-batches through `train_step`, then the log, the evaluation, the
save and the stop, each component deciding for itself when it acts. The parts it calls live in fsdp_utils/ (one
job each: parallel/, train/, checkpoint/, evaluation/, observability/, guards/) and data/.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from config import (
    Config,
    ConfigError,
    config_warnings,
    load_config,
    split_known_args,
    summarize_config,
    unfit_world,
)
from data import DataError, open_datasets
from data.loader import TokenDataset
from data.mixture import Mixture
from data.store import tokenizer_sha256
from data.tokenizer import prepared_eos_id
from fsdp_utils.checkpoint import CheckpointError, CheckpointManager, Contents, TrainState
from fsdp_utils.distributed import (
    DistEnv,
    Launch,
    destroy_distributed,
    init_distributed,
    prefer_expandable_segments,
    read_torchrun_env,
)
from fsdp_utils.evaluation.downstream import DownstreamError, DownstreamEvaluator, open_downstream
from fsdp_utils.evaluation.validation import evaluate
from fsdp_utils.guards.elastic import wait_for_membership_change
from fsdp_utils.guards.preemption import RESTART_EXIT_CODE, StopSignal, after_stop
from fsdp_utils.guards.run_lock import RunLocked, take_run_lock
from fsdp_utils.parallel.build import ModelMemoryError, describe_model, log_parameter_summary
from fsdp_utils.parallel.hf import HFModelError
from fsdp_utils.parallel.lora import lora_record
from fsdp_utils.train.batch import TrainBatches
from fsdp_utils.train.build_run import BuiltRun, build, describe_run, finish
from fsdp_utils.train.launch_checks import estimate_line, launch_checks
from fsdp_utils.train.microbatch import describe_choice
from fsdp_utils.train.observers import Observers
from fsdp_utils.train.oom_guard import OutOfMemory, OutOfMemoryGuard
from fsdp_utils.train.optim import LRSchedule
from fsdp_utils.train.planning.report import launch_line
from fsdp_utils.train.resume import nothing_to_train, resume
from fsdp_utils.train.run_data import prepare_dataset
from fsdp_utils.train.run_files import write_run_files
from fsdp_utils.train.step import BadSteps, NonFiniteError, StepResult, train_step

log = logging.getLogger("train")
T = TypeVar("T")

# Errors of the user's input or the run's state, raised alike on every rank: one line, exit 1.
USER_ERRORS = (ConfigError, DataError, CheckpointError, OutOfMemory, ModelMemoryError, HFModelError, NonFiniteError,
               DownstreamError)


# ==== the command line and the checks before the process group ==================================================

OVERRIDES_HELP = """config overrides:
  --section.key=value   any config field, over the YAML file's value; sections: run, model, data, train,
                        fsdp, checkpoint, logging. Lists and mappings in YAML flow style:
                        --train.max_steps=2000 --fsdp.sharding_strategy=SHARD_GRAD_OP
                        --data.files=[a.jsonl,b.jsonl] --logging.profile_steps=[5,6]
  Every field, its default and its meaning: docs/configuration.md
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=OVERRIDES_HELP)
    parser.add_argument("config", help="YAML config, e.g. config/train_tiny_fsdp.yaml")
    parser.add_argument("--resume_from", default=None, help="checkpoint file, sharded folder, or 'latest'")
    parser.add_argument("--check", action="store_true",
                        help="only check what a run checks before its first step without a GPU: the config, what "
                             "the options need on this machine (all but the world size), the data files and what the "
                             "resume would refuse; print the problems and exit 2, or exit 0 after one line of the "
                             "estimate of memory and speed for a GPU run (docs/planning.md); the elastic launchers "
                             "run it first, since torchrun would repeat a config error at every restart")
    return split_known_args(parser, argv)


def read_launch() -> Launch:
    """torchrun's variables; one set by hand that is not a whole number ends the script with its `error:` line."""
    try:
        return read_torchrun_env()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def exit_early(problems: list[str], launch: Launch) -> int:
    """Report problems found before the process group as `error:` lines, once: rank 0 prints them.

    Under torchrun the other ranks then wait to be stopped: torchrun stops every worker as soon as one
    ends, so a rank that ended first could have rank 0 stopped before it printed anything."""
    if launch.rank == 0:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
    elif launch.under_torchrun:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: os._exit(2))
        time.sleep(60)
    return 2


def check_passed(cfg: Config, launch: Launch) -> int:
    """--check found no problem: print the config's warnings (a run logs them at its start) and the estimate for the
    config as launched (a run logs it for the plan it chose), and exit 0."""
    if launch.rank == 0:
        for line in config_warnings(cfg):
            print(f"warning: {line}", file=sys.stderr)
        if (estimate := estimate_line(cfg, launch)) is not None:
            print(estimate)
    return 0


def setup_logging(env: DistEnv) -> None:
    # Rank 0 speaks; the others report warnings and errors only, tagged with their rank.
    level = logging.INFO if env.is_main else logging.WARNING
    logging.basicConfig(level=level, format=f"[%(asctime)s rank{env.rank}] %(message)s", datefmt="%H:%M:%S", force=True)


# ==== everything before the first step ==========================================================================


@dataclasses.dataclass
class Run:
    """What the loop works with: the config and this rank, the data, the built run (model, optimizer, precision,
    converters, micro-batch plan), the schedule, the checkpoint manager and the state it saves."""
    cfg: Config
    env: DistEnv
    train_data: TokenDataset | Mixture
    val_data: TokenDataset | Mixture
    built: BuiltRun
    schedule: LRSchedule
    ckpt: CheckpointManager
    state: TrainState
    downstream: DownstreamEvaluator | None
    flops_per_token: float
    masked_targets: bool  # fine-tuning data: targets outside the assistant's turns are IGNORE_INDEX
    restarting: bool = False  # stopped by torchrun to restart the workers (fsdp_utils/guards/preemption.py)

    @property
    def model(self) -> nn.Module:
        return self.built.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.built.optimizer


def set_up(cfg: Config, env: DistEnv, *, stop: StopSignal, resume_from: str | None = None) -> Run:
    """Every rank, in this order: data, model (built, wrapped by FSDP, finished with its optimizer and micro-batch),
    checkpoint manager and resume (and the run's length), schedule, a trial of everything a save needs (a run that
    cannot save stops now, not at its first save), then the run's files (fsdp_utils/train/run_files.py)."""
    torch.manual_seed(cfg.run.seed)

    # ---- data: prepared once (rank 0 prepares a small corpus in the job while the others wait), memory-mapped
    sources = prepare_dataset(cfg, env, stop)
    prepared = sources[0][0]  # the tokenizer and the vocabulary: every source of a mixture shares them
    vocab_size, signature, flops_per_token = describe_model(cfg, prepared.vocab_size)
    if vocab_size < prepared.vocab_size:
        raise ConfigError([f"the model's vocabulary ({vocab_size}) is smaller than the tokenizer's "
                           f"({prepared.vocab_size})"])
    train_data, val_data = open_datasets(sources, seq_len=cfg.data.seq_len, seed=cfg.run.seed)
    # The token that separates documents, for the model's document masking and restarting positions.
    needs_eos = cfg.data.document_masking or cfg.model.reset_positions
    eos_id = prepared_eos_id(prepared.tokenizer_path) if needs_eos else None
    downstream = open_downstream(cfg.train, tokenizer_kind=cfg.data.tokenizer, tokenizer_path=prepared.tokenizer_path,
                                 max_length=cfg.data.seq_len, env=env)

    # ---- the model of DecoderBlocks, wrapped by FSDP, its optimizer, the micro-batch plan
    if env.is_main:
        for line in summarize_config(cfg):
            log.info("%s", line)
        for line in config_warnings(cfg):
            log.warning("%s", line)
        if cfg.model.type == "llama":  # a Hugging Face model's line comes from build_model, which counts it
            log_parameter_summary(cfg.model)
    parts = build(cfg, env, eos_id=eos_id)  # the model, its converters (FP8), activation checkpointing, compile
    # FSDP through the adapter of fsdp.version (fsdp_utils/parallel/fsdp.py), which the step, the out-of-memory guard
    # and the checkpoints use too: a unit per block, then the root; gradients reduced in fp32 unless fsdp.reduce_dtype.
    model = parts.fsdp.wrap(parts.model, auto_wrap_policy=ModuleWrapPolicy(parts.units),
                            mixed_precision=MixedPrecision(param_dtype=parts.precision.compute,
                                                           reduce_dtype=parts.precision.reduce),
                            compile=cfg.train.compile, init=parts.init)
    # The weights materialised, the optimizer (after FSDP2's fully_shard), the micro-batch plan.
    built = finish(cfg, env, parts, model, vocab_size=vocab_size, model_signature=signature)
    if env.is_main:
        for line in [*describe_choice(built.choice, cfg, world_size=env.world_size),
                     *describe_run(cfg, env, built, train_tokens=train_data.num_tokens,
                                   val_tokens=val_data.num_tokens)]:
            log.info("%s", line)
        if built.probe is not None:  # on GPUs: the estimate of the plan chosen, beside what the run will measure
            log.info("%s", launch_line(cfg, gpus=env.world_size, nodes=env.world_size // env.local_world_size,
                                       device_name=built.probe.name, vocab_size=vocab_size,
                                       micro_batch=built.split.micro_batch_size,
                                       checkpointing=built.choice.checkpointing))

    # ---- the checkpoint manager and the resume (after the micro-batch search: its trials need no optimizer state)
    ckpt = CheckpointManager(cfg.checkpoint, cfg.output_dir, env=env, model_config=signature,
                             contents=Contents(built.model, built.optimizer, TrainState(optimizer=cfg.train.optimizer),
                                               fsdp=built.fsdp, grad_scaler=built.scaler, spike_skipper=built.skipper),
                             timeout_s=cfg.run.timeout_s, tokenizer_sha256=tokenizer_sha256(prepared.tokenizer_path),
                             lora=lora_record(cfg, signature, base_dtype=built.precision.compute))
    # The run's length is decided here (train.epochs counted on the data, or kept from the checkpoint): from here on
    # cfg.train.max_steps is that count.
    cfg, state = resume(ckpt, built, cfg, env, resume_from, elastic=stop.elastic, train_samples=train_data.num_windows)
    schedule = LRSchedule.from_config(cfg.train)
    if env.is_main:
        log.info("lr schedule: %s", schedule.describe())
    if state.step < cfg.train.resolved_max_steps:  # a finished run started again trains nothing and writes nothing
        ckpt.prepare_saving()
        if env.is_main:  # only now: a refused resume, or a run that cannot save, leaves the output directory as it was
            write_run_files(cfg, tokenizer=prepared.tokenizer_path, built=built, step=state.step,
                            resumed=ckpt.loaded[0] if ckpt.loaded else None)
    return Run(cfg, env, train_data, val_data, built, schedule, ckpt, state, downstream, flops_per_token,
               masked_targets=cfg.data.format == "chat")


# ==== the training loop ==========================================================================================


def train(run: Run, stop: StopSignal) -> dict:
    """Train from the resumed step to train.max_steps, or to a stop signal; returns the last logged row."""
    cfg, env, t, state = run.cfg, run.env, run.cfg.train, run.state
    max_steps = t.resolved_max_steps  # given, or train.epochs counted on the data (set_up)
    if state.step >= max_steps:  # a finished run started again
        run.ckpt.close()
        if env.is_main:
            log.info("%s", nothing_to_train(cfg, state.step, epochs=state.epochs))
        return {}
    observers = Observers(cfg, env, first_step=state.step, flops_per_token=run.flops_per_token, probe=run.built.probe)
    guard = OutOfMemoryGuard(env, fsdp=run.built.fsdp, probe=run.built.probe, retry=t.oom_retry_half,
                             timeout_s=cfg.run.timeout_s, compile=t.compile, on_oom=observers.memory.on_oom)
    batches = TrainBatches(run.train_data, env, run.built.split, first_step=state.step,
                           samples_seen=state.samples_seen, max_steps=max_steps)
    bad_steps = BadSteps(t.max_bad_steps)

    def guarded(work: Callable[[], T], *, phase: str, step: int) -> T:
        """work() under the out-of-memory guard: after a retry at half the micro-batch, done again at that size."""
        return guard.run(work, step=step, phase=phase, split=lambda: batches.split, model=run.model,
                         optimizer=run.optimizer, resplit=lambda split: batches.resplit(
                             split, step=state.step, samples_seen=state.samples_seen))

    def step(lr: float) -> StepResult:
        """grad_accum micro-batches of this rank's share of the global batch, one optimizer step at `lr`."""
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        return guarded(lambda: train_step(run.model, run.optimizer, batches, fsdp=run.built.fsdp,
                                          grad_accum=batches.split.grad_accum, grad_clip=t.grad_clip,
                                          world_size=env.world_size, scaler=run.built.scaler,
                                          stop_requested=stop.requested, masked_targets=run.masked_targets,
                                          skipper=run.built.skipper),
                       phase="training", step=state.step + 1)

    def evaluate_all() -> None:
        """The validation loss and train.eval_tasks, logged together; their time is left out of tokens/s."""
        started = time.perf_counter()
        micro_batch = batches.split.micro_batch_size
        row = {"val_loss": guarded(lambda: evaluate(run.model, run.val_data, num_samples=t.eval_samples,
                                                    micro_batch=micro_batch, env=env),
                                   phase="evaluation", step=state.step)}
        if (downstream := run.downstream) is not None:
            row |= guarded(lambda: downstream.run(run.model, batch_size=micro_batch),
                           phase="downstream evaluation", step=state.step)
        observers.on_eval(state.step, row, seconds=time.perf_counter() - started)

    try:
        run.model.train()
        while state.step < max_steps:
            state.lr = lr = run.schedule(state.step)  # the schedule's learning rate for this step
            result = step(lr)  # -- batch and step
            bad_steps.check(result, step=state.step + 1)  # a non-finite step: its update skipped, or the run stops
            state.advance(samples=t.global_batch_size, tokens=t.global_batch_size * cfg.data.seq_len)
            observers.on_step(state.step, result, lr=lr, split=batches.split)  # -- log
            if t.eval_interval and (state.step % t.eval_interval == 0 or state.step == max_steps):
                evaluate_all()  # -- evaluate: every train.eval_interval steps and at the last
            # -- save: the manager decides (its interval, a save in flight to commit, a stop, the last step)
            run.ckpt.on_step_end(stopping=result.stop_requested, last=state.step == max_steps)
            observers.on_step_end(state.step)  # the profiler: a profiled step's range holds its log, eval and save
            if result.stop_requested:  # -- stop: a signal (Ctrl-C, preemption, an elastic job's nodes), saved above
                run.restarting = after_stop(stop, env, step=state.step)
                break
        run.ckpt.finish()  # a clean end waits for the save in flight
    finally:
        run.ckpt.close()
        batches.close()
        observers.close()
    return observers.last_row


# ==== the run, from the command line to the end ==================================================================


@record  # an uncaught error lands in torchrun's error file, reported with its rank
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    prefer_expandable_segments()  # before anything touches the GPU
    launch = read_launch()
    # Every problem with the config and the launch is found before any process group starts.
    unfit: list[str] = []
    try:
        cfg = load_config(args.config, overrides)  # the config's own checks
        problems = launch_checks(cfg, launch, args.resume_from, any_world=args.check)  # then the launch's
        if launch.elastic:  # a world size that cannot hold the batch waits for the next (fsdp_utils/guards/elastic.py)
            unfit = unfit_world(cfg.train, launch.world_size)
            problems = [p for p in problems if p not in unfit]
    except ConfigError as err:
        problems = err.problems
    if problems:
        return exit_early(problems, launch)
    if args.check:
        return check_passed(cfg, launch)

    stop = StopSignal(cfg.run.stop_signals, grace_s=cfg.run.preemption_grace_s,  # Ctrl-C from here on saves
                      elastic=launch.elastic)
    env = init_distributed(device=cfg.run.device, timeout_s=cfg.run.timeout_s)
    lock, run = None, None
    try:
        setup_logging(env)
        if unfit:
            return wait_for_membership_change(cfg.train, env, stop)
        lock = take_run_lock(cfg.output_dir, env)  # before anything is written into the output directory
        run = set_up(cfg, env, stop=stop, resume_from=args.resume_from)
        train(run, stop)
        return RESTART_EXIT_CODE if run.restarting else 0
    except RunLocked as err:
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 2
    except USER_ERRORS as err:
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a file this rank could not write (a full disk): said by the rank that met it
        print(f"error: rank {env.rank}: {err}", file=sys.stderr)
        return 1
    finally:
        destroy_distributed()
        if lock is not None:  # a run that trained no step leaves no output directory it made
            lock.release(discard=run is None or run.state.step == 0)


if __name__ == "__main__":
    sys.exit(main())
