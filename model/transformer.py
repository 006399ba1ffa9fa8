"""Llama-style decoder-only transformer: RMSNorm, rotary embeddings, (grouped-query) causal attention
through scaled_dot_product_attention (or, with document masking, attention inside each packed document:
model/documents.py), SwiGLU MLP. Imports torch only: parallelism is applied from outside (fsdp_utils/),
and weights are initialised by `init_weights`, separately from construction, so the model can be built
on the meta device and materialised after sharding.

Shapes: B batch, T sequence, D dim, H query heads, K key/value heads, Hd head dim, V vocabulary.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .config import ModelConfig
from .documents import Documents, document_block_mask, document_dense_mask, document_ids, document_positions
from .loss import chunk_loss_and_grad, chunked_cross_entropy

if TYPE_CHECKING:
    from .float8_projection import Float8Projection



class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast/mixed precision: the mean of squares loses bits.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float, device=None, *,
                  llama3_scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_seq_len, head_dim), in the rotate-half layout used by Llama; with
    `llama3_scaling` (the keyword arguments of llama3_scaled) its frequencies are Llama 3's."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if llama3_scaling is not None:
        inv_freq = llama3_scaled(inv_freq, **llama3_scaling)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (T, Hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, Hd)
    return angles.cos(), angles.sin()


def llama3_scaled(inv_freq: torch.Tensor, *, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_seq_len: int) -> torch.Tensor:
    """Llama 3.1's rotary frequencies (rope_type llama3): inv_freq (Hd/2,) with the slow ones slowed further.

    A frequency whose wavelength 2 pi / inv_freq spans few rotations of the pretraining context
    (original_max_seq_len / wavelength <= low_freq_factor) is divided by `factor`, so positions up to
    `factor` times that context stay distinguishable; one that rotates often (>= high_freq_factor
    rotations) encodes local order and is kept; between the two, the result moves linearly in the number
    of rotations from inv_freq / factor to inv_freq.
    """
    rotations = original_max_seq_len * inv_freq / (2 * math.pi)  # original_max_seq_len / wavelength
    kept = ((rotations - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)  # 0 slowed, 1 kept
    return (1 - kept) * (inv_freq / factor) + kept * inv_freq


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, Hd) by position; cos/sin are (T, Hd), or (B, 1, T, Hd) for per-token positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


def per_slice_matmuls(linear: nn.Module, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """One matmul of x per slice of the linear layer's weight (`sizes` along its outputs), as if each slice
    were its own layer. A layer that runs its slices itself (it has `output_slices`: FP8's, which slicing its
    weight here would bypass; fsdp_utils/parallel/float8.py) is called and returns them."""
    if getattr(linear, "output_slices", None) is not None:
        return list(linear(x))
    weight: torch.Tensor = linear.weight  # type: ignore[assignment]
    return [F.linear(x, w) for w in weight.split(sizes)]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, fused_matmul: bool = False, flex_attention_fn: Callable | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.num_kv_heads, cfg.head_dim
        # q, k and v weights in one parameter: one tensor to shard, gather and checkpoint.
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # False: one matmul per slice of wqkv (below). True: one call of the wqkv module, its output
        # split afterwards (LoRA's adapters add to that output).
        self.fused_matmul = fused_matmul
        # Used only with a block mask (document masking); a torch.compile'd flex_attention on GPUs, where
        # the uncompiled one materialises every score.
        self.flex_attention = flex_attention_fn or flex_attention

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if self.fused_matmul:
            q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
            return q, k, v.contiguous()  # attention saves v: a view would keep the whole fused output alive
        # Three matmuls on slices of the one weight, not one matmul split afterwards (the faster of the two in
        # docs/benchmarks.md): q, k, v are separate tensors, so attention saving v for backward does not keep a
        # fused output buffer alive, and backward concatenates no gradients.
        q, k, v = per_slice_matmuls(self.wqkv, x, [q_size, kv_size, kv_size])
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: BlockMask | torch.Tensor | None = None) -> torch.Tensor:
        """mask: None (causal), a FlexAttention BlockMask, or a (B, 1, T, T) boolean mask (True: attend)."""
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, T, Hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, T, Hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if isinstance(mask, BlockMask):  # FlexAttention shares the kv heads itself
            out = self.flex_attention(q, k, v, block_mask=mask, enable_gqa=self.n_kv_heads != self.n_heads)
        else:
            if self.n_kv_heads != self.n_heads:
                # Grouped-query attention: each key/value head serves n_heads / n_kv_heads query heads.
                repeats = self.n_heads // self.n_kv_heads
                k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, Hd)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the gate and up weights are one parameter, w13."""

    def __init__(self, cfg: ModelConfig, *, fused_matmul: bool = False):
        super().__init__()
        self.hidden_dim = cfg.hidden_dim
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)  # [gate; up]
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.fused_matmul = fused_matmul  # True: one call of the w13 module, see Attention.fused_matmul

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_matmul:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return gate, up
        # Two matmuls on the halves of w13 (see Attention.project_qkv): with one matmul, compile's
        # SwiGLU backward kernel must also concatenate the two gradients (the slower of the two in
        # docs/benchmarks.md).
        gate, up = per_slice_matmuls(self.w13, x, [self.hidden_dim, self.hidden_dim])
        return gate, up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.w2(F.silu(gate) * up)


