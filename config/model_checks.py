"""The checks of our model's dimensions (a ModelConfig), each problem phrased for the user and naming its model.*
field: the config's model section, a checkpoint's saved model_config and an imported Hugging Face model's
dimensions all go through `model_problems`."""
from __future__ import annotations

import dataclasses

from model import ModelConfig
from model.config import ROPE_SCALING_FIELDS

from .errors import range_problems

# Upper bounds that catch a typo (1e9) before it becomes a failed allocation. Real vocabularies reach 2**18
# pieces; at 2**24 every token id is still exact in fp32, and the embedding (vocab x dim in fp32) stays
# allocatable on a host at the small dims where a typo would otherwise slip through.
MAX_VOCAB_SIZE = 2**24
# Contexts of released models reach 2**20 tokens; each rank holds two (max_seq_len x head_dim) fp32 rotary
# tables, and this library has no context parallelism for longer ones.
MAX_SEQ_LEN = 2**20
# Widths and depth far past any released model's: a typo, named here, instead of an integer overflow or an
# allocation of terabytes while building.
MAX_DIM = 2**20
MAX_FFN_HIDDEN_DIM = 2**22
MAX_LAYERS = 2**16


def model_problems(m: ModelConfig) -> list[str]:
    """Every inconsistency in these dimensions, phrased for the user (empty when valid)."""
    out = _shape_problems(m) + _size_limit_problems(m)
    # theta <= 1 makes the rotary frequencies theta^(-2i/d) grow instead of fall (towards inf at 0: NaN).
    if not m.rope_theta > 1:
        out.append(f"model.rope_theta must be greater than 1, got {m.rope_theta}")
    out += _rope_scaling_problems(m)
    # norm_eps: RMSNorm divides by sqrt(mean(x^2) + eps): NaN at 0 on a zero input, or below.
    return out + range_problems(m, "model", norm_eps="> 0", init_std="> 0")


def _shape_problems(m: ModelConfig) -> list[str]:
    """Sizes that are not positive, and heads that do not divide the width."""
    out = range_problems(m, "model", vocab_size="> 0", dim="> 0", n_layers="> 0", n_heads="> 0", max_seq_len="> 0")
    if m.n_heads > 0 and m.dim % m.n_heads:
        out.append(f"model.dim={m.dim} must be divisible by model.n_heads={m.n_heads}")
    elif m.n_heads > 0 and m.head_dim % 2:
        out.append(f"model.dim / model.n_heads = {m.head_dim} must be even for rotary embeddings")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        out.append(f"model.n_kv_heads={m.n_kv_heads} must be positive and divide model.n_heads={m.n_heads}")
    if m.ffn_hidden_dim is not None and m.ffn_hidden_dim <= 0:
        out.append(f"model.ffn_hidden_dim must be positive, got {m.ffn_hidden_dim}")
    if m.multiple_of <= 0:
        out.append(f"model.multiple_of must be positive (it rounds the derived ffn_hidden_dim), got {m.multiple_of}")
    return out


def _size_limit_problems(m: ModelConfig) -> list[str]:
    """Sizes over the largest this library builds."""
    limits = (("dim", MAX_DIM, "2**20"), ("n_layers", MAX_LAYERS, "2**16"),
              ("ffn_hidden_dim", MAX_FFN_HIDDEN_DIM, "2**22"), ("multiple_of", MAX_FFN_HIDDEN_DIM, "2**22"),
              ("vocab_size", MAX_VOCAB_SIZE, "2**24"), ("max_seq_len", MAX_SEQ_LEN, "2**20"))
    return [f"model.{name} must be at most {text} = {limit}, got {getattr(m, name)}"
            for name, limit, text in limits if (getattr(m, name) or 0) > limit]


def _rope_scaling_problems(m: ModelConfig) -> list[str]:
    if m.rope_scaling_factor is None:
        # The other fields mean nothing without a factor: set without one, they would be silently ignored.
        return [f"model.{f.name}={getattr(m, f.name)} needs model.rope_scaling_factor (Llama 3 rotary scaling)"
                for f in dataclasses.fields(ModelConfig)
                if f.name in ROPE_SCALING_FIELDS and getattr(m, f.name) != f.default]
    out = []
    if not m.rope_scaling_factor >= 1:  # below 1 it would shorten wavelengths, which no model does
        out.append(f"model.rope_scaling_factor must be at least 1, got {m.rope_scaling_factor}")
    if not m.rope_low_freq_factor > 0:
        out.append(f"model.rope_low_freq_factor must be positive, got {m.rope_low_freq_factor}")
    if not m.rope_high_freq_factor > m.rope_low_freq_factor:  # the interpolation divides by their difference
        out.append(f"model.rope_high_freq_factor must be greater than model.rope_low_freq_factor="
                   f"{m.rope_low_freq_factor}, got {m.rope_high_freq_factor}")
    if m.rope_original_max_seq_len <= 0:
        out.append(f"model.rope_original_max_seq_len must be positive, got {m.rope_original_max_seq_len}")
    return out
