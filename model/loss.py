"""The training loss: cross-entropy of the output projection's logits, whole or a chunk of tokens at a time with
the gradients made in forward (the chunked loss), and the reductions the trainers use."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Targets with this value are not trained on (a fine-tuning prompt, say): torch's cross_entropy default.
IGNORE_INDEX = -100


def _cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Cross-entropy in fp32 for a stable log-sum-exp whatever the compute dtype; IGNORE_INDEX targets add 0.
    return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)


def reduce_loss(total: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """A summed loss as asked: "sum" as it is, "mean" divided by the targets that count (at least 1, so a
    window whose targets are all ignored gives 0, not NaN). Without ignored targets the count is numel()."""
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise ValueError(f"loss reduction must be mean or sum, got {reduction!r}")
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int,
                          chunk_loss_fn=None, make_matmuls: Callable | None = None,
                          reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits h @ weight.T (h: (N, D), weight: (V, D), targets: (N,)), summed over the
    targets that are not IGNORE_INDEX, then reduced by reduce_loss (mean: over those targets).

    With chunk_tokens > 0 the (N, V) logits never exist at once: see _ChunkedLinearCrossEntropy, which
    calls chunk_loss_fn (default chunk_loss_and_grad; a torch.compile'd copy of it is faster) per chunk.
    `make_matmuls` (h, weight) -> the chunked loss's matmuls, where not ProjectionMatmuls: the FP8 output
    projection's (model/float8_projection.py, with its own chunk_loss_fn) trains through the chunked loss
    whatever chunk_tokens is (0: one chunk); without gradients (evaluation) the loss is computed as without it.
    """
    training = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if make_matmuls is not None and training:
        assert chunk_loss_fn is not None, "make_matmuls comes with the chunk loss function its matmuls take"
        total = _ChunkedLinearCrossEntropy.apply(h, weight, targets, chunk_tokens if chunk_tokens > 0 else h.shape[0],
                                                 chunk_loss_fn, make_matmuls)
        return reduce_loss(total, targets, reduction)
    if chunk_tokens <= 0 or h.shape[0] <= chunk_tokens:
        return reduce_loss(_cross_entropy_sum(h, weight, targets), targets, reduction)
    if not training:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for hc, tc in zip(h.split(chunk_tokens), targets.split(chunk_tokens), strict=True):
            total = total + _cross_entropy_sum(hc, weight, tc)
        return reduce_loss(total, targets, reduction)
    total = _ChunkedLinearCrossEntropy.apply(h, weight, targets, chunk_tokens, chunk_loss_fn or chunk_loss_and_grad,
                                             ProjectionMatmuls)
    return reduce_loss(total, targets, reduction)


def chunk_loss_and_grad_fp32(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of one chunk's logits (n, V), in fp32, and its gradient with respect to the logits
    (softmax - one-hot), in fp32; IGNORE_INDEX targets add nothing to either."""
    logits32 = logits.float()
    counted = targets != IGNORE_INDEX
    safe_targets = torch.where(counted, targets, 0)  # gather needs a valid index; its row is zeroed below
    lse = torch.logsumexp(logits32, dim=-1)
    loss = torch.where(counted, lse - logits32.gather(1, safe_targets[:, None]).squeeze(1), 0.0).sum()
    is_target = torch.arange(logits.shape[1], device=logits.device)[None, :] == safe_targets[:, None]
    grad = torch.where(counted[:, None], torch.exp(logits32 - lse[:, None]) - is_target.to(torch.float32), 0.0)
    return loss, grad


def chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_loss_and_grad_fp32 with the gradient in the logits' dtype. Elementwise work only: torch.compile
    turns it into a couple of kernels that read the logits once."""
    loss, grad = chunk_loss_and_grad_fp32(logits, targets)
    return loss, grad.to(logits.dtype)


VOCAB_SLICES = 8  # where a chunk's weight gradient is a product apart from the sum: added in this many slices


def vocab_slices(vocab_size: int, *, multiple: int) -> list[slice]:
    """VOCAB_SLICES slices of the vocabulary, each a multiple of `multiple` rows but the last (FP8 matmuls take
    sizes in multiples of 16)."""
    size = -(-vocab_size // (VOCAB_SLICES * multiple)) * multiple
    return [slice(start, start + size) for start in range(0, vocab_size, size)]


class ProjectionMatmuls:
    """The chunked loss's three matmuls with the output weight, in the weight's dtype: a chunk's logits, the
    gradient of its h (written into its rows of the whole), and its part of the weight's gradient, which the
    matmul adds to the fp32 sum itself on GPUs (on the CPU, which has no mixed-precision matmul, a slice of the
    vocabulary at a time: the product in compute precision is then an eighth of the output projection, not a whole
    one beside the sum). `grad` is what the chunk loss function returned as the logits' gradient."""

    alignment = 1  # of the vocabulary slices

    def __init__(self, h: torch.Tensor, weight: torch.Tensor):
        self.h, self.weight = h, weight

    def logits(self, rows: slice) -> torch.Tensor:
        return F.linear(self.h[rows], self.weight)

    def grad_input(self, grad: torch.Tensor, out: torch.Tensor) -> None:
        torch.mm(grad, self.weight, out=out)

    def add_grad_weight(self, out: torch.Tensor, grad: torch.Tensor, rows: slice, slices: list[slice]) -> None:
        h_chunk = self.h[rows]
        if out.dtype == h_chunk.dtype:
            out.addmm_(grad.t(), h_chunk)
        elif out.is_cuda:  # cuBLAS adds the product to the fp32 sum in its epilogue: no product tensor, no add
            torch.addmm(out, grad.t(), h_chunk, out_dtype=out.dtype, out=out)
        else:  # no mixed-precision matmul on the CPU
            for vocab in slices:
                out[vocab].add_(grad[:, vocab].t() @ h_chunk)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of h @ weight.T, one chunk of tokens at a time, gradients included.

    The output projection's logits are the largest activation of a small model with a large
    vocabulary: N x V in fp32, and as much again for their gradient. Each chunk's logits are made,
    turned into the chunk's loss and its gradients for h and weight (softmax - one-hot, then two
    matmuls) and dropped, all in forward; backward only scales the stored gradients. That needs no
    recomputation of the logits, so it costs no more matmuls than the unchunked loss. `make_matmuls(h, weight)`:
    ProjectionMatmuls, or its FP8 counterpart (model/float8_projection.py).
    """

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_tokens, chunk_loss_fn, make_matmuls):
        # A frozen output weight (LoRA) gets no gradient: neither its V x D fp32 sum nor a third of the matmuls.
        wants_h, wants_weight = ctx.needs_input_grad[:2]
        matmuls = make_matmuls(h, weight)
        # Contiguous (empty_like would keep h's strides): each chunk's matmul writes its rows in place.
        grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if wants_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        slices = vocab_slices(weight.shape[0], multiple=matmuls.alignment)
        for start in range(0, h.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            loss, grad_logits = chunk_loss_fn(matmuls.logits(rows), targets[rows])
            total += loss
            if grad_h is not None:
                matmuls.grad_input(grad_logits, out=grad_h[rows])
            if grad_weight is not None:
                matmuls.add_grad_weight(grad_weight, grad_logits, rows, slices)
        # Kept in the weight's dtype, as grad_h is: the fp32 sum (twice the bytes of a bf16 output projection) is
        # freed before backward, which starts at the peak of the activations.
        ctx.save_for_backward(grad_h, None if grad_weight is None else grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return (*(None if grad is None else grad * grad_total.to(grad.dtype) for grad in ctx.saved_tensors),
                None, None, None, None)
