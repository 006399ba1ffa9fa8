"""Time the orthogonalization of one Muon step (every block matrix of a config's model) on one GPU, batched four ways:

    python benchmarks/bench_muon.py config/train1B_fsdp.yaml            # any --model.* override after the config

`batched` is what MuonAdamW runs: the matrices of one (oriented) shape in chains of bmm calls of up to
`NS_BATCH_ELEMENTS` elements each; `by_shape` all of one shape in one chain, however large; `per_parameter` one
chain per parameter (wqkv's q, k and v, w13's gate and up split as MuonAdamW splits them); `per_matrix` one chain
per matrix. Each in bf16 (what GPU runs use) and fp32, in place (each repeat orthogonalizes the last one's result,
which costs the same). Prints ms per step and TFLOP/s; the optimizer step's share of a training step is
benchmark.py --muon's. Results: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from config import ConfigError, load_config
from fsdp_utils.train.muon import NS_COEFFICIENTS, _Matrix, _orthogonalize_whole, split_parameters
from fsdp_utils.train.planning.muon_work import ns_flops
from model.transformer import DecoderBlock

NS_STEPS = 5


def block_matrices(config: str, overrides: list[str]) -> tuple[list[tuple[int, int]], list[tuple[int, ...]]]:
    """The shape of every Muon parameter of the config's blocks and the matrices (row counts) stacked in each."""
    cfg = load_config(config, overrides)
    with torch.device("meta"):
        blocks = nn.ModuleList(DecoderBlock(cfg.model) for _ in range(cfg.model.n_layers))
    split = split_parameters(blocks, blocks)
    shapes = [(p.shape[0], p.shape[1]) for p in split.matrices]
    return shapes, [split.row_splits.get(p, (p.shape[0],)) for p in split.matrices]


def ms_of(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median of `repeats` timed calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s CONFIG [--model.*=...]")
    parser.add_argument("config")
    parser.add_argument("--repeats", type=int, default=10)
    args, overrides = parser.parse_known_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        shapes, splits = block_matrices(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    key = (NS_STEPS, NS_COEFFICIENTS, 1e-7)
    matrices = [_Matrix(shape, rows, key, []) for shape, rows in zip(shapes, splits, strict=True)]
    pieces = [(rows, shape[1]) for shape, split in zip(shapes, splits, strict=True) for rows in split]
    flops = sum(ns_flops(rows, cols, NS_STEPS) for rows, cols in pieces)
    print(f"{args.config}: {len(shapes)} parameters, {len(pieces)} matrices, "
          f"{sum(r * c for r, c in shapes) / 1e6:,.0f}M weights, {flops / 1e12:.2f} TFLOP of Newton-Schulz a step")
    for dtype in (torch.bfloat16, torch.float32):
        updates = {i: torch.randn(shape, device=device, dtype=dtype) for i, shape in enumerate(shapes)}
        ways = orthogonalize_ways(updates, matrices, splits, key)
        for name, fn in ways.items():
            ms = ms_of(fn, args.repeats, device)
            print(f"{str(dtype).removeprefix('torch.'):>8} {name:<14} {ms:8.2f} ms  {flops / ms / 1e9:7.1f} TFLOP/s",
                  flush=True)
    return 0


def orthogonalize_ways(updates: dict[int, torch.Tensor], matrices: list[_Matrix], splits: list[tuple[int, ...]],
                       key: tuple) -> dict[str, Callable[[], object]]:
    """The four ways of batching, each a call that orthogonalizes every matrix of `updates` once."""
    def batched() -> object:
        return _orthogonalize_whole(dict(updates), matrices)

    def by_shape() -> object:
        return _orthogonalize_whole(dict(updates), matrices, batch_elements=sum(x.numel() for x in updates.values()))

    def per_parameter() -> object:
        return [_orthogonalize_whole({i: x}, matrices) for i, x in updates.items()]

    def per_matrix() -> object:
        return [_orthogonalize_whole({0: x[lo:lo + rows]}, [_Matrix((rows, x.shape[1]), (rows,), key, [])])
                for i, x in updates.items() for lo, rows in zip(_starts(splits[i]), splits[i], strict=True)]

    return {"batched": batched, "by_shape": by_shape, "per_parameter": per_parameter, "per_matrix": per_matrix}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _starts(splits: tuple[int, ...]) -> list[int]:
    return [sum(splits[:k]) for k in range(len(splits))]


if __name__ == "__main__":
    sys.exit(main())
