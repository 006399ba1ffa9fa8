"""Step time and tokens/s per GPU of a plan. Each block's GPU time comes from its FLOPs and bytes at calibrated
efficiencies (matmuls, attention, elementwise passes, what the checkpointing policy recomputes, FP8's casts); the
host's work per block (Python, FSDP's hooks, FP8's weights) runs beside it and sets the pace where it is the longer
of the two; the output projection and loss, FSDP's copies and the optimizer add to it; the collectives take their
bytes over the link they cross (NVLink within a node, the network between nodes), hidden behind the kernels up to a
share of their time; Muon's step adds the Newton-Schulz iterations of the matrices a GPU owns and two all-to-alls.
docs/planning.md describes each term; the constants are calibration.py's."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .calibration import VALUES
from .memory import BF16, FP32, fp8_linear_params
from .muon_work import muon_load
from .plan import Cluster, Plan, Settings
from .shape import ModelShape


@dataclass(frozen=True)
class Speed:
    step_s: float
    """One optimizer step: every micro-batch, the exposed communication and the optimizer."""
    compute_s: float
    """The step's GPU work and the host's where it sets the pace (everything but the exposed communication)."""
    comm_s: float
    """The step's collectives on their link, hidden or not."""
    exposed_comm_s: float
    """The part of comm_s that compute does not hide."""
    tokens_per_s: float
    """Per GPU."""
    mfu: float
    """Against the dense bf16 peak, with the project's FLOPs per token (recomputation not counted)."""


def _recomputed(shape: ModelShape, plan: Plan) -> tuple[float, float]:
    """Per block on average: (matmul parameters whose forward is recomputed, share of its attention recomputed)."""
    policy = plan.policy
    share = sum(policy.checkpoints(i) for i in range(shape.n_layers)) / shape.n_layers
    if policy.mode in ("full", "selective"):
        return share * shape.block_matmul_params, share
    if policy.mode == "none":
        return 0.0, 0.0
    return sum(shape.role_params[r] for r in plan.recomputed_roles()), 0.0


def block_gpu_s(shape: ModelShape, cluster: Cluster, plan: Plan, s: Settings, c: Mapping[str, float] = VALUES) -> float:
    """One block's kernels for one micro-batch, forward and backward."""
    gpu = cluster.gpu
    tokens = plan.micro_batch * shape.seq_len
    recomputed, attention_again = _recomputed(shape, plan)
    flops = tokens * (6 * shape.block_matmul_params + 2 * recomputed)
    if s.float8 != "none":
        assert gpu.peak.fp8 is not None, "FP8 on a GPU without FP8 tensor cores"
        matmul = flops / (gpu.peak.fp8 * c["fp8_matmul_efficiency"])
    else:
        matmul = flops / (gpu.peak.bf16 * c["matmul_efficiency"])
    efficiency = c["attention_efficiency_hd128" if shape.head_dim >= 128 else "attention_efficiency_hd64"]
    attention = (tokens * shape.attention_flops_per_token / shape.n_layers * (1 + attention_again / 3)
                 / (gpu.peak.bf16 * efficiency))
    if s.flex_without_boundaries:
        attention *= c["flex_attention_factor"]
    per_token = c["elementwise_bytes_per_width"] * shape.dim
    if s.float8 != "none":
        extra = c["fp8_cast_bytes_per_width"] * shape.dim
        per_token += extra * (c["rowwise_cast_factor"] if s.float8 == "rowwise" else 1.0)
    return matmul + attention + tokens * per_token / (gpu.hbm_tb_s * 1e12)


def block_host_s(s: Settings, c: Mapping[str, float] = VALUES) -> float:
    """The host's work for one block of one micro-batch, forward and backward (Python, FSDP's hooks, FP8's weights
    built per parameter)."""
    return c["fp8_block_host_s"] if s.float8 != "none" else c["block_host_s"]


def _edges_gpu_s(shape: ModelShape, cluster: Cluster, plan: Plan, c: Mapping[str, float]) -> float:
    """A micro-batch's work outside the blocks: the output projection's matmuls and the loss's passes over the logits,
    and FSDP's copies into and out of its collectives' buffers (the whole model's parameters, whatever the GPUs)."""
    gpu = cluster.gpu
    tokens = plan.micro_batch * shape.seq_len
    output = tokens * 6 * shape.vocab * shape.dim / (gpu.peak.bf16 * c["matmul_efficiency"])
    passes = (c["loss_bytes_per_logit"] * tokens * shape.vocab + c["fsdp_copy_bytes_per_param"] * shape.params)
    return output + passes / (gpu.hbm_tb_s * 1e12)


@dataclass(frozen=True)
class _Collectives:
    per_micro_batch_s: float
    per_step_s: float
    edge_s: float
    """The first block's all-gather and the last one's reduce-scatter of a micro-batch: nothing to hide them behind."""


def _link_gb_s(cluster: Cluster, group: int) -> float:
    """Bus bandwidth of a ring over `group` consecutive GPUs: NVLink within a node, the network across nodes."""
    return cluster.gpu.nvlink_gb_s if group <= cluster.gpus_per_node else cluster.gpu.network_gb_s


