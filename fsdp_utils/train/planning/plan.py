"""What the estimate is of: a cluster (GPU kind, count, nodes), a plan (activation checkpointing policy,
micro-batch and accumulation, sharding) and the run's settings read from the config."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, cast

from config import Config, check_batch_split
from config.sections import ShardingStrategy

from ...parallel.fsdp import resolve_grad_sync
from ...parallel.parallelize import OP_POLICY_RECOMPUTES, CheckpointPolicy
from .hardware import GPUSpec


@dataclass(frozen=True)
class Cluster:
    gpu: GPUSpec
    gpus: int
    """GPUs in all (the world size)."""
    nodes: int = 1

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes


@dataclass(frozen=True)
class Plan:
    checkpointing: str
    """A policy as fsdp.activation_checkpointing and the micro-batch cache name it: none, full, selective/2,
    selective_op_wide, selective_op, selective_op_lean."""
    micro_batch: int
    grad_accum: int
    sharding: str = "FULL_SHARD"
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."""
    shard_group: int = 0
    """HYBRID_SHARD: GPUs per shard group (0: one node's)."""
    version: int = 2
    """fsdp.version."""
    recomputes: frozenset[str] | None = None
    """An op-level policy's recomputed matmul roles where they are not today's (a record of older code); None: the
    policy's own (OP_POLICY_RECOMPUTES)."""

    @property
    def policy(self) -> CheckpointPolicy:
        return CheckpointPolicy.parse(self.checkpointing)

    @property
    def label(self) -> str:
        """sharding/policy@micro-batch x accumulation, as the plan table names a row."""
        return f"{self.sharding_label} {self.checkpointing}@{self.micro_batch}x{self.grad_accum}"

    @property
    def sharding_label(self) -> str:
        return f"HYBRID_SHARD/{self.shard_group}" if self.sharding == "HYBRID_SHARD" else self.sharding

    def shard_size(self, cluster: Cluster) -> int:
        """The GPUs each parameter is sharded over."""
        if self.sharding == "NO_SHARD":
            return 1
        if self.sharding == "HYBRID_SHARD":
            return self.shard_group or cluster.gpus_per_node
        return cluster.gpus

    def recomputed_roles(self) -> frozenset[str]:
        """The matmul roles an op-level policy recomputes (the separate gate and up matmuls of our blocks)."""
        if self.recomputes is not None:
            return self.recomputes
        separate, _fused = OP_POLICY_RECOMPUTES.get(self.policy.mode, (frozenset(), frozenset()))
        return separate


@dataclass(frozen=True)
class Settings:
    """What the estimate reads from the config besides the model's shape and the plan."""
    float8: str = "none"
    float8_output: bool = False
    loss_chunk_tokens: int = 0
    reduce_bytes: int = 4
    """Bytes of a reduced gradient element: 4 with fsdp.reduce_dtype fp32, 2 in the compute dtype."""
    grad_sync: str = "auto"
    margin: float = dataclasses.field(default_factory=lambda: Config().train.auto_micro_batch_margin)
    """train.auto_micro_batch_margin: the share of the GPU's memory a plan must leave free to fit."""
    flex_without_boundaries: bool = False
    """FlexAttention on windows without a document boundary (what document masking ran on random tokens before it
    learned to run the causal kernel there): a record of older code."""
    fixed_segments: bool = False
    """The CUDA allocator without expandable segments (records before train_fsdp.py turned them on)."""
    compiled: bool = True
    """train.compile: the estimate is of compiled blocks, as every record's but the uncompiled ablations."""
    optimizer: str = "adamw"
    """train.optimizer: adamw, or muon (Muon on the blocks' matmul weights, AdamW on the rest)."""
    muon_ns_steps: int = 5
    """train.muon_ns_steps: Newton-Schulz iterations a Muon matrix takes a step."""

    @property
    def fp8_all_gather(self) -> bool:
        return self.float8 == "tensorwise"

    def grad_sync_for(self, sharding: str) -> str:
        """fsdp.grad_sync resolved for a sharding strategy, as parallelize resolves it."""
        return resolve_grad_sync(dataclasses.replace(_FSDP_DEFAULTS, grad_sync=cast(GradSync, self.grad_sync),
                                                     sharding_strategy=cast(ShardingStrategy, sharding)))


_FSDP_DEFAULTS = Config().fsdp
GradSync = Literal["auto", "every_micro_batch", "last_micro_batch"]


def settings_from(cfg: Config) -> Settings:
    """The Settings of a config."""
    t, f = cfg.train, cfg.fsdp
    return Settings(float8=t.float8, float8_output=t.float8_output, loss_chunk_tokens=t.loss_chunk_tokens,
                    reduce_bytes=4 if f.reduce_dtype == "fp32" else 2, grad_sync=f.grad_sync,
                    margin=t.auto_micro_batch_margin, compiled=t.compile, optimizer=t.optimizer,
                    muon_ns_steps=t.muon_ns_steps)


def plan_from(cfg: Config, *, gpus: int, micro_batch: int | None = None, checkpointing: str | None = None) -> Plan:
    """The plan a config runs on `gpus` GPUs; `micro_batch` and `checkpointing` where the config says auto.
    ConfigError (config.check_batch_split's) when the global batch does not split so."""
    t, f = cfg.train, cfg.fsdp
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else micro_batch
    policy = f.activation_checkpointing if f.activation_checkpointing != "auto" else checkpointing
    assert micro is not None and policy is not None, "auto settings need a micro-batch and a policy"
    accumulation = check_batch_split(t, gpus, micro_batch=micro)
    assert accumulation is not None
    return Plan(CheckpointPolicy(policy, f.ac_every_n_layers if policy == "selective" else 1).name, micro,
                accumulation, f.sharding_strategy, f.hybrid_shard_group_size, f.version)
