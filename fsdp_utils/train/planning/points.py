"""The measured points of our records (measured_points.json: each a run of a record in benchmarks/records/, its config
and plan, its peak memory and tokens/s per GPU), the estimate of each, and the calibration error over them."""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from config import load_config

from .calibration import KNOWN_MISSES, VALUES
from .hardware import gpu_spec
from .memory import Memory, estimate_memory
from .plan import Cluster, Plan, Settings, settings_from
from .shape import ModelShape, model_shape
from .speed import Speed, estimate_speed

POINTS_FILE = Path(__file__).with_name("measured_points.json")
ROOT = Path(__file__).resolve().parents[3]
MEMORY_TOLERANCE, SPEED_TOLERANCE = 0.10, 0.15


@dataclass(frozen=True)
class MeasuredPoint:
    id: str
    record: str
    config: str
    gpus: int
    gpu: str
    micro_batch: int
    grad_accum: int
    checkpointing: str
    overrides: tuple[str, ...] = ()
    mem_gib: float | None = None
    memory: str = "allocated"
    """allocated (torch.cuda.max_memory_allocated: the benchmark, the training log) or reserved (the micro-batch
    search's trials)."""
    tokens_per_s: float | None = None
    recomputes: tuple[str, ...] | None = None
    flex_without_boundaries: bool = False
    fixed_segments: bool = False
    note: str = ""


@dataclass(frozen=True)
class Prediction:
    point: MeasuredPoint
    memory: Memory
    speed: Speed
    known_miss: str | None = field(default=None)

    @property
    def predicted_gib(self) -> float:
        return self.memory.reserved if self.point.memory == "reserved" else self.memory.allocated

    @property
    def memory_error(self) -> float | None:
        """(predicted - measured) / measured, or None without a measured figure."""
        return None if self.point.mem_gib is None else self.predicted_gib / self.point.mem_gib - 1

    @property
    def speed_error(self) -> float | None:
        return None if self.point.tokens_per_s is None else self.speed.tokens_per_s / self.point.tokens_per_s - 1

    @property
    def misses(self) -> bool:
        """Whether a figure is outside the targets (memory within 10%, tokens/s within 15%)."""
        mem, speed = self.memory_error, self.speed_error
        return (mem is not None and abs(mem) > MEMORY_TOLERANCE) or (speed is not None and abs(speed) > SPEED_TOLERANCE)


def load_points(path: Path = POINTS_FILE) -> list[MeasuredPoint]:
    """The measured points of our records."""
    data = json.loads(path.read_text())
    return [MeasuredPoint(**{**p, "overrides": tuple(p.get("overrides", ())),
                             "recomputes": tuple(p["recomputes"]) if "recomputes" in p else None})
            for p in data["points"]]


def skipped_runs(path: Path = POINTS_FILE) -> list[dict]:
    """The runs of the records that are not points, each with why."""
    return json.loads(path.read_text())["skipped"]


@functools.cache
def _run(config: str, overrides: tuple[str, ...]) -> tuple[ModelShape, Settings, str, int, int]:
    """(shape, settings, sharding strategy, shard group, FSDP version) of a config and its overrides."""
    cfg = load_config(ROOT / config, list(overrides))
    f = cfg.fsdp
    return model_shape(cfg), settings_from(cfg), f.sharding_strategy, f.hybrid_shard_group_size, f.version


def prepare(point: MeasuredPoint) -> tuple[ModelShape, Cluster, Plan, Settings]:
    """What the estimate of a measured point's run takes."""
    shape, settings, sharding, group, version = _run(point.config, point.overrides)
    settings = dataclasses.replace(settings, flex_without_boundaries=point.flex_without_boundaries,
                                   fixed_segments=point.fixed_segments)
    plan = Plan(point.checkpointing, point.micro_batch, point.grad_accum, sharding, group, version,
                frozenset(point.recomputes) if point.recomputes is not None else None)
    return shape, Cluster(gpu_spec(point.gpu), point.gpus), plan, settings


def predict(point: MeasuredPoint, calibration: Mapping[str, float] = VALUES) -> Prediction:
    """The estimate for a measured point's run."""
    shape, cluster, plan, settings = prepare(point)
    return Prediction(point, estimate_memory(shape, cluster, plan, settings, calibration),
                      estimate_speed(shape, cluster, plan, settings, calibration), KNOWN_MISSES.get(point.id))
