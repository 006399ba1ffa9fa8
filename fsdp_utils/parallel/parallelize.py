"""What is applied to a built model's blocks before FSDP (`prepare_blocks`: FP8, activation checkpointing, compile;
the run's whole order: train/build_run.py), in place, so parameter names never gain wrapper prefixes and checkpoints
hold the plain model's names; the activation checkpointing policies; the run's precision."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy as OpPolicy, checkpoint, create_selective_checkpoint_contexts

if TYPE_CHECKING:
    from config import Config, FSDPConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # dtype of parameters in forward/backward
    reduce: torch.dtype  # dtype of gradient reduction
    use_grad_scaler: bool  # fp16 needs loss scaling

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.compute]


def resolve_precision(precision: str, reduce_dtype: str, device: torch.device) -> Precision:
    """auto: bf16 on GPUs that support it, fp16 (with a grad scaler) on older GPUs, fp32 on the CPU."""
    if precision == "auto":
        if device.type != "cuda":
            precision = "fp32"
        else:
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    compute = DTYPES[precision]
    reduce = torch.float32 if reduce_dtype == "fp32" else compute
    return Precision(compute, reduce, use_grad_scaler=compute == torch.float16)


def _ops_worth_saving() -> list:
    """Ops whose outputs the op-level policies may keep: matmuls and attention, the expensive ones to recompute. FP8
    matmuls (train.float8) reach the policy as `mm` on torchao's FP8 tensors, eager and compiled, in the releases
    tested; `_scaled_mm`, the op they run, is listed for releases where the policy sees that instead. Everything else in
    a block (norms, rotary, SwiGLU's activation, residual adds, FP8 casts) is elementwise and is recomputed in backward
    from those. Also kept: full max reductions, the FP8 scales' amax: a scalar each, and compile's recompute need not
    reduce again. Document masking's FlexAttention is a higher-order op; its block mask is built outside the blocks and
    reaches the recompute as an input, so it is never rebuilt there."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return [aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default, aten.max.default] + \
        [getattr(aten, n).default for n in names if hasattr(aten, n)] + [torch.ops.higher_order.flex_attention]


# The matmuls each op-level policy recomputes, by role (matmul_roles): with the feed-forward's gate and up
# matmuls apart (bf16 and FP8 alike), and fused into one (the benchmark's --fused_projections). selective_op_wide
# keeps every matmul output; selective_op recomputes the k, output and up projections, about half the bytes, as
# torchtitan's op-level policy does; with the gate and up fused, their output alone (two thirds of the bytes);
# selective_op_lean recomputes the feed-forward's input matmuls and the output projection. Every role but the
# down projection reads the model width, so each recomputed byte costs the same work. The down projection's
# output is kept: backward never reads it, so compile drops it, and in eager mode keeping it spares a rerun of
# its FP8 matmul.
OP_POLICY_RECOMPUTES = {
    "selective_op_wide": (frozenset(), frozenset()),
    "selective_op": (frozenset({"k", "o", "up"}), frozenset({"gate_up"})),
    "selective_op_lean": (frozenset({"o", "gate", "up"}), frozenset({"o", "gate_up"})),
}


def matmul_roles(block: nn.Module) -> list[tuple[str, tuple[int, int]]]:
    """The block's forward matmuls in the order they run, each as (role, shape of its right-hand operand,
    (in_features, out_features)): q, k, v (or qkv), o, gate, up (or gate_up), down. Ours and a Hugging Face
    Llama-like layer (self_attn.*_proj, mlp.*_proj); empty for a block of another shape."""
    attention, ffn = getattr(block, "attention", None), getattr(block, "feed_forward", None)
    if attention is not None and hasattr(attention, "wqkv") and ffn is not None and hasattr(ffn, "w13"):
        d, qkv = attention.wqkv.in_features, attention.wqkv.out_features
        heads = attention.n_heads * attention.head_dim
        kv = (qkv - heads) // 2
        hidden = ffn.w13.out_features // 2
        attn = [("qkv", (d, qkv))] if attention.fused_matmul else [("q", (d, heads)), ("k", (d, kv)), ("v", (d, kv))]
        gate_up = [("gate_up", (d, 2 * hidden))] if ffn.fused_matmul else [("gate", (d, hidden)), ("up", (d, hidden))]
        return [*attn, ("o", (heads, d)), *gate_up, ("down", (hidden, d))]
    self_attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    names = [(self_attn, "q_proj", "q"), (self_attn, "k_proj", "k"), (self_attn, "v_proj", "v"),
             (self_attn, "o_proj", "o"), (mlp, "gate_proj", "gate"), (mlp, "up_proj", "up"),
             (mlp, "down_proj", "down")]
    linears = [(getattr(parent, name, None), role) for parent, name, role in names]
    found = [(linear, role) for linear, role in linears if isinstance(linear, nn.Linear)]
    if len(found) < len(linears):
        return []
    return [(role, (linear.in_features, linear.out_features)) for linear, role in found]


def _op_policy(roles: list[tuple[str, tuple[int, int]]], recompute: frozenset[str]):
    """An op-level policy recomputing the matmuls of the `recompute` roles: each matmul is known by its
    right-hand operand's shape and how many of that shape ran before it in the block's forward (q and o
    are both model width square in many models). Counted apart for the forward and for backward's
    recompute, which must decide alike; a fresh count for each checkpointed call (the context function)."""
    save = set(_ops_worth_saving())
    aten = torch.ops.aten
    rhs_index = {aten.mm.default: 1, aten._scaled_mm.default: 1, aten.addmm.default: 2}
    seen: dict[tuple[int, int], int] = {}
    role_of = {}
    for role, shape in roles:
        role_of[(shape, seen.get(shape, 0))] = role
        seen[shape] = seen.get(shape, 0) + 1

    def context():
        counts: dict[tuple, int] = {}

        def policy(ctx, func, *args, **_kwargs):
            if func in rhs_index:
                shape = tuple(args[rhs_index[func]].shape)
                key = (ctx.is_recompute, func, shape)
                occurrence = counts.get(key, 0)
                counts[key] = occurrence + 1
                if role_of.get((shape, occurrence)) in recompute:
                    return OpPolicy.PREFER_RECOMPUTE
            return OpPolicy.MUST_SAVE if func in save else OpPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context


POLICY_MODES = ("none", "full", "selective", *OP_POLICY_RECOMPUTES)
NEEDS_ROLES = ("selective_op", "selective_op_lean")  # the policies that recompute some matmuls by role


@dataclass(frozen=True)
class CheckpointPolicy:
    """One activation checkpointing policy (fsdp.activation_checkpointing): none, full, selective (every
    every_n-th block), or one of the op-level policies (OP_POLICY_RECOMPUTES)."""
    mode: str
    every_n: int = 1

    def checkpoints(self, index: int) -> bool:
        """Whether the block at `index` recomputes its activations in backward."""
        return self.mode != "none" and not (self.mode == "selective" and index % self.every_n)

    @property
    def name(self) -> str:
        """As the log and the micro-batch cache write it: selective carries its n (selective/2)."""
        return f"selective/{self.every_n}" if self.mode == "selective" else self.mode

    @classmethod
    def parse(cls, name: str) -> CheckpointPolicy:
        mode, _, every_n = name.partition("/")
        if mode not in POLICY_MODES or (mode == "selective") != every_n.isdigit() \
                or (every_n and int(every_n) < 1):
            raise ValueError(f"not an activation checkpointing policy: {name!r}")
        return cls(mode, int(every_n or 1))


def auto_policies(every_n: int, *, roles_known: bool = True) -> list[CheckpointPolicy]:
    """fsdp.activation_checkpointing=auto's candidates, in the order of what they recompute in backward: nothing,
    the elementwise work and about half the matmuls, the gate matmul too, every block's whole forward (so at the
    same micro-batch, each is slower than the one before, and is tried only for a micro-batch the ones before
    could not fit). Where the blocks' matmul roles are not known, selective_op_wide (the elementwise work only)
    and every every_n-th block's whole forward take the two op-level policies' place. Where they are known,
    every n-th block's forward is no candidate: it keeps about what selective_op keeps and recomputes as much as
    selective_op_lean, which keeps less, so it cannot win; one candidate fewer is one compile and its trials fewer.
    Neither is selective_op_wide: it sits between none and selective_op."""
    if roles_known:
        return [CheckpointPolicy(name) for name in ("none", "selective_op", "selective_op_lean", "full")]
    return [CheckpointPolicy("none"), CheckpointPolicy("selective_op_wide"),
            CheckpointPolicy("selective", max(every_n, 2)), CheckpointPolicy("full")]


class CheckpointSwitch:
    """The policy of blocks made switchable by `apply_switchable_checkpointing`, for fsdp.activation_checkpointing=auto:
    the micro-batch search (train/microbatch.py) sets each candidate in turn and leaves the chosen one. Compiled blocks
    guard on it: a new policy compiles its own graphs, and one compiled before runs again without compiling."""

    def __init__(self, policy: CheckpointPolicy = CheckpointPolicy("none")):
        self.policy = policy
        self.roles_known = True  # whether selective_op and selective_op_lean are candidates (matmul_roles)


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str, every_n: int) -> int:
    """Recompute chosen blocks' activations in backward instead of storing them; returns how many.

    full: every block keeps only its input; selective: the same for every every_n-th block; the op-level
    policies keep attention outputs and some matmul outputs (OP_POLICY_RECOMPUTES) and recompute the
    elementwise work and the other matmuls."""
    policy = CheckpointPolicy(mode, every_n)
    count = 0
    for i, block in enumerate(blocks):
        if policy.checkpoints(i):
            block.forward = _checkpointed(block.forward, _context_fn(policy.mode, block))
            count += 1
    return count


