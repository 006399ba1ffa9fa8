"""Document boundaries inside a packed window: document ids, positions that restart at each document, and
the FlexAttention block mask that keeps attention inside a document.

Documents are joined by EOS; the token after an EOS starts a new document, so the ids come from the
input tokens alone and need nothing from the data pipeline. Shapes: B batch, T sequence, N = T / S blocks
of S tokens (FlexAttention's block size).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

# FlexAttention's default block size; its kernels tile queries and keys by it.
BLOCK_SIZE = 128


@dataclass(frozen=True)
class Documents:
    """What the model does with the documents of a packed window. How it computes, not what it is: never
    part of a checkpoint."""

    eos_id: int
    """The token that ends a document (the tokenizer's EOS)."""
    mask_attention: bool = True
    """Each token attends only to earlier tokens of its own document."""
    reset_positions: bool = False
    """Rotary positions count from 0 at each document's first token."""
    kernel: str = "auto"
    """flex: FlexAttention with a block mask (block-sparse: skips key blocks of other documents); sdpa:
    scaled_dot_product_attention with a dense (B, 1, T, T) mask; auto: flex on GPUs, sdpa elsewhere
    (FlexAttention has no backward on the CPU)."""


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) tokens -> (B, T) document index within the window, counting from 0. An EOS belongs to the
    document it ends: the count of EOS strictly before each token."""
    is_eos = (tokens == eos_id).to(torch.int32)
    return is_eos.cumsum(dim=1, dtype=torch.int32) - is_eos


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) bool, True at the first token of each document (every row starts one)."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) position of each token inside its document (0 at each start)."""
    T = doc_ids.shape[1]
    index = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = document_starts(doc_ids)
    # The start of each token's document: the latest start at or before it.
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_dense_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) boolean mask, True where a query may attend to a key: an
    earlier (or the same) token of its own document."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


def document_block_mask(doc_ids: torch.Tensor, block_size: int = BLOCK_SIZE) -> BlockMask:
    """The causal, same-document BlockMask of a (B, T) batch of non-decreasing document ids.

    Built from per-block document ranges in O(B * N^2), never the (B, T, T) mask: a key block before the
    query block is skipped when its documents all end before the query block's first, computed without
    the mask function when both blocks lie inside one document, and masked elementwise otherwise; the
    diagonal block is always masked (causal).
    """
    B, T = doc_ids.shape
    n = -(-T // block_size)
    # The last block padded with its last id: padded keys lie past T, where FlexAttention masks anyway.
    padded = torch.cat([doc_ids, doc_ids[:, -1:].expand(B, n * block_size - T)], dim=1)
    blocks = padded.view(B, n, block_size)
    first, last = blocks[..., 0], blocks[..., -1]  # (B, N): ids are non-decreasing inside a block
    q_first, q_last = first[:, :, None], last[:, :, None]  # query block i
    k_first, k_last = first[:, None, :], last[:, None, :]  # key block j
    index = torch.arange(n, device=doc_ids.device)
    before = index[None, :] < index[:, None]  # (N, N): j < i
    # For j < i, the key block's ids are all <= the query block's: they share a document only if the key
    # block's last one is the query block's first, and all tokens are in one document if the key
    # block's first is the query block's last.
    # A query block cut short by T stays elementwise-masked, as create_block_mask would have it.
    whole = ((index + 1) * block_size <= T)[:, None]
    full = before & whole & (k_first == q_last)
    partial = (before & (k_last == q_first) & ~full) | torch.eye(n, dtype=torch.bool, device=doc_ids.device)
    kv_num, kv_idx = _block_list(partial)
    full_num, full_idx = _block_list(full)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=same_document_causal, seq_lengths=(T, T))


def _block_list(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, N) chosen key blocks per query block -> their count (B, 1, N) and indices (B, 1, N, N),
    chosen ones first in increasing order (the rest are never read)."""
    count = chosen.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]
