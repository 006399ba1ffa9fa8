"""Shape of the decoder-only transformer. Plain data: no torch.distributed here."""
from __future__ import annotations

from dataclasses import dataclass, fields

# Upper bounds that catch a typo (1e9) before it becomes a failed allocation. Real vocabularies reach 2**18
# (256k pieces); at 2**24 every token id is still exact in fp32 and the embedding (vocab x dim fp32) is
# 64 MiB per unit of dim, allocatable on a host at the small dims where a typo would otherwise slip through.
MAX_VOCAB_SIZE = 2**24
# Contexts of released models reach 2**20 tokens; each rank holds two (max_seq_len x head_dim) fp32 rotary
# tables, 1 GiB at that length and head_dim 128, and this library has no context parallelism for longer.
MAX_SEQ_LEN = 2**20
# Widths and depth far past any model's (the largest have dim 2**14, an MLP under 2**16 wide, a few hundred
# layers): a typo, named here, instead of an integer overflow or an allocation of terabytes while building.
MAX_DIM = 2**20
MAX_FFN_HIDDEN_DIM = 2**22
MAX_LAYERS = 2**16
# The settings of Llama 3's rotary scaling besides rope_scaling_factor, which switches it on.
ROPE_SCALING_FIELDS = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")


@dataclass
class ModelConfig:
    """Dimensions of a Llama-style decoder. Field names match the `model` section of the YAML."""

    vocab_size: int = 4096
    """Token vocabulary size, at most 2**24; 0 in a YAML file means: take it from the tokenizer."""
    dim: int = 256
    """Width of the residual stream, at most 2**20."""
    n_layers: int = 4
    """Number of DecoderBlocks, at most 2**16."""
    n_heads: int = 4
    """Attention (query) heads; dim must divide by it."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    ffn_hidden_dim: int | None = None
    """SwiGLU hidden width, at most 2**22; None derives it as in Llama: 2/3 * 4 * dim rounded up to `multiple_of`."""
    multiple_of: int = 256
    """Rounding for the derived ffn_hidden_dim (keeps matrix shapes GPU friendly); positive, at most 2**22."""
    max_seq_len: int = 256
    """Longest sequence the rotary table covers, at most 2**20; the data's seq_len must not exceed it."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies; greater than 1."""
    rope_scaling_factor: float | None = None
    """Llama 3's rotary scaling (Llama 3.1 and 3.2; rope_type llama3 in Hugging Face configs), at least 1: frequencies
    whose wavelength exceeds rope_original_max_seq_len / rope_low_freq_factor are divided by it, those below
    rope_original_max_seq_len / rope_high_freq_factor are kept, those between are interpolated. None: plain rotary
    embeddings."""
    rope_low_freq_factor: float = 1.0
    """With rope_scaling_factor: wavelengths above rope_original_max_seq_len / this are scaled fully; positive."""
    rope_high_freq_factor: float = 4.0
    """With rope_scaling_factor: wavelengths below rope_original_max_seq_len / this are kept; greater than
    rope_low_freq_factor."""
    rope_original_max_seq_len: int = 8192
    """With rope_scaling_factor: the context length the model was pretrained at before scaling; positive."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon; positive."""
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

    @property
    def llama3_scaling(self) -> dict | None:
        """Llama 3's rotary scaling as model.transformer.llama3_scaled takes it; None without scaling."""
        if self.rope_scaling_factor is None:
            return None
        return {"factor": self.rope_scaling_factor, "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor, "original_max_seq_len": self.rope_original_max_seq_len}

    def problems(self) -> list[str]:
        """Every inconsistency in these dimensions, phrased for the user (empty when valid)."""
        out = self._shape_problems() + self._size_limit_problems()
        # theta <= 1 makes the rotary frequencies theta^(-2i/d) grow instead of fall (towards inf at 0: NaN).
        if not self.rope_theta > 1:
            out.append(f"model.rope_theta must be greater than 1, got {self.rope_theta}")
        out += self._rope_scaling_problems()
        if not self.norm_eps > 0:  # RMSNorm divides by sqrt(mean(x^2) + eps): NaN at 0 on a zero input, or below
            out.append(f"model.norm_eps must be positive, got {self.norm_eps}")
        if not self.init_std > 0:
            out.append(f"model.init_std must be positive, got {self.init_std}")
        return out

    def _shape_problems(self) -> list[str]:
        """Sizes that are not positive, and heads that do not divide the width."""
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
        if self.multiple_of <= 0:
            out.append("model.multiple_of must be positive (it rounds the derived ffn_hidden_dim), "
                       f"got {self.multiple_of}")
        return out

    def _size_limit_problems(self) -> list[str]:
        """Sizes over the largest this library builds."""
        limits = (("dim", MAX_DIM, "2**20"), ("n_layers", MAX_LAYERS, "2**16"),
                  ("ffn_hidden_dim", MAX_FFN_HIDDEN_DIM, "2**22"), ("multiple_of", MAX_FFN_HIDDEN_DIM, "2**22"),
                  ("vocab_size", MAX_VOCAB_SIZE, "2**24"), ("max_seq_len", MAX_SEQ_LEN, "2**20"))
        return [f"model.{name} must be at most {text} = {limit}, got {getattr(self, name)}"
                for name, limit, text in limits if (getattr(self, name) or 0) > limit]

    def _rope_scaling_problems(self) -> list[str]:
        if self.rope_scaling_factor is None:
            # The other fields mean nothing without a factor: set without one, they would be silently ignored.
            return [f"model.{f.name}={getattr(self, f.name)} needs model.rope_scaling_factor (Llama 3 rotary scaling)"
                    for f in fields(self) if f.name in ROPE_SCALING_FIELDS and getattr(self, f.name) != f.default]
        out = []
        if not self.rope_scaling_factor >= 1:  # below 1 it would shorten wavelengths, which no model does
            out.append(f"model.rope_scaling_factor must be at least 1, got {self.rope_scaling_factor}")
        if not self.rope_low_freq_factor > 0:
            out.append(f"model.rope_low_freq_factor must be positive, got {self.rope_low_freq_factor}")
        # The interpolation divides by their difference.
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:
            out.append(f"model.rope_high_freq_factor must be greater than model.rope_low_freq_factor="
                       f"{self.rope_low_freq_factor}, got {self.rope_high_freq_factor}")
        if self.rope_original_max_seq_len <= 0:
            out.append(f"model.rope_original_max_seq_len must be positive, got {self.rope_original_max_seq_len}")
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
