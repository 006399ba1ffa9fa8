"""What watches a training run from outside its step, one call per step each: the metrics log with the experiment
trackers (rank 0's), the step profiler, the CUDA memory snapshots, and after the first steps the hint for a run that
leaves most of the GPU's memory unused."""
from __future__ import annotations

import logging

from config import Config

from ..distributed import DistEnv
from ..observability.metrics import TrainingLog
from ..observability.peak_flops import resolve_peak_flops
from ..observability.profiling import MemorySnapshots, StepProfiler
from ..observability.trackers import open_trackers
from .batch import BatchSplit
from .memory import MemoryProbe
from .oom_guard import memory_hint
from .step import StepResult

log = logging.getLogger("train")


class Observers:
    """Made by every rank for a loop that starts after step `first_step`; rank 0 alone writes the log's files."""

    def __init__(self, cfg: Config, env: DistEnv, *, first_step: int, flops_per_token: float,
                 probe: MemoryProbe | None):
        lg, t = cfg.logging, cfg.train
        self.env, self.probe, self.first_step = env, probe, first_step
        self.hint = t.micro_batch_size != "auto"  # the search sized the micro-batch already
        self.memory = MemorySnapshots(lg, cfg.output_dir, rank=env.rank, device=env.device)
        self.profiler = StepProfiler(lg, cfg.output_dir, rank=env.rank, device=env.device, first_step=first_step)
        peak_flops, peak_note = resolve_peak_flops(env.device, override_flops=lg.peak_override_flops)
        if env.is_main:
            log.info("%s", peak_note)
        trackers = open_trackers(cfg, resumed=first_step > 0) if env.is_main else []
        self.log = TrainingLog(lg, cfg.output_dir if env.is_main else None, max_steps=t.resolved_max_steps,
                               first_step=first_step, tokens_per_step=t.global_batch_size * cfg.data.seq_len,
                               world_size=env.world_size, flops_per_token=flops_per_token, device=env.device,
                               peak_flops=peak_flops, trackers=trackers, compiling=t.compile)

    def on_step(self, step: int, result: StepResult, *, lr: float, split: BatchSplit) -> None:
        """After the optimizer step `step`: the memory history, a spike-skipped step's warning, the log line and the
        metrics row."""
        if step == self.first_step + 2 and self.hint:
            hint = memory_hint(self.probe, self.env, micro_batch=split.micro_batch_size, grad_accum=split.grad_accum)
            if hint and self.env.is_main:
                log.info("%s", hint)
        self.memory.on_step_end(step)
        if result.skipped and self.env.is_main:
            log.warning("step %d: update skipped (train.skip_spikes): %s; %d steps skipped so far", step,
                        result.skip_reason, result.skipped_steps)
        self.log.on_step(step, loss=result.loss, lr=lr, grad_norm=result.grad_norm, skipped=result.skipped,
                         skipped_steps=result.skipped_steps)

    def on_eval(self, step: int, row: dict, *, seconds: float) -> None:
        self.log.on_eval(step, row, seconds=seconds)

    def on_step_end(self, step: int) -> None:
        """After the step's log, evaluation and save: a profiled step's range holds them all."""
        self.profiler.on_step_end(step)

    @property
    def last_row(self) -> dict:
        return self.log.last_row

    def close(self) -> None:
        self.profiler.close()
        self.memory.close()
        self.log.close()
