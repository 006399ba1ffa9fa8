"""Throughput, MFU and memory figures, and the writers for metrics.jsonl and TensorBoard (rank 0 only)."""
from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("train")

# Dense bf16 peak FLOP/s per GPU, by the vendors' datasheets (SXM parts).
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


def detect_peak_flops(device: torch.device, override: float = 0.0) -> float | None:
    """Peak bf16 FLOP/s of this GPU, or None when unknown (CPU, or a GPU not in the table)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by this process, or on the CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def scalar_tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key: val/loss, eval/<task>/<metric> as it is, else train/<key>."""
    if key == "val_loss":
        return "val/loss"
    return key if key.startswith("eval/") else f"train/{key}"


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, output_dir: Path, *, tensorboard: bool):
        self.path = output_dir / "metrics.jsonl"
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(output_dir / "tensorboard"))

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(scalar_tag(key), value, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class TrainingLog:
    """Decides for itself when a step is logged (every logging.interval steps and the last): the log line
    (ending with the elapsed time and an ETA to max_steps), tokens/s per GPU, MFU, peak memory, and the row
    in metrics.jsonl and TensorBoard (rank 0 writes). Validation losses go the same way."""

    def __init__(self, output_dir: Path | None, *, interval: int, max_steps: int, first_step: int, tokens_per_step: int,
                 world_size: int, flops_per_token: float, peak_flops: float | None, device: torch.device,
                 tensorboard: bool):
        self.interval, self.max_steps, self.device = interval, max_steps, device
        self.tokens_per_gpu_step = tokens_per_step / world_size
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.writer = MetricsWriter(output_dir, tensorboard=tensorboard) if output_dir is not None else None
        self.start = self.last_time = time.perf_counter()
        self.last_step = first_step
        self.last_row: dict = {}

    def on_step(self, step: int, *, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> None:
        if step % self.interval and step != self.max_steps:
            return
        now = time.perf_counter()
        step_time = (now - self.last_time) / (step - self.last_step)
        tok_per_gpu = self.tokens_per_gpu_step / step_time
        mfu = self.flops_per_token * tok_per_gpu / self.peak_flops if self.peak_flops else None
        row = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
               "tokens_per_sec_per_gpu": tok_per_gpu, "mfu": mfu, "peak_mem_gib": peak_memory_gib(self.device)}
        self.last_row = row
        if self.writer is not None:
            log.info("step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s/gpu | mfu %s | mem %.2f GiB | "
                     "elapsed %s | eta %s", step, self.max_steps, row["loss"], lr, row["grad_norm"],
                     f"{tok_per_gpu:,.0f}",
                     f"{100 * mfu:.1f}%" if mfu is not None else "n/a", row["peak_mem_gib"],
                     format_duration(now - self.start), format_duration(step_time * (self.max_steps - step)))
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

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