def _context_fn(mode: str, block: nn.Module):
    """checkpoint's context function for a checkpointing mode (one that checkpoints) on this block; None for
    the whole-block modes."""
    if mode not in OP_POLICY_RECOMPUTES:
        return None
    roles = matmul_roles(block)
    if not roles and mode != "selective_op_wide":
        raise ValueError(f"fsdp.activation_checkpointing={mode}: {type(block).__name__} has no attention and "
                         "feed-forward projections it knows (ours, or a Llama-like self_attn.*_proj and mlp.*_proj): "
                         "use selective_op_wide")
    separate, fused = OP_POLICY_RECOMPUTES[mode]
    return _op_policy(roles, fused if any(role == "gate_up" for role, _ in roles) else separate)


def apply_switchable_checkpointing(blocks: list[nn.Module], switch: CheckpointSwitch) -> None:
    """Like apply_activation_checkpointing, with the policy read from `switch` at every forward."""
    switch.roles_known = all(matmul_roles(block) for block in blocks)
    for i, block in enumerate(blocks):
        block.forward = _switchable(block.forward, i, switch, block)


def _switchable(forward, index: int, switch: CheckpointSwitch, block: nn.Module):
    modes = [m for m in POLICY_MODES if m != "none" and (switch.roles_known or m not in NEEDS_ROLES)]
    variants = {mode: _checkpointed(forward, _context_fn(mode, block)) for mode in modes}

    def switchable_forward(*args, **kwargs):
        policy = switch.policy
        if not policy.checkpoints(index):
            return forward(*args, **kwargs)
        return variants[policy.mode](*args, **kwargs)

    return switchable_forward


