"""Throughput, MFU and memory figures, and the writers for metrics.jsonl and TensorBoard (rank 0 only)."""
from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

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
                    self.tb.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", value, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
