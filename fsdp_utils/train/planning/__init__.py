"""Planning a run before renting GPUs: peak memory per GPU (broken down) and tokens/s per GPU of each plan
(activation checkpointing x micro-batch x sharding) of a config on a cluster, from the config alone, calibrated on
our records (docs/planning.md). No GPU, no model built.

    cluster = Cluster(gpu_spec("h200"), gpus=2)
    planning = plan_cluster(load_config("config/train8B_fsdp.yaml", ["--model.vocab_size=128256"]), cluster)
    planning.fastest.plan, planning.fastest.memory.reserved, planning.fastest.speed.tokens_per_s

One plan alone: estimate(model_shape(cfg), cluster, plan_from(cfg, gpus=2, micro_batch=8, checkpointing="none"),
settings_from(cfg)). The pieces: hardware.py (GPUs, links), shape.py (the model's sizes), plan.py (cluster, plan,
settings), memory.py and speed.py (the two models), calibration.py (their constants), planner.py (the candidates),
points.py (our measured points), report.py (what scripts/plan.py prints). In a run: train_fsdp.py --check and the
start-up log print launch_line; the micro-batch search measures its pairs in the order of config_estimates."""
from .calibration import CALIBRATION, KNOWN_MISSES, VALUES, Constant
from .hardware import GPUS, GPUSpec, gpu_for_device, gpu_spec
from .memory import Memory, estimate_memory
from .plan import Cluster, Plan, Settings, plan_from, settings_from
from .planner import (
    Estimate,
    Planning,
    budget_gib,
    candidate_plans,
    config_estimates,
    config_plans,
    estimate,
    launch_estimate,
    plan_cluster,
    plan_problems,
)
from .points import MeasuredPoint, Prediction, load_points, predict, skipped_runs
from .report import (
    calibration_summary,
    describe_cluster,
    launch_line,
    markdown_table,
    one_line,
    plan_table,
    prediction_table,
)
from .shape import ModelShape, model_shape
from .speed import Speed, estimate_speed

__all__ = ["CALIBRATION", "GPUS", "KNOWN_MISSES", "VALUES", "Cluster", "Constant", "Estimate", "GPUSpec",
           "MeasuredPoint", "Memory", "ModelShape", "Plan", "Planning", "Prediction", "Settings", "Speed",
           "budget_gib", "calibration_summary", "candidate_plans", "config_estimates", "config_plans",
           "describe_cluster", "estimate", "estimate_memory", "estimate_speed", "gpu_for_device", "gpu_spec",
           "launch_estimate", "launch_line", "load_points", "markdown_table", "model_shape", "one_line",
           "plan_cluster", "plan_from", "plan_problems", "plan_table", "predict", "prediction_table", "settings_from",
           "skipped_runs"]