def _checkpointed(forward, context_fn):
    # A plain function of ours, not a functools.partial of checkpoint: torch.compile traces this frame
    # and turns the checkpoint call into its own region, which the compiled block then recomputes (and,
    # with an op-level policy, partitions by it). A partial's first frame is torch's checkpoint itself,
    # which compile skips, and the whole block then ran uncompiled.
    extra = {"context_fn": context_fn} if context_fn is not None else {}

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return checkpointed_forward


def compile_options(tuning: bool) -> dict | None:
    """torch.compile's inductor options for train.compile_tuning: coordinate-descent tuning times each
    generated kernel's launch configuration (block sizes, warps) around inductor's default at the first
    compile and keeps the fastest (cached on the machine). Scoped to our compiled functions, not global."""
    return {"coordinate_descent_tuning": True} if tuning else None


def apply_compile(blocks: list[nn.Module], *, tuning: bool = False) -> None:
    """Compile each block in place: every block has the same graph, so one compile serves all."""
    for block in blocks:
        block.compile(options=compile_options(tuning))


def model_converters(cfg: Config) -> list:
    """The converters a run applies to its blocks before parallelizing (FP8 with train.float8). Each has
    `convert(blocks)`, `register(model, optimizer)` for work after every optimizer step,
    `refresh(model)` for the same work after the weights changed otherwise (a checkpoint loaded), and
    `use_accumulation(model, grad_accum)` once the micro-batches per step are known."""
    if cfg.train.float8 == "none":
        return []
    from .float8 import Float8Converter

    assert cfg.fsdp.version == 2, "train.float8 needs FSDP2 (the config validation says so)"
    return [Float8Converter(cfg.train.float8, float8_all_gather=cfg.train.float8 == "tensorwise")]


def prepare_blocks(blocks: list[nn.Module], f: FSDPConfig, *, converters: Sequence = (),
                   checkpoint_switch: CheckpointSwitch | None = None, compile: bool = False,
                   compile_tuning: bool = False) -> None:
    """In place, in order: the model converters (e.g. FP8 linear layers), activation checkpointing
    (fsdp.activation_checkpointing; auto needs `checkpoint_switch`, through which the micro-batch search picks the
    policy), then torch.compile of each block (tuned with `compile_tuning`, see compile_options)."""
    for converter in converters:
        # First: checkpointing and compile then wrap the converted modules' forward, and FSDP2 shards
        # their weights (FP8 all-gather subclasses included).
        converter.convert(blocks)
    if f.activation_checkpointing == "auto":
        assert checkpoint_switch is not None, "fsdp.activation_checkpointing=auto is chosen through a CheckpointSwitch"
        apply_switchable_checkpointing(blocks, checkpoint_switch)
    else:
        apply_activation_checkpointing(blocks, f.activation_checkpointing, f.ac_every_n_layers)
    if compile:
        apply_compile(blocks, tuning=compile_tuning)
