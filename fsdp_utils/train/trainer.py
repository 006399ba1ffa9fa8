"""The Trainer: one training run, set up from the config in the documented order (data, model, parallelize,
optimizer, micro-batch, resume, the save preconditions), then `fit()`: the loop of `train_step` and one call
per component per step (the log, evaluation, the checkpoint manager), each deciding for itself.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from config import Config, ConfigError, config_warnings, save_config, summarize_config
from data import BatchPrefetcher, open_datasets
from data.store import tokenizer_sha256
from data.tokenizer import prepared_eos_id
from model.loss import IGNORE_INDEX

from ..checkpoint import CheckpointManager, CheckpointMismatch, TrainState
from ..checkpoint.io import install_tokenizer
from ..distributed import DistEnv, agree
from ..parallel.build import describe_model, log_parameter_summary
from ..parallel.lora import lora_record
from ..parallel.parallelize import describe_sharding
from .build_run import build_run
from .downstream import DownstreamError, DownstreamEvaluator
from .metrics import TrainingLog
from .microbatch import describe_choice, save_to_cache
from .oom_guard import OutOfMemoryGuard, memory_hint
from .optim import LRSchedule
from .peak_flops import resolve_peak_flops
from .preemption import StopSignal
from .profiling import MemorySnapshots, StepProfiler
from .run_data import prepare_dataset
from .step import StepResult, train_step
from .trackers import open_trackers

log = logging.getLogger("train")
T = TypeVar("T")


class NonFiniteError(RuntimeError):
    """The loss or gradient norm stopped being finite."""


@torch.no_grad()
def evaluate(model, val_data, *, num_samples: int, micro_batch: int, env: DistEnv) -> float:
    """Mean validation loss per trained target over the first num_samples sequences of the validation set: their
    summed loss over the number of their targets that are not IGNORE_INDEX, so the same sequences give the same
    loss at any micro-batch and world size. Rank r takes micro-batches r, r + W, ...; every rank runs the same
    number of forward passes (FSDP needs them all), rows past num_samples (the end of a last, partial micro-batch,
    or a whole one for a rank past the end) have every target IGNORE_INDEX: computed, never counted."""
    model.eval()
    try:
        num_batches = -(-num_samples // micro_batch)
        total = torch.zeros(2, dtype=torch.float64, device=env.device)  # summed loss, trained targets
        for first in range(0, num_batches, env.world_size):
            k = first + env.rank
            start = min(k, num_batches - 1) * micro_batch
            x, y = val_data.batch(start, micro_batch)
            y[max(0, num_samples - start) if k < num_batches else 0:] = IGNORE_INDEX
            x, y = x.to(env.device), y.to(env.device)
            loss = model(x, y, loss_reduction="sum").double()
            total += torch.stack([loss, (y != IGNORE_INDEX).sum().double()])
        dist.all_reduce(total)
    finally:
        model.train()
    return total[0].item() / max(total[1].item(), 1.0)


class Trainer:
    """Every rank builds one and calls `fit()`; rank 0 alone prints and writes the run's files."""

    def __init__(self, cfg: Config, env: DistEnv, *, stop: StopSignal, resume_from: str | None = None):
        self.cfg, self.env, self.stop = cfg, env, stop
        torch.manual_seed(cfg.run.seed)
        self._setup_data()
        self.downstream = self._setup_downstream()
        self._setup_model()  # before any resume: the micro-batch search's trial steps need the optimizer state empty
        self.schedule = LRSchedule.from_config(cfg.train)
        if env.is_main:
            log.info("lr schedule: %s", self.schedule.describe())
        self.state = self._resume(resume_from)
        if self.state.step > cfg.train.max_steps:  # a shorter run than the one already there: nothing is written
            self.ckpt.close()
            raise CheckpointMismatch(self._nothing_to_train())
        self._write_run_files()
        self.ckpt.prepare_saving(self.model, self.optimizer)  # a run that cannot save stops now, not at its first save
        self.num_bad_steps = 0
        self.lr = cfg.train.lr
        self.restarting = False  # stopped by torchrun to restart the workers (fsdp_utils/train/preemption.py)
        # Made by fit(): the batches at the current split, the out-of-memory guard, the log, the profilers.
        self.batches: BatchPrefetcher
        self.oom: OutOfMemoryGuard
        self.log: TrainingLog
        self.profiler: StepProfiler
        self.memory: MemorySnapshots

    # ---- setup -----------------------------------------------------------------------------------
    def _setup_data(self) -> None:
        cfg = self.cfg
        sources = prepare_dataset(cfg, self.env, self.stop)
        self.prepared = sources[0][0]  # the tokenizer and vocabulary (every source of a mixture shares them)
        self.vocab_size, self.model_signature, self.flops_per_token = describe_model(cfg, self.prepared.vocab_size)
        if self.vocab_size < self.prepared.vocab_size:
            raise ConfigError([f"the model's vocabulary ({self.vocab_size}) is smaller than the tokenizer's "
                               f"({self.prepared.vocab_size})"])
        self.train_data, self.val_data = open_datasets(sources, seq_len=cfg.data.seq_len, seed=cfg.run.seed)
        # The token that separates documents, for the model's document masking and restarting positions.
        needs_eos = cfg.data.document_masking or cfg.model.reset_positions
        self.eos_id = prepared_eos_id(self.prepared.tokenizer_path) if needs_eos else None
        # Fine-tuning data: the targets outside the assistant's turns are IGNORE_INDEX.
        self.masked_targets = cfg.data.format == "chat"

    def _setup_downstream(self) -> DownstreamEvaluator | None:
        """train.eval_tasks' tasks loaded now, so that one that cannot load stops the run before step 1."""
        t = self.cfg.train
        if not t.eval_tasks:
            return None
        evaluator, error = None, None
        try:
            evaluator = DownstreamEvaluator(t, tokenizer_kind=self.cfg.data.tokenizer,
                                            tokenizer_path=self.prepared.tokenizer_path,
                                            max_length=self.cfg.data.seq_len, env=self.env)
        except DownstreamError as err:
            error = err
        agree(self.env, error)  # a rank that could not load them must not leave the others waiting in a collective
        return evaluator

    def _setup_model(self) -> None:
        """The model, its optimizer and the micro-batch plan (build_run), then the checkpoint manager."""
        cfg, env = self.cfg, self.env
        if env.is_main:
            for line in summarize_config(cfg):
                log.info("%s", line)
            for line in config_warnings(cfg):
                log.warning("%s", line)
            if cfg.model.type == "llama":  # a Hugging Face model's line comes from build_model, which counts it
                log_parameter_summary(cfg.model)
        run = build_run(cfg, env, vocab_size=self.vocab_size, model_signature=self.model_signature, eos_id=self.eos_id)
        self.model, self.optimizer, self.converters, self.scaler = run.model, run.optimizer, run.converters, run.scaler
        self.precision, self.checkpoint_switch, self.probe = run.precision, run.checkpoint_switch, run.probe
        self.cache_key, self.choice, self.split = run.cache_key, run.choice, run.split
        for line in describe_choice(self.choice, cfg, world_size=env.world_size):
            log.info("%s", line)
        self.ckpt = CheckpointManager(cfg.checkpoint, cfg.output_dir, env=env, model_config=self.model_signature,
                                      timeout_s=cfg.run.timeout_s,
                                      tokenizer_sha256=tokenizer_sha256(self.prepared.tokenizer_path),
                                      lora=lora_record(cfg, self.model_signature, base_dtype=self.precision.compute))
        if env.is_main:
            self._log_trainable()
            self._log_plan()

    def _log_trainable(self) -> None:
        lora = self.cfg.train.lora
        if lora.rank <= 0:
            return
        # Counted over this rank's shards, so the share is the model's whatever the sharding.
        sizes = [(p.numel(), p.requires_grad) for p in self.model.parameters()]
        trainable, total = sum(n for n, g in sizes if g), sum(n for n, _ in sizes)
        log.info("LoRA rank %d, alpha %g on %s: %.3f%% of the parameters train (%s of %s on this rank), the base is "
                 "frozen in %s", lora.rank, lora.alpha, ", ".join(lora.targets), 100 * trainable / max(total, 1),
                 f"{trainable:,}", f"{total:,}", str(self.precision.compute).replace("torch.", ""))

    def _log_plan(self) -> None:
        cfg, env, p = self.cfg, self.env, self.precision
        ac = self.checkpoint_switch.policy.name if self.checkpoint_switch else cfg.fsdp.activation_checkpointing
        log.info("world size %d on %s, precision %s (reduce %s), FSDP%d %s, grad accumulation %d, micro-batch %d, "
                 "activation checkpointing %s, train %s tokens, val %s tokens", env.world_size, env.device.type,
                 p.name, str(p.reduce).replace("torch.", ""), cfg.fsdp.version, describe_sharding(cfg.fsdp, env),
                 self.split.grad_accum, self.split.micro_batch_size, ac, f"{self.train_data.num_tokens:,}",
                 f"{self.val_data.num_tokens:,}")

    def _resume(self, resume_from: str | None) -> TrainState:
        out_dir = self.cfg.output_dir
        if resume_from is None and (existing := self.ckpt.complete_checkpoints()):
            # A fresh start would mix its checkpoints with these, and retention would delete them.
            if not self.cfg.checkpoint.auto_resume:
                raise CheckpointMismatch(f"{out_dir} already holds checkpoints of an earlier run (newest "
                                         f"{existing[0][1].name}); resume with --resume_from latest, or give this "
                                         "run another run.output_dir")
            resume_from = "latest"
            log.info("checkpoint.auto_resume: continuing from the newest complete checkpoint in %s", out_dir)
        if resume_from is None:
            if self.cfg.model.init_from:  # a resume (above) continues the run's own weights instead
                self.ckpt.load_weights(self.model, self.cfg.model.init_from)
                self._weights_loaded()
            return TrainState()
        state = self.ckpt.load(self.model, self.optimizer, resume_from)
        self._weights_loaded()
        if self.scaler is not None and state.grad_scaler:
            self.scaler.load_state_dict(state.grad_scaler)
        if self.env.is_main and state.step < self.cfg.train.max_steps:  # else fit() says there is nothing to train
            self._check_schedule_continues(state)
            self._log_world_change(state)
        return state

    def _weights_loaded(self) -> None:
        for converter in self.converters:  # the weights changed outside an optimizer step
            converter.refresh(self.model)

    def _log_world_change(self, state: TrainState) -> None:
        """Where an elastic job's restart, or a resume at another world size, continues from."""
        assert self.ckpt.loaded is not None, "called after a load"
        path, saved_world = self.ckpt.loaded
        if saved_world != self.env.world_size or self.stop.elastic:
            log.info("world %d -> %d at step %d: resumed from checkpoint %s", saved_world, self.env.world_size,
                     state.step, path)

    def _check_schedule_continues(self, state: TrainState) -> None:
        """Warn when the schedule, under this run's config, gives the last step taken another learning rate than
        the one it ran at: the curve jumps there (a changed train.lr, warmup, schedule or train.max_steps; for wsd,
        a larger max_steps after the decay had begun takes the run back up to its stable phase)."""
        s = self.schedule
        if state.lr is None or state.step == 0:
            return  # saved before checkpoints recorded the learning rate
        now = s(state.step - 1)
        if math.isclose(now, state.lr, rel_tol=1e-9, abs_tol=0.0):
            return
        msg = (f"the schedule does not continue the checkpoint's: step {state.step} ran at lr {state.lr:.6g}, which "
               f"this run's train.* settings give as {now:.6g}, so the learning rate jumps")
        if s.kind == "wsd" and state.lr < s.max_lr and now > state.lr and state.step <= s.decay_start:
            msg += (f". The checkpoint was taken during its WSD decay; with train.max_steps={s.max_steps} the decay "
                    f"begins after step {s.decay_start}, so the run goes back to its stable phase. To finish the "
                    f"decay, resume with the train.max_steps it was saved under; to extend a WSD run, resume from a "
                    f"checkpoint taken before its decay began")
        log.warning("%s", msg)

    def _write_run_files(self) -> None:
        """Only now, after a resume, so that a refused resume leaves the output directory as it was."""
        if not self.env.is_main:
            return
        out_dir = self.cfg.output_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, out_dir / "config.yaml")
        # The tokenizer travels with the run, so generate.py and export_hf.py find it next to the checkpoints.
        install_tokenizer(self.prepared.tokenizer_path, out_dir)
        if self.choice.how == "search":
            save_to_cache(out_dir, self.cache_key, self.choice)

    def _open_batches(self) -> BatchPrefetcher:
        """This rank's micro-batches from the current step on, at the current split."""
        indices = self.split.sample_indices(rank=self.env.rank, first_step=self.state.step,
                                            samples_seen=self.state.samples_seen, max_steps=self.cfg.train.max_steps)
        return BatchPrefetcher(self.train_data, indices, num_samples=self.split.micro_batch_size,
                               device=self.env.device)

    # ---- the step and the evaluation ---------------------------------------------------------------
    def _guarded(self, work: Callable[[], T], *, phase: str, step: int) -> T:
        """work() under the out-of-memory guard; after a recovered out-of-memory error (train.oom_retry_half)
        the micro-batch is smaller from then on and the work is done again: a training step on the same
        samples, an evaluation on the same sequences."""
        while True:
            result, split = self.oom.attempt(work, step=step, phase=phase, split=self.split, model=self.model,
                                             optimizer=self.optimizer)
            if split == self.split:
                return result  # type: ignore[return-value]  # work() ran to the end: a T, not None
            self.split = split
            self.batches.close()
            self.batches = self._open_batches()

    def train_step(self) -> StepResult:
        """One optimizer step at the schedule's learning rate (the step counters advance if it was applied)."""
        t, state = self.cfg.train, self.state
        self.lr = state.lr = self.schedule(state.step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

        def step() -> StepResult:
            return train_step(self.model, self.optimizer, self.batches, grad_accum=self.split.grad_accum,
                              grad_clip=t.grad_clip, world_size=self.env.world_size, scaler=self.scaler,
                              stop_requested=self.stop.requested, masked_targets=self.masked_targets)

        result = self._guarded(step, phase="training", step=state.step + 1)
        if not result.applied:
            self._skip_bad_step(result)
        state.step += 1
        state.samples_seen += t.global_batch_size
        state.tokens_seen += t.global_batch_size * self.cfg.data.seq_len
        return result

    def _skip_bad_step(self, result: StepResult) -> None:
        t = self.cfg.train
        self.num_bad_steps += 1
        msg = (f"non-finite loss ({result.loss.item()}) or gradient norm ({result.grad_norm.item()}) at step "
               f"{self.state.step + 1}")
        if self.num_bad_steps > t.max_bad_steps:
            raise NonFiniteError(f"{msg}; stopping before the optimizer step, no checkpoint written "
                                 f"(train.max_bad_steps={t.max_bad_steps} allows skipping such steps)")
        log.warning("%s: skipping the update (%d of train.max_bad_steps=%d)", msg, self.num_bad_steps, t.max_bad_steps)

    def evaluate(self) -> float:
        return self._guarded(lambda: evaluate(self.model, self.val_data, num_samples=self.cfg.train.eval_samples,
                                              micro_batch=self.split.micro_batch_size, env=self.env),
                             phase="evaluation", step=self.state.step)

    def evaluate_all(self) -> None:
        """The validation loss and train.eval_tasks, logged together; their time is left out of tokens/s."""
        started = time.perf_counter()
        row: dict = {"val_loss": self.evaluate()}
        if self.downstream is not None:
            downstream = self.downstream
            row |= self._guarded(lambda: downstream.run(self.model, batch_size=self.split.micro_batch_size),
                                 phase="downstream evaluation", step=self.state.step)
        self.log.on_eval(self.state.step, row, seconds=time.perf_counter() - started)

    # ---- the loop --------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to train.max_steps (or a stop signal), saving as checkpoint.* says; returns the last logged row."""
        env, t = self.env, self.cfg.train
        first_step = self.state.step
        if first_step >= t.max_steps:
            self.ckpt.close()
            if env.is_main:
                log.info("%s", self._nothing_to_train())
            return {}
        self._open_observers(first_step)
        self.batches = self._open_batches()
        try:
            self.model.train()
            while self.state.step < t.max_steps:
                result = self.train_step()
                if self.state.step == first_step + 2:
                    self._memory_hint()
                self.memory.on_step_end(self.state.step)
                self.log.on_step(self.state.step, loss=result.loss, lr=self.lr, grad_norm=result.grad_norm)
                if t.eval_interval and (self.state.step % t.eval_interval == 0 or self.state.step == t.max_steps):
                    self.evaluate_all()
                # The manager decides: commit a save in flight, save at its interval, on a stop, at the end.
                self.state.grad_scaler = self.scaler.state_dict() if self.scaler else None
                self.ckpt.on_step_end(self.model, self.optimizer, self.state, stopping=result.stop_requested,
                                      last=self.state.step == t.max_steps)
                self.profiler.on_step_end(self.state.step)  # a profiled step's range holds its log, eval and save
                if result.stop_requested:
                    self._say_stopped()
                    break
            self.ckpt.finish()  # a clean end waits for the save in flight
        finally:
            self.ckpt.close()
            self.batches.close()
            self.profiler.close()
            self.memory.close()
            self.log.close()
        return self.log.last_row

    def _say_stopped(self) -> None:
        """After the save of a stop: whether torchrun restarts the workers (any rank's SIGTERM in an elastic job,
        decided together), and the line that says so."""
        if self.stop.elastic:
            restart = torch.tensor([float(self.stop.restart)], device=self.env.device)
            dist.all_reduce(restart, op=dist.ReduceOp.MAX)
            self.restarting = restart.item() > 0
        if not self.env.is_main:
            return
        if self.restarting:
            log.info("stopped by torchrun at step %d after saving: the elastic job's nodes change, and the workers "
                     "restart from this checkpoint at the new world size", self.state.step)
        else:
            log.info("stopped by a signal at step %d after saving; rerun the same command to continue "
                     "(checkpoint.auto_resume), or pass --resume_from latest", self.state.step)

    def _nothing_to_train(self) -> str:
        """The line of a run resumed at or past train.max_steps: the same command after the run finished, or another
        run (a smoke run with a lowered train.max_steps) given the finished run's folder."""
        step, max_steps = self.state.step, self.cfg.train.max_steps
        found = [path for saved, path in self.ckpt.complete_checkpoints() if saved == step]
        where = f"checkpoint {found[0]}" if found else f"checkpoint of step {step}"
        afresh = (f"to start a new run, give it its own folder (--run.name=NAME, or run.output_dir; this one is "
                  f"{self.cfg.output_dir})")
        if step > max_steps:
            return (f"the run in {self.cfg.output_dir} already reached step {step} ({where}), past this command's "
                    f"train.max_steps={max_steps}: {afresh}; to continue that run, raise train.max_steps above {step}")
        return (f"nothing to train: the run already reached train.max_steps={max_steps} ({where}); raise "
                f"train.max_steps to continue, or {afresh}")

    def _open_observers(self, first_step: int) -> None:
        """The out-of-memory guard, the memory snapshots it dumps into, the profiler and the log with its
        trackers (rank 0's), for a loop that starts after step first_step."""
        cfg, env, t, lg = self.cfg, self.env, self.cfg.train, self.cfg.logging
        self.memory = MemorySnapshots(lg, cfg.output_dir, rank=env.rank, device=env.device)
        self.oom = OutOfMemoryGuard(env, probe=self.probe, retry=t.oom_retry_half, timeout_s=cfg.run.timeout_s,
                                    compile=t.compile, on_oom=self.memory.on_oom)
        self.profiler = StepProfiler(lg, cfg.output_dir, rank=env.rank, device=env.device, first_step=first_step)
        peak_flops, peak_note = resolve_peak_flops(env.device, override_flops=lg.peak_override_flops)
        if env.is_main:
            log.info("%s", peak_note)
        trackers = open_trackers(cfg, resumed=first_step > 0) if env.is_main else []
        self.log = TrainingLog(lg, cfg.output_dir if env.is_main else None, max_steps=t.max_steps,
                               first_step=first_step, tokens_per_step=t.global_batch_size * cfg.data.seq_len,
                               world_size=env.world_size, flops_per_token=self.flops_per_token, device=env.device,
                               peak_flops=peak_flops, trackers=trackers)

    def _memory_hint(self) -> None:
        if self.cfg.train.micro_batch_size == "auto":
            return
        hint = memory_hint(self.probe, self.env, micro_batch=self.split.micro_batch_size,
                           grad_accum=self.split.grad_accum)
        if hint and self.env.is_main:
            log.info("%s", hint)