def _hop_s(cluster: Cluster, group: int, c: Mapping[str, float]) -> float:
    """One step of a collective over `group` consecutive GPUs: NVLink's within a node, the network's across nodes."""
    return c["nvlink_hop_latency_s"] if group <= cluster.gpus_per_node else c["network_hop_latency_s"]


def optimizer_s(shape: ModelShape, cluster: Cluster, plan: Plan, s: Settings, c: Mapping[str, float] = VALUES) -> float:
    """The optimizer step's kernels: passes over the GPU's shard at the HBM bandwidth (AdamW's; Muon's momentum,
    updates and AdamW on the rest take about as long), and with Muon the Newton-Schulz iterations of the matrices the
    GPU owns (all of them on one GPU) at a share of the bf16 peak."""
    group = plan.shard_size(cluster)
    passes = c["optimizer_bytes_per_param"] * shape.params / group / (cluster.gpu.hbm_tb_s * 1e12)
    if s.optimizer != "muon":
        return passes
    flops, _ = muon_load(shape, group, s.muon_ns_steps)
    return passes + flops / (cluster.gpu.peak.bf16 * c["newton_schulz_efficiency"])


def _muon_exchange_s(shape: ModelShape, cluster: Cluster, group: int, s: Settings, c: Mapping[str, float]) -> float:
    """Muon's two all-to-alls a step over the shard group, not hidden: every GPU sends its bf16 rows of each block
    matrix to the matrix's owner, which sends the results back; the busier end sets the time (a GPU's rows of all of
    them, or an owner's whole matrices from the others)."""
    if s.optimizer != "muon" or group == 1:
        return 0.0
    _, owned = muon_load(shape, group, s.muon_ns_steps)
    rows = max(shape.n_layers * shape.block_matmul_params / group, owned)
    transfer = BF16 * rows * (group - 1) / group / (_link_gb_s(cluster, group) * 1e9)
    return 2 * (transfer + (group - 1) * _hop_s(cluster, group, c))


def _collectives(shape: ModelShape, cluster: Cluster, plan: Plan, s: Settings, c: Mapping[str, float]) -> _Collectives:
    group = plan.shard_size(cluster)
    fp8 = fp8_linear_params(shape, s) if s.fp8_all_gather else 0
    gathered = BF16 * (shape.params - fp8) + fp8  # bytes of the whole model's weights as all-gathered
    reduced = s.reduce_bytes * shape.params
    share = (group - 1) / group
    bus = _link_gb_s(cluster, group) * 1e9
    latency = (group - 1) * _hop_s(cluster, group, c) * (shape.n_layers + 2)  # a ring's steps, once per FSDP unit
    gathers = {"FULL_SHARD": 2, "HYBRID_SHARD": 2, "SHARD_GRAD_OP": 1}.get(plan.sharding, 0)
    per_micro = gathers * (gathered * share / bus + latency) if group > 1 else 0.0
    per_step = _muon_exchange_s(shape, cluster, group, s, c)
    reduce_s = reduced * share / bus + latency if group > 1 else 0.0
    if plan.sharding != "NO_SHARD" and s.grad_sync_for(plan.sharding) == "every_micro_batch":
        per_micro += reduce_s
    else:
        per_step += reduce_s
    replicas = cluster.gpus // group
    if replicas > 1:  # NO_SHARD and HYBRID_SHARD: an all-reduce of each shard over its replicas, once a step
        bus_replicas = (cluster.gpu.network_gb_s if cluster.nodes > 1 else cluster.gpu.nvlink_gb_s) * 1e9
        per_step += 2 * (replicas - 1) / replicas * FP32 * shape.params / group / bus_replicas
    edge = (gathered + reduced) / (shape.n_layers + 2) * share / bus if group > 1 else 0.0
    return _Collectives(per_micro, per_step, edge)


def estimate_speed(shape: ModelShape, cluster: Cluster, plan: Plan, s: Settings,
                   c: Mapping[str, float] = VALUES) -> Speed:
    """Step time and tokens/s per GPU of `plan` on `cluster`."""
    gpu_s, host_s = block_gpu_s(shape, cluster, plan, s, c), block_host_s(s, c)
    p = c["host_overlap_power"]
    blocks = shape.n_layers * (gpu_s**p + host_s**p) ** (1 / p)
    edges = _edges_gpu_s(shape, cluster, plan, c)
    kernels, micro = shape.n_layers * gpu_s + edges, blocks + edges
    comm = _collectives(shape, cluster, plan, s, c)
    # Communication runs beside the kernels, hidden up to a share of their time.
    exposed_micro = max(0.0, comm.per_micro_batch_s - c["comm_overlap"] * kernels) + comm.edge_s
    optimizer = optimizer_s(shape, cluster, plan, s, c)
    step = plan.grad_accum * (micro + exposed_micro) + optimizer + comm.per_step_s
    tokens_per_s = plan.grad_accum * plan.micro_batch * shape.seq_len / step
    return Speed(step_s=step, compute_s=plan.grad_accum * micro + optimizer,
                 comm_s=plan.grad_accum * comm.per_micro_batch_s + comm.per_step_s,
                 exposed_comm_s=plan.grad_accum * exposed_micro + comm.per_step_s,
                 tokens_per_s=tokens_per_s, mfu=tokens_per_s * shape.flops_per_token / cluster.gpu.peak.bf16)
