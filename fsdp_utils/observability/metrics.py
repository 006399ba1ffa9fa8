"""Throughput, MFU and memory figures, and the writer of metrics.jsonl that forwards every row to the
experiment trackers (rank 0 only)."""
from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from safe_io.nofollow import open_append

from .peak_flops import resolve_peak_flops
from .trackers import Tracker, scalars

if TYPE_CHECKING:
    from config import LoggingConfig

log = logging.getLogger("train")
METRICS_NAME = "metrics.jsonl"


def detect_peak_flops(device: torch.device, override: float = 0.0) -> float | None:
    """Dense bf16 peak FLOP/s of this GPU (peak_flops.GPU_PEAKS), the override when positive, or None when
    unknown (the CPU, or a GPU not in the table)."""
    return resolve_peak_flops(device, override_flops=override)[0]


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by this process, or on the CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsWriter:
    """Appends one JSON object per logged row to metrics.jsonl and hands its finite numbers to every tracker,
    so any metric written here (training, validation, an evaluation's accuracy) reaches all of them."""

    def __init__(self, output_dir: Path, *, trackers: Sequence[Tracker] = ()):
        self.path = output_dir / METRICS_NAME
        # Never through a link, a FIFO or a device at that name; a file with other hard links (a copied run folder)
        # gets a copy of its own, which this run goes on in: the other names keep the rows they had.
        self.file = open_append(self.path, copy_if_shared=True)
        self.trackers = list(trackers)

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        metrics = scalars(row)
        if metrics:
            for tracker in self.trackers:
                tracker.log_metrics(metrics, row["step"])

    def close(self) -> None:
        self.file.close()
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as err:  # one tracker's failure to close must not hide the others' or the run's
                log.warning("closing the %s tracker failed: %s", tracker.name, err)


class TrainingLog:
    """Decides for itself when a step is logged (every logging.interval steps and the last): the log line
    (ending with the elapsed time and an ETA to max_steps), tokens/s per GPU, MFU, peak memory, and the row
    in metrics.jsonl and every tracker (rank 0 writes). Validation losses and any other metrics
    (`log_metrics`) go the same way."""

    def __init__(self, section: LoggingConfig, output_dir: Path | None, *, max_steps: int, first_step: int,
                 tokens_per_step: int, world_size: int, flops_per_token: float, peak_flops: float | None,
                 device: torch.device, trackers: Sequence[Tracker] = (), compiling: bool = False):
        """section: logging.interval; output_dir: None on the ranks that do not write (all but rank 0); compiling:
        the loop's first step compiles the model (train.compile)."""
        self.interval, self.max_steps, self.device = section.interval, max_steps, device
        self.tokens_per_gpu_step = tokens_per_step / world_size
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.writer = MetricsWriter(output_dir, trackers=trackers) if output_dir is not None else None
        self.start = self.last_time = time.perf_counter()
        self.last_step = first_step
        self.last_row: dict = {}
        self.compiling = compiling
        if compiling and self.writer is not None:
            log.info("compiling: the first step compiles the model (train.compile), which can take minutes; its time "
                     "is left out of tokens/s and the ETA")

    def on_step(self, step: int, *, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor, skipped: bool = False,
                skipped_steps: int | None = None) -> None:
        """`skipped`: the spike skipper held this step's update back (its row is written whatever the interval, with
        skipped: true); `skipped_steps`: the run's count of those so far, in every row (None: no spike skipping)."""
        now = time.perf_counter()
        if self.compiling:  # the rates count from the end of the step that compiled
            self.compiling = False
            if self.writer is not None:
                log.info("compiled in %.1f s (step %d, with its compute)", now - self.last_time, step)
            self.last_time, self.last_step = now, step
        if step % self.interval and step != self.max_steps and not skipped:
            return
        # Seconds per step since the last logged one; none right after the step that compiled.
        step_time = (now - self.last_time) / (step - self.last_step) if step > self.last_step else None
        tok_per_gpu = self.tokens_per_gpu_step / step_time if step_time else None
        mfu = self.flops_per_token * tok_per_gpu / self.peak_flops if self.peak_flops and tok_per_gpu else None
        row = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
               "tokens_per_sec_per_gpu": tok_per_gpu, "mfu": mfu, "peak_mem_gib": peak_memory_gib(self.device)}
        if skipped:
            row["skipped"] = True
        if skipped_steps is not None:
            row["skipped_steps"] = skipped_steps
        self.last_row = row
        if self.writer is not None:
            log.info("step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s/gpu | mfu %s | mem %.2f GiB | "
                     "elapsed %s | eta %s", step, self.max_steps, row["loss"], lr, row["grad_norm"],
                     f"{tok_per_gpu:,.0f}" if tok_per_gpu else "n/a",
                     f"{100 * mfu:.1f}%" if mfu is not None else "n/a", row["peak_mem_gib"],
                     format_duration(now - self.start),
                     format_duration(step_time * (self.max_steps - step)) if step_time is not None else "n/a")
            self.writer.write(row)
        self.last_time, self.last_step = time.perf_counter(), step

    def on_eval(self, step: int, metrics: dict, *, seconds: float = 0.0) -> None:
        """metrics: val_loss, and the eval/<task>/<metric> scores of train.eval_tasks with downstream_time_s.
        The evaluation's `seconds` are not training time: the next throughput figure leaves them out."""
        row = {"step": step, **metrics, "eval_time_s": seconds}
        self.last_row |= metrics
        self.last_time += seconds
        if self.writer is not None:
            scores = "".join(f" | {key.removeprefix('eval/')} {value:.4f}" for key, value in metrics.items()
                             if key.startswith("eval/"))
            log.info("step %d | val_loss %.4f%s | evaluated in %.1f s", step, metrics["val_loss"], scores, seconds)
            self.writer.write(row)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """A row of other metrics at this step (every rank calls it, rank 0 writes): metrics.jsonl, the log
        line and every tracker; keys with a '/' keep their name in the trackers, e.g. 'eval/arc_easy_acc'."""
        self.last_row.update(metrics)
        if self.writer is not None:
            log.info("step %d | %s", step, " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in metrics.items()))
            self.writer.write({"step": step, **metrics})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
