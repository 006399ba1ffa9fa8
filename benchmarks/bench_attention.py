"""Time one attention call (forward and backward) per kernel that document masking could use, on one GPU.

    python benchmarks/bench_attention.py                          # the 90M, 300M, 1B and 8B presets' shapes
    python benchmarks/bench_attention.py --doc_lens 0 600 2048    # windows without EOS, documents of ~600, ~2048

Kernels: `cudnn`, SDPA's causal kernel with no mask (an unmasked run's: the point of comparison); `flex`, what
data.document_masking runs; `varlen`, FlashAttention-2's variable-length kernel (where this torch has it). Prints
ms per call and each masked kernel's largest difference from Flex's output. Results: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

from model.documents import document_block_mask, document_ids, document_starts

EOS = 0
SHAPES = {  # name: (micro-batch, query heads, key/value heads, head dim) at the presets' choices
    "90M": (32, 12, 12, 64), "300M": (32, 16, 16, 64), "1B": (16, 16, 16, 128), "8B": (2, 32, 8, 128)}


def ms_per_call(fn: Callable[[], None], calls: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def packed_tokens(batch: int, T: int, doc_len: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 1000, (batch, T), generator=gen)
    if doc_len:
        tokens[torch.rand(batch, T, generator=gen) < 1 / doc_len] = EOS
    return tokens.cuda()


def cumulative_lengths(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> the start of every document in the flattened window, then B * T (int32)."""
    index = document_starts(doc_ids).flatten().nonzero().flatten()
    return torch.cat([index, index.new_tensor([doc_ids.numel()])]).to(torch.int32)


def varlen_kernel() -> Callable | None:
    """FlashAttention-2's varlen_attn made causal (its keyword changed between torch releases), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    causal = {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else \
        {"is_causal": True}
    return lambda q, k, v, cu, T: varlen_attn(q, k, v, cu, cu, T, T, **causal)


def bench_shape(batch: int, heads: int, kv_heads: int, head_dim: int, doc_lens: list[int], calls: int,
                flex, varlen) -> tuple[dict[str, float], dict[str, float]]:
    q = torch.randn(batch, heads, 2048, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, 2048, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn_like(q)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads).backward(grad)

    times, diffs = {"cudnn causal": ms_per_call(cudnn, calls)}, {}
    for doc_len in doc_lens:
        masked_times, diff = bench_documents(q, k, v, grad, doc_len, calls, flex, varlen)
        times.update(masked_times)
        if diff is not None:
            diffs[f"varlen {doc_len}"] = diff
    return times, diffs


def bench_documents(q, k, v, grad, doc_len: int, calls: int, flex,
                    varlen) -> tuple[dict[str, float], float | None]:
    """The masked kernels on documents of ~doc_len tokens: their ms per call, and varlen's largest
    difference from Flex's output (None without varlen)."""
    (batch, heads, T, head_dim), kv_heads = q.shape, k.shape[1]
    gqa = heads != kv_heads
    doc_ids = document_ids(packed_tokens(batch, T, doc_len), EOS)
    mask = document_block_mask(doc_ids)
    times = {f"flex {doc_len}": ms_per_call(lambda: flex(q, k, v, block_mask=mask, enable_gqa=gqa).backward(grad),
                                             calls)}
    if varlen is None:
        return times, None
    cu = cumulative_lengths(doc_ids)
    # (B, H, T, Hd) -> (B*T, H, Hd). Key/value heads are repeated for grouped-query attention (not every
    # torch's varlen_attn takes enable_gqa), once here, outside the timed calls.
    flat = [x.detach().transpose(1, 2).reshape(batch * T, x.shape[1], head_dim) for x in (q, k, v)]
    if gqa:
        flat[1:] = [x.repeat_interleave(heads // kv_heads, dim=1) for x in flat[1:]]
    fq, fk, fv = (x.requires_grad_() for x in flat)
    fgrad = grad.transpose(1, 2).reshape(batch * T, heads, head_dim)
    times[f"varlen {doc_len}"] = ms_per_call(lambda: varlen(fq, fk, fv, cu, T).backward(fgrad), calls)
    with torch.no_grad():
        ours = flex(q, k, v, block_mask=mask, enable_gqa=gqa).transpose(1, 2).reshape(batch * T, heads, head_dim)
        return times, (ours.float() - varlen(fq, fk, fv, cu, T).float()).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--doc_lens", nargs="+", type=int, default=[0, 600],
                        help="mean document length in tokens (0: no EOS)")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: benchmarks/bench_attention.py times GPU kernels and needs a CUDA GPU", file=sys.stderr)
        return 2
    flex = torch.compile(flex_attention, dynamic=False)
    varlen = varlen_kernel()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call (forward and backward)"
          + ("" if varlen else "; this torch has no varlen_attn"))
    for name in args.shapes:
        times, diffs = bench_shape(*SHAPES[name], args.doc_lens, args.calls, flex, varlen)
        print(f"{name:5} " + "  ".join(f"{k}: {v:.2f}" for k, v in times.items())
              + "".join(f"  max |flex - {k}|: {v:.1e}" for k, v in diffs.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
