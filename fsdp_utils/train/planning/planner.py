"""The plans a config can run on a cluster, each estimated: the micro-batch search's candidates (its checkpointing
policies, each divisor of the per-GPU batch) under each sharding strategy that suits the cluster, which of them fit
the GPU's memory as the search's budget counts it, and the fastest of those."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from config import Config, ConfigError, check_batch_split
from config.checks import MUON_FSDP1_PROBLEM

from ...parallel.parallelize import CheckpointPolicy, auto_policies
from ..batch import divisors
from .calibration import VALUES
from .memory import Memory, estimate_memory
from .plan import Cluster, Plan, Settings, settings_from
from .shape import ModelShape, model_shape
from .speed import Speed, estimate_speed


@dataclass(frozen=True)
class Estimate:
    plan: Plan
    memory: Memory
    speed: Speed
    budget_gib: float
    """What the plan's reserved memory must stay under: the GPU's memory less what is outside the allocator, times
    1 - train.auto_micro_batch_margin (the micro-batch search's budget)."""

    @property
    def fits(self) -> bool:
        return self.memory.reserved <= self.budget_gib


def budget_gib(cluster: Cluster, s: Settings, c: Mapping[str, float] = VALUES) -> float:
    return (cluster.gpu.memory_gib - c["outside_allocator_gib"]) * (1 - s.margin)


def estimate(shape: ModelShape, cluster: Cluster, plan: Plan, s: Settings, c: Mapping[str, float] = VALUES) -> Estimate:
    """Memory and speed of one plan."""
    return Estimate(plan, estimate_memory(shape, cluster, plan, s, c), estimate_speed(shape, cluster, plan, s, c),
                    budget_gib(cluster, s, c))


def plan_problems(cfg: Config, cluster: Cluster) -> list[str]:
    """Why the estimate cannot plan this config on this cluster ([] when it can), one line each."""
    t, f = cfg.train, cfg.fsdp
    p = []
    if cfg.model.type != "llama":
        p.append("model.type=hf: the planner counts our decoder's parameters and activations (model.type=llama)")
    if t.lora.rank > 0:
        p.append("train.lora: the planner estimates training every weight; set train.lora.rank=0")
    if f.cpu_offload:
        p.append("fsdp.cpu_offload: the planner does not estimate host-offloaded training; set fsdp.cpu_offload=false")
    if t.optimizer == "muon" and f.version == 1:  # the config's checks refuse it; a Config built in code may not
        p.append(MUON_FSDP1_PROBLEM)
    if t.precision == "fp32":
        p.append("train.precision=fp32: the planner estimates bf16 or fp16 compute")
    if t.float8 != "none" and cluster.gpu.peak.fp8 is None:
        p.append(f"train.float8={t.float8} needs FP8 tensor cores, which the {cluster.gpu.name} lacks; set "
                 f"--train.float8=none")
    try:
        check_batch_split(dataclasses.replace(t, micro_batch_size="auto"), cluster.gpus)
    except ConfigError as err:
        p += err.problems
    return p


def sharding_options(cfg: Config, cluster: Cluster) -> list[tuple[str, int]]:
    """(strategy, HYBRID_SHARD's group) pairs worth estimating: FULL_SHARD and SHARD_GRAD_OP over all GPUs, NO_SHARD,
    and across several nodes HYBRID_SHARD within groups of a node, 2, 4, ... nodes, replicated across the groups."""
    if cluster.gpus == 1:  # every strategy runs alike on one GPU: the config's names it
        strategy = cfg.fsdp.sharding_strategy
        return [("FULL_SHARD" if strategy == "HYBRID_SHARD" else strategy, 0)]
    options = [("FULL_SHARD", 0), ("SHARD_GRAD_OP", 0), ("NO_SHARD", 0)]
    group = cluster.gpus_per_node
    while cluster.nodes > 1 and group < cluster.gpus and cluster.gpus % group == 0:
        options.append(("HYBRID_SHARD", group))
        group *= 2
    return options


def candidate_plans(cfg: Config, cluster: Cluster) -> list[Plan]:
    """Every plan to estimate: the micro-batch search's checkpointing policies (and the config's own, when it names
    one), each divisor of the per-GPU batch, each sharding option."""
    f = cfg.fsdp
    policies = [p.name for p in auto_policies(f.ac_every_n_layers)]
    if f.activation_checkpointing != "auto":
        own = _own_policy(cfg)
        policies += [own] if own not in policies else []
    per_gpu = cfg.train.global_batch_size // cluster.gpus
    return [Plan(policy, micro, per_gpu // micro, sharding, group, f.version)
            for sharding, group in sharding_options(cfg, cluster) for policy in policies for micro in divisors(per_gpu)]


def config_plans(cfg: Config, cluster: Cluster, *, policies: list[str] | None = None) -> list[Plan]:
    """The plans `cfg` runs on `cluster` as configured: its sharding, its checkpointing policy (with auto, each of
    `policies`, by default the search's), its micro-batch (with auto, each divisor of the per-GPU batch). ConfigError
    (config.check_batch_split's) where a micro-batch set by hand does not split the batch."""
    t, f = cfg.train, cfg.fsdp
    if f.activation_checkpointing != "auto":
        policies = [_own_policy(cfg)]
    elif policies is None:
        policies = [p.name for p in auto_policies(f.ac_every_n_layers)]
    per_gpu = t.global_batch_size // cluster.gpus
    sizes = divisors(per_gpu) if t.micro_batch_size == "auto" else [int(t.micro_batch_size)]
    splits = {micro: check_batch_split(t, cluster.gpus, micro_batch=micro) for micro in sizes}
    return [Plan(policy, micro, accumulation or 1, f.sharding_strategy, f.hybrid_shard_group_size, f.version)
            for policy in policies for micro, accumulation in splits.items()]


def _own_policy(cfg: Config) -> str:
    """The config's checkpointing policy (not auto) as a plan names it (selective carries its n)."""
    f = cfg.fsdp
    return CheckpointPolicy(f.activation_checkpointing,
                            f.ac_every_n_layers if f.activation_checkpointing == "selective" else 1).name


def config_estimates(cfg: Config, cluster: Cluster, *, policies: list[str] | None = None,
                     vocab_size: int | None = None) -> dict[tuple[str, int], Estimate]:
    """config_plans' plans (with auto, the micro-batch search's pairs of `policies` and micro-batches), each
    estimated, by (policy, micro-batch). ConfigError with plan_problems' lines when the planner cannot plan cfg."""
    problems = plan_problems(cfg, cluster)
    if problems:
        raise ConfigError(problems)
    shape, settings = model_shape(cfg, vocab_size), settings_from(cfg)
    return {(plan.checkpointing, plan.micro_batch): estimate(shape, cluster, plan, settings)
            for plan in config_plans(cfg, cluster, policies=policies)}


def launch_estimate(cfg: Config, cluster: Cluster, *, vocab_size: int | None = None) -> Estimate:
    """The estimate of the plan `cfg` runs on `cluster`; where it says auto, the fastest of the search's candidates
    that fits, or where none fits, the one of least memory. ConfigError as config_estimates'."""
    estimates = list(config_estimates(cfg, cluster, vocab_size=vocab_size).values())
    fitting = [e for e in estimates if e.fits]
    if fitting:
        return max(fitting, key=lambda e: e.speed.tokens_per_s)
    return min(estimates, key=lambda e: e.memory.reserved)


@dataclass(frozen=True)
class Planning:
    shape: ModelShape
    cluster: Cluster
    settings: Settings
    per_gpu_batch: int
    """Sequences each GPU trains a step (train.global_batch_size over the GPUs)."""
    estimates: list[Estimate]

    @property
    def fastest(self) -> Estimate | None:
        """The fitting plan with the most tokens/s, or None when none fits."""
        fitting = [e for e in self.estimates if e.fits]
        return max(fitting, key=lambda e: e.speed.tokens_per_s) if fitting else None

    def best_per_option(self) -> list[Estimate]:
        """For each sharding option and policy, its fastest fitting micro-batch, else its smallest (which does not
        fit); fastest first, the ones that fit before the ones that do not."""
        groups: dict[tuple[str, int, str], list[Estimate]] = {}
        for e in self.estimates:
            groups.setdefault((e.plan.sharding, e.plan.shard_group, e.plan.checkpointing), []).append(e)
        chosen = []
        for group in groups.values():
            fitting = [e for e in group if e.fits]
            chosen.append(max(fitting, key=lambda e: e.speed.tokens_per_s) if fitting
                          else min(group, key=lambda e: e.plan.micro_batch))
        return sorted(chosen, key=lambda e: (not e.fits, -e.speed.tokens_per_s))


def plan_cluster(cfg: Config, cluster: Cluster, *, vocab_size: int | None = None,
                 calibration: Mapping[str, float] = VALUES) -> Planning:
    """Every candidate plan of `cfg` on `cluster`, estimated. ConfigError with plan_problems' lines when the planner
    cannot plan it."""
    problems = plan_problems(cfg, cluster)
    if problems:
        raise ConfigError(problems)
    shape, settings = model_shape(cfg, vocab_size), settings_from(cfg)
    estimates = [estimate(shape, cluster, plan, settings, calibration) for plan in candidate_plans(cfg, cluster)]
    return Planning(shape, cluster, settings, cfg.train.global_batch_size // cluster.gpus, estimates)
