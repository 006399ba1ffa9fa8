"""The model's sizes the estimate needs, from the config alone (no model is built): its parameters (counted role by
role from the dimensions of model/transformer.py's blocks and checked against ModelConfig.num_params), the FLOPs per
token of the project's own count (fsdp_utils/parallel/build.describe_model), and the matmuls of a block by role, as
the activation checkpointing policies name them (fsdp_utils/parallel/parallelize.py)."""
from __future__ import annotations

import copy
from dataclasses import dataclass

from config import Config
from model import ModelConfig

from ...parallel.build import describe_model


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    dim: int
    kv_dim: int
    """Key (and value) width: n_kv_heads x head_dim."""
    hidden: int
    """SwiGLU width."""
    n_heads: int
    head_dim: int
    vocab: int
    seq_len: int
    tied: bool
    params: int
    """All parameters, tied embeddings once."""
    block_params: int
    """Parameters of one DecoderBlock (its matmuls and two norm weights)."""
    role_params: dict[str, int]
    """Parameters of each matmul of a block, by role (q, k, v, o, gate, up, down)."""
    flops_per_token: float
    """Training FLOPs per token as MFU counts them (describe_model): 6 x matmul parameters + 12 x layers x seq x dim."""

    @property
    def block_matmul_params(self) -> int:
        return sum(self.role_params.values())

    @property
    def muon_block_parameters(self) -> tuple[tuple[tuple[int, int], tuple[int, ...]], ...]:
        """One block's weights as train.optimizer=muon takes them, in the block's order: each parameter's (rows, cols)
        and the row counts of the matrices stacked in it (wqkv: q, k, v; wo; w13: gate, up; w2)."""
        q, d, kv, h = self.n_heads * self.head_dim, self.dim, self.kv_dim, self.hidden
        return ((q + 2 * kv, d), (q, kv, kv)), ((d, q), (d,)), ((2 * h, d), (h, h)), ((d, h), (d,))

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.dim

    @property
    def edge_params(self) -> int:
        """Parameters outside the blocks: the embedding, the output projection unless tied, the final norm."""
        return self.params - self.n_layers * self.block_params

    @property
    def attention_flops_per_token(self) -> float:
        """The attention part of flops_per_token (causal attention counted in full, as MFU does)."""
        return 12.0 * self.n_layers * self.seq_len * self.dim


def model_shape(cfg: Config, vocab_size: int | None = None) -> ModelShape:
    """The shape of cfg.model (model.type llama) at data.seq_len. `vocab_size`: the tokenizer's, for a config whose
    model.vocab_size is 0 (take the tokenizer's); by default data.vocab_size, the SentencePiece model it trains."""
    m = cfg.model
    vocab = m.vocab_size or vocab_size or cfg.data.vocab_size
    plain = ModelConfig(**{name: getattr(m, name) for name in ModelConfig.__dataclass_fields__})
    plain.vocab_size = vocab
    d, kv, hidden, heads = plain.dim, plain.num_kv_heads * plain.head_dim, plain.hidden_dim, plain.n_heads
    q = heads * plain.head_dim
    roles = {"q": d * q, "k": d * kv, "v": d * kv, "o": q * d, "gate": d * hidden, "up": d * hidden, "down": hidden * d}
    block = sum(roles.values()) + 2 * d  # + the two RMSNorm weights
    params = plain.n_layers * block + vocab * d * (1 if plain.tie_embeddings else 2) + d  # + the final norm
    assert params == plain.num_params(), "the block's roles no longer add up to ModelConfig.num_params"
    probe = copy.deepcopy(cfg)
    probe.model.vocab_size = vocab
    _, _, flops = describe_model(probe, vocab)
    return ModelShape(n_layers=plain.n_layers, dim=d, kv_dim=kv, hidden=hidden, n_heads=heads,
                      head_dim=plain.head_dim, vocab=vocab, seq_len=cfg.data.seq_len, tied=plain.tie_embeddings,
                      params=params, block_params=block, role_params=roles, flops_per_token=flops)
