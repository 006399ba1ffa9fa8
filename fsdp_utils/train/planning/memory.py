"""Peak GPU memory of a training step, per GPU, broken down: the sharded states, the gradients held between
micro-batches, FSDP's gathered weights and gradient buffers, the activations the checkpointing policy keeps, the
chunked loss's buffers, FP8's extras, and what the allocator reserves above its allocations. docs/planning.md describes
each term; the constants are calibration.py's."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .calibration import VALUES
from .hardware import GIB
from .muon_work import muon_load, ns_batch_elements
from .plan import Cluster, Plan, Settings
from .shape import ModelShape

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Memory:
    """GiB per GPU at the step's peak (the larger of the forward/backward peak and the optimizer step's)."""
    params: float
    """fp32 parameters, sharded."""
    grads: float
    """fp32 gradients alive at the peak: sharded ones between micro-batches, whole ones without their sync."""
    optimizer: float
    """The optimizer's fp32 state, sharded: AdamW's two moments a parameter; with Muon one momentum for the blocks'
    matmul weights."""
    activations: float
    """What the blocks keep for backward under the checkpointing policy (and a checkpointed block's recompute)."""
    loss: float
    """The chunked loss: the output weight's fp32 gradient sum and copies, the final norm's output and its gradient,
    a chunk's logits."""
    fp8: float
    """FP8 weight shards cast once per step (tensorwise with accumulation)."""
    buffers: float
    """FSDP's gathered weights (one block and the next, or all of them with SHARD_GRAD_OP) and gradient buffers; at
    the optimizer step's peak, Muon's updates, all-to-all buffers and Newton-Schulz batch (muon_step_bytes)."""
    headroom: float
    """What the CUDA allocator reserves above its peak allocation."""
    outside: float
    """The CUDA context and NCCL's buffers: memory the allocator never sees."""

    @property
    def allocated(self) -> float:
        """torch.cuda.max_memory_allocated's figure, as benchmarks/benchmark.py and the training log print it."""
        return (self.params + self.grads + self.optimizer + self.activations + self.loss + self.fp8
                + self.buffers)

    @property
    def reserved(self) -> float:
        """torch.cuda.max_memory_reserved's figure, which the micro-batch search holds to its budget."""
        return self.allocated + self.headroom

    @property
    def total(self) -> float:
        """All the GPU memory the run takes."""
        return self.reserved + self.outside


def fp8_linear_params(shape: ModelShape, s: Settings) -> int:
    """Parameters that train.float8 runs as FP8 linears: every matmul of every block (all our widths are multiples
    of 16)."""
    return shape.n_layers * shape.block_matmul_params if s.float8 != "none" else 0


def optimizer_state_bytes(shape: ModelShape, s: Settings) -> float:
    """The whole model's optimizer state: two fp32 moments a parameter (AdamW), but one momentum for each of the
    blocks' matmul weights that train.optimizer=muon gives Muon."""
    muon = shape.n_layers * shape.block_matmul_params if s.optimizer == "muon" else 0
    return FP32 * (2 * shape.params - muon)


def kept_bytes_per_token(shape: ModelShape, plan: Plan, s: Settings, c: Mapping[str, float]) -> float:
    """Bytes a whole forward keeps for backward, per token of a micro-batch (all blocks)."""
    policy = plan.policy
    n_checkpointed = sum(policy.checkpoints(i) for i in range(shape.n_layers))
    if policy.mode in ("none", "full", "selective"):
        plain = _none_bytes(shape, s, c) * (shape.n_layers - n_checkpointed)
        return plain + BF16 * shape.dim * n_checkpointed  # a checkpointed block keeps its input alone
    # An op-level policy keeps the block's input, the attention's output (and its log-sum-exp, fp32 per head) and
    # the outputs of the matmuls it does not recompute, in the compute precision also under FP8; the down
    # projection's output is never read by backward, so compile drops it.
    recomputed = plan.recomputed_roles()
    kept = 2 * shape.dim + sum(w for role, w in _output_widths(shape).items() if role not in recomputed)
    return shape.n_layers * (BF16 * kept + FP32 * shape.n_heads)


def _output_widths(shape: ModelShape) -> dict[str, int]:
    """Output width of each matmul of a block that backward may read (the down projection's it never does)."""
    return {"q": shape.n_heads * shape.head_dim, "k": shape.kv_dim, "v": shape.kv_dim, "o": shape.dim,
            "gate": shape.hidden, "up": shape.hidden}


def _none_bytes(shape: ModelShape, s: Settings, c: Mapping[str, float]) -> float:
    """Bytes one block keeps per token without checkpointing: what compile's partitioner saves (in bf16: the block's
    input, the norms' outputs, q, k, v, the attention's output, the residual, gate, up and their product); FP8 keeps
    a calibrated share of that (its matmul inputs in FP8)."""
    elements = (c["none_dim_elements"] * shape.dim + c["none_kv_elements"] * shape.kv_dim
                + c["none_hidden_elements"] * shape.hidden)
    return BF16 * elements * (c["fp8_none_share"] if s.float8 != "none" else 1.0)


def working_bytes_per_token(shape: ModelShape, plan: Plan, s: Settings, c: Mapping[str, float]) -> float:
    """Bytes of one block's backward beyond what is kept, per token: what its checkpointing recomputes (a whole
    block's forward, or an op-level policy's matmul outputs and norms) and the gradients of its activations."""
    mode = plan.policy.mode
    grads = c["backward_elements"] * BF16 * (shape.dim + shape.hidden)
    if mode in ("full", "selective"):
        return grads + _none_bytes(shape, s, c)
    if mode == "none":
        return grads
    widths = _output_widths(shape)
    return grads + BF16 * (2 * shape.dim + sum(widths[r] for r in plan.recomputed_roles()))


def _loss_bytes(shape: ModelShape, tokens: int, plan: Plan, s: Settings, c: Mapping[str, float]) -> float:
    """The chunked loss's peak (model/loss.py): the output weight's fp32 gradient sum and its compute-precision copy
    for backward, the final norm's input and output and the gradient of its output, a chunk's logits and their
    gradient; the weight itself gathered while it runs (FSDP2 shards it as a unit of its own; FSDP1 keeps it in the
    root's gathered weights, counted with the buffers). Without chunking, the fp32 logits of the whole micro-batch."""
    vd = shape.vocab * shape.dim
    gathered = BF16 * vd if plan.version == 2 and plan.sharding != "NO_SHARD" else 0
    hidden = 3 * BF16 * shape.dim * tokens
    if s.loss_chunk_tokens <= 0 and not s.float8_output:
        return gathered + hidden + c["unchunked_bytes_per_logit"] * tokens * shape.vocab
    chunk = min(s.loss_chunk_tokens or tokens, tokens)
    return gathered + hidden + c["loss_bytes_per_output_param"] * vd + c["chunk_bytes_per_logit"] * chunk * shape.vocab


def _buffer_bytes(shape: ModelShape, plan: Plan, s: Settings, group: int, c: Mapping[str, float]) -> float:
    """FSDP's gathered weights and gradient buffers at the peak."""
    fp8 = s.fp8_all_gather and group > 1
    per_block = c[f"fsdp{plan.version}_buffer_bytes_per_block_param"] - (2 if fp8 else 0) \
        - (2 if s.reduce_bytes == BF16 else 0)
    buffers = per_block * shape.block_params
    if plan.sharding == "SHARD_GRAD_OP" and group > 1:  # every block's gathered weights live from forward to backward
        buffers += (1 if fp8 else BF16) * shape.block_params * (shape.n_layers - 2)
    if plan.version == 1 and group > 1:  # FSDP1's root unit holds the embedding and the output gathered throughout
        buffers += BF16 * shape.edge_params
    return buffers


def muon_step_bytes(shape: ModelShape, s: Settings, group: int) -> float:
    """train.optimizer=muon's working memory in its step, beside the sharded states and gradients: the update of each
    matrix's local rows in bf16 (U) and the whole matrices the GPU owns (O, the busiest owner's), with its largest
    Newton-Schulz batch or, over a shard group, with an all-to-all's buffers (a copy of each: 2U + 2O). On one GPU
    the updates are the whole matrices."""
    if s.optimizer != "muon":
        return 0.0
    local = BF16 * shape.n_layers * shape.block_matmul_params / group
    owned = muon_load(shape, group, s.muon_ns_steps)[1]
    batch = BF16 * ns_batch_elements(shape, group)
    if group == 1:
        return local + batch
    return max(local + BF16 * owned + batch, 2 * local + 2 * BF16 * owned)


def estimate_memory(shape: ModelShape, cluster: Cluster, plan: Plan, s: Settings,
                    c: Mapping[str, float] = VALUES) -> Memory:
    """The peak memory per GPU of one training step of `plan` on `cluster`."""
    group = plan.shard_size(cluster)
    tokens = plan.micro_batch * shape.seq_len
    params = FP32 * shape.params / group
    optimizer = optimizer_state_bytes(shape, s) / group
    sync = s.grad_sync_for(plan.sharding)
    held = 0.0  # gradients alive while the last micro-batch runs
    if plan.grad_accum > 1 and sync == "every_micro_batch":
        held = FP32 * shape.params / group
    elif plan.grad_accum > 1:  # whole: FSDP2 in the reduce dtype, FSDP1's no_sync in the compute dtype
        held = (s.reduce_bytes if plan.version == 2 else BF16) * shape.params
    fp8 = fp8_linear_params(shape, s) / group if s.fp8_all_gather and plan.grad_accum > 1 else 0.0
    activations = kept_bytes_per_token(shape, plan, s, c) * tokens
    loss = _loss_bytes(shape, tokens, plan, s, c)
    working = working_bytes_per_token(shape, plan, s, c) * tokens
    if working > loss:  # the peak is in the last block's backward (the loss's buffers are gone by then)
        activations, loss = activations + working, 0.0
    buffers = _buffer_bytes(shape, plan, s, group, c)
    step_peak = params + optimizer + held + activations + loss + fp8 + buffers
    muon = muon_step_bytes(shape, s, group)
    if params + optimizer + FP32 * shape.params / group + fp8 + muon > step_peak:
        # The optimizer step's peak: every gradient sharded, no activation alive.
        held, activations, loss, buffers = FP32 * shape.params / group, 0.0, 0.0, muon
    allocated = params + optimizer + held + activations + loss + fp8 + buffers
    # What the allocator reserves above that: a share of it; with expandable segments, more where a step of one
    # micro-batch allocates the gradients' shards while each block's backward allocates and frees large transient
    # tensors (its recompute); with fixed segments, about one more size of the gradients' shards.
    if s.fixed_segments:
        headroom = (allocated * c["headroom_fixed_segments"]
                    + c["gradient_headroom_fixed_segments"] * FP32 * shape.params / group)
    else:
        headroom = allocated * c["headroom_expandable_segments"]
        if plan.grad_accum == 1:
            headroom += working * c["transient_headroom_one_micro_batch"]
    return Memory(params=params / GIB, grads=held / GIB, optimizer=optimizer / GIB, activations=activations / GIB,
                  loss=loss / GIB, fp8=fp8 / GIB, buffers=buffers / GIB, headroom=headroom / GIB,
                  outside=c["outside_allocator_gib"])