class DecoderBlock(nn.Module):
    """Pre-norm transformer block; the unit of FSDP wrapping, activation checkpointing and compile."""

    def __init__(self, cfg: ModelConfig, *, fused_matmul: bool = False, flex_attention_fn: Callable | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, fused_matmul=fused_matmul, flex_attention_fn=flex_attention_fn)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg, fused_matmul=fused_matmul)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: BlockMask | torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The decoder-only model. Options that change how it computes, not what it is (never saved with it):
    `fused_matmul` (see Attention), `loss_chunk_tokens` (tokens per chunk of the output projection and
    loss, 0: all at once) and `chunk_loss_fn` (one chunk's logits -> its loss and gradient, e.g. a
    compiled copy of chunk_loss_and_grad); see chunked_cross_entropy. `float8_projection`: the output projection and
    loss in FP8 while training (train.float8_output; model/float8_projection.py). `documents`: attention kept inside
    each EOS-separated document of a window and/or positions restarted at each (model/documents.py),
    through `flex_attention_fn` (default: torch's flex_attention, uncompiled)."""

    rope_cos: torch.Tensor  # (max_seq_len, Hd), a buffer (declared so type checkers see a Tensor)
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, *, fused_matmul: bool = False, loss_chunk_tokens: int = 0,
                 chunk_loss_fn: Callable | None = None, float8_projection: Float8Projection | None = None,
                 documents: Documents | None = None, flex_attention_fn: Callable | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderBlock(cfg, fused_matmul=fused_matmul, flex_attention_fn=flex_attention_fn)
                                    for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Rotary tables are derived, not learned: non-persistent, so they never enter a checkpoint,
        # and recomputed by reset_buffers() after a meta-device build.
        cos, sin = self._rotary_tables(device=None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.chunk_loss_fn = chunk_loss_fn or chunk_loss_and_grad
        self.float8_projection = float8_projection
        self.documents = documents

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                loss_reduction: str = "mean") -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V); with targets (B, T), the cross-entropy instead: its mean over the
        targets that are not IGNORE_INDEX, or with loss_reduction="sum" their sum (see chunked_cross_entropy)."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        mask = None
        if self.documents is not None:
            cos, sin, mask = self._document_inputs(tokens, self.documents)
        h = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in self.layers:
            # Without document masking the blocks are called without a mask argument (their plain causal path).
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask)
        h = self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        fp8 = self.float8_projection
        if targets is None:
            return F.linear(h, weight)  # (B, T, V)
        return chunked_cross_entropy(h.flatten(0, 1), weight, targets.flatten(), chunk_tokens=self.loss_chunk_tokens,
                                     chunk_loss_fn=fp8.chunk_loss if fp8 else self.chunk_loss_fn,
                                     make_matmuls=fp8.matmuls if fp8 else None, reduction=loss_reduction)

    def _document_inputs(self, tokens: torch.Tensor, documents: Documents):
        """The rotary tables and attention mask of a batch with documents: computed once per forward, here,
        and passed to every block (activation checkpointing's recompute reuses them too). A batch in which no
        window holds a document boundary (every window inside one document: random tokens, long documents) is
        the plain causal batch: it gets the plain tables and no mask, so it runs the causal kernel, not
        FlexAttention. Telling which costs one read of a flag on the host."""
        T = tokens.shape[1]
        doc_ids = document_ids(tokens, documents.eos_id)  # (B, T)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        # A window's last token counts the EOS before it: 0 everywhere means one document per window.
        if not bool(doc_ids[:, -1].any()):
            return cos, sin, None
        if documents.reset_positions:
            positions = document_positions(doc_ids)  # (B, T)
            cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]  # (B, 1, T, Hd)
        mask: BlockMask | torch.Tensor | None = None
        if documents.mask_attention:
            flex = documents.kernel == "flex" or (documents.kernel == "auto" and tokens.device.type == "cuda")
            mask = document_block_mask(doc_ids) if flex else document_dense_mask(doc_ids)
        return cos, sin, mask

    # ---- initialisation, separate from construction -------------------------------------------
    def reset_buffers(self) -> None:
        """Recompute the rotary tables on the buffers' current device (after to_empty they are garbage)."""
        cos, sin = self._rotary_tables(device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def _rotary_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of this config, for every path (window positions, restarted positions, generation)."""
        c = self.cfg
        return rotary_tables(c.head_dim, c.max_seq_len, c.rope_theta, device=device, llama3_scaling=c.llama3_scaling)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter (see `initial_value`) and the derived buffers."""
        for name, param in self.named_parameters():
            param.copy_(initial_value(self.cfg, name, tuple(param.shape), seed=seed, device=param.device,
                                      dtype=param.dtype))
        self.reset_buffers()


def initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], *, seed: int, device, dtype) -> torch.Tensor:
    """The initial value of parameter `name`, a pure function of (seed, name, shape).

    Each parameter draws from its own generator, so the result does not depend on the order in which
    parameters are materialised: a direct build, a meta-device build initialised after FSDP1 wrapping
    (module by module), and an FSDP2 build (full value, then sharded) all start from the same weights.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device, dtype=dtype)
    std = cfg.init_std
    if name.endswith("attention.wo.weight") or name.endswith("feed_forward.w2.weight"):
        # Residual projections: keep the stream's variance flat in depth.
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    value = torch.empty(shape, device=device, dtype=torch.float32)
    value.normal_(0.0, std, generator=generator)
    return value.to(dtype)
