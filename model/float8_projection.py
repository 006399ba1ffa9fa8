"""The output projection and its loss in FP8 (train.float8_output): the chunked loss's three matmuls with
torch._scaled_mm instead of in the weight's dtype.

The final norm's output h and the output weight are cast to e4m3 with one scale each (tensorwise, from
their amax); each chunk's logit gradient (softmax - one-hot) to e5m2 with a fixed scale: its entries lie
in [-1, 1], so 2^14 puts 1 under e5m2's largest value (57,344) and keeps probabilities down to 2^-30,
with no amax to reduce. The logits come out in h's dtype and the weight's gradient in fp32, as in the
chunked loss without FP8. _scaled_mm takes its first operand row-major and its second column-major, and
sizes in multiples of 16: hence the transposed copies below and the checks of train.float8_output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .loss import chunk_loss_and_grad_fp32

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
LOGIT_GRAD_SCALE = 2.0**14
FLOAT8_ALIGNMENT = 16  # _scaled_mm's sizes (tokens, model width, vocabulary, a vocabulary slice)


def float8_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in e4m3 with one scale, and the inverse of that scale (what _scaled_mm multiplies back)."""
    amax = x.abs().amax().float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.reciprocal()


def chunk_loss_and_float8_grad(logits: torch.Tensor,
                               targets: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """chunk_loss_and_grad with the logits' gradient in e5m2 at LOGIT_GRAD_SCALE, row-major and transposed
    (the two layouts its matmuls take): compiled, one pass over the logits writes both."""
    loss, grad = chunk_loss_and_grad_fp32(logits, targets)
    grad8 = (grad * LOGIT_GRAD_SCALE).to(torch.float8_e5m2)
    return loss, (grad8, grad8.t().contiguous())


@dataclass(frozen=True)
class Float8Projection:
    """The functions the FP8 output projection runs: the e4m3 cast and the per-chunk loss (compiled copies
    of the two above with train.compile)."""
    cast: Callable = float8_e4m3
    chunk_loss: Callable = chunk_loss_and_float8_grad

    def matmuls(self, h: torch.Tensor, weight: torch.Tensor) -> Float8ProjectionMatmuls:
        return Float8ProjectionMatmuls(h, weight, cast=self.cast)


class Float8ProjectionMatmuls:
    """The chunked loss's matmuls (see ProjectionMatmuls in model/loss.py) in FP8: h and the weight cast once per
    forward, the weight also transposed once (grad_input's column-major operand)."""

    alignment = FLOAT8_ALIGNMENT  # of the vocabulary slices

    def __init__(self, h: torch.Tensor, weight: torch.Tensor, *, cast: Callable = float8_e4m3):
        self.dtype = h.dtype
        self.h8, self.h_inverse = cast(h)
        self.w8, self.w_inverse = cast(weight)
        self.w8_t = self.w8.t().contiguous()
        # torch.full: a fill on the GPU, where torch.tensor would copy from the host and wait for the GPU
        self.grad_inverse = torch.full((), 1.0 / LOGIT_GRAD_SCALE, dtype=torch.float32, device=h.device)

    def logits(self, rows: slice) -> torch.Tensor:
        return torch._scaled_mm(self.h8[rows], self.w8.t(), scale_a=self.h_inverse, scale_b=self.w_inverse,
                                out_dtype=self.dtype)

    def grad_input(self, grad: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
        torch._scaled_mm(grad[0], self.w8_t.t(), scale_a=self.grad_inverse, scale_b=self.w_inverse,
                         out_dtype=self.dtype, out=out)

    def add_grad_weight(self, out: torch.Tensor, grad: tuple[torch.Tensor, torch.Tensor], rows: slice,
                        slices: list[slice]) -> None:
        h_chunk = self.h8[rows].t().contiguous().t()  # column-major
        for vocab in slices:
            out[vocab].add_(torch._scaled_mm(grad[1][vocab], h_chunk, scale_a=self.grad_inverse,
                                             scale_b=self.h_inverse, out_dtype=torch.float32))
