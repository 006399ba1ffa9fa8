"""Shape of the decoder-only transformer. Plain data: no torch.distributed here; its values are checked by
config/model_checks.py (model_problems), which every caller runs before building a model."""
from __future__ import annotations

from dataclasses import dataclass

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
