"""Shape of the decoder-only transformer. Plain data: no torch.distributed here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Dimensions of a Llama-style decoder. Field names match the `model` section of the YAML."""

    vocab_size: int = 4096
    """Token vocabulary size; 0 in a YAML file means: take it from the tokenizer."""
    dim: int = 256
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of DecoderBlocks."""
    n_heads: int = 4
    """Attention (query) heads; dim must divide by it."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    ffn_hidden_dim: int | None = None
    """SwiGLU hidden width; None derives it as in Llama: 2/3 * 4 * dim rounded up to `multiple_of`."""
    multiple_of: int = 256
    """Rounding for the derived ffn_hidden_dim (keeps matrix shapes GPU friendly)."""
    max_seq_len: int = 256
    """Longest sequence the rotary table covers; the data's seq_len must not exceed it."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init; output projections of each block are scaled down by depth."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def problems(self) -> list[str]:
        """Every inconsistency in these dimensions, phrased for the user (empty when valid)."""
        out = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                out.append(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads > 0 and self.dim % self.n_heads:
            out.append(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        elif self.n_heads > 0 and self.head_dim % 2:
            out.append(f"model.dim / model.n_heads = {self.head_dim} must be even for rotary embeddings")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            out.append(f"model.n_kv_heads={self.n_kv_heads} must be positive and divide model.n_heads={self.n_heads}")
        if self.ffn_hidden_dim is not None and self.ffn_hidden_dim <= 0:
            out.append(f"model.ffn_hidden_dim must be positive, got {self.ffn_hidden_dim}")
        return out

    def _block_matmul_params(self) -> int:
        d, kv = self.dim, self.num_kv_heads * self.head_dim
        return (2 * d * d + 2 * d * kv) + 3 * d * self.hidden_dim  # wq, wo, wk, wv; gate, up, down

    def num_params(self) -> int:
        """Parameter count from the formula (the model test checks the module against it)."""
        per_block = self._block_matmul_params() + 2 * self.dim  # + two RMSNorm weights
        embed = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_block + embed + output + self.dim  # + final norm

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 x forward, forward = 2 x matmul params + attention scores.

        The input embedding is a lookup (no FLOPs); the output projection is a matmul whether tied or
        not. Causal attention is counted in full (QK^T and AV: 2 * 2 * seq_len * dim per layer), as
        the usual MFU accounting does.
        """
        matmul_params = self.n_layers * self._block_matmul_params() + self.vocab_size * self.dim
        attention = 2 * 2 * self.n_layers * seq_len * self.dim
        return 3 * (2 * matmul_params + attention)
