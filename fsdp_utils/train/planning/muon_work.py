"""What train.optimizer=muon gives each GPU of a shard group, with its matrices given to owners as muon.py gives them:
the Newton-Schulz FLOPs it runs a step, the matrix parameters it owns and its largest Newton-Schulz batch (speed.py
times the first, memory.py holds the others' buffers)."""
from __future__ import annotations

import functools
import math

from ..muon import assign_owners, matrices_per_batch
from .shape import ModelShape


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Newton-Schulz's FLOPs on one matrix, oriented (m, n) with m <= n: per iteration X X^T (2 m^2 n), the
    polynomial's G G (2 m^3) and its product with X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def muon_load(shape: ModelShape, group: int, ns_steps: int) -> tuple[int, int]:
    """The busiest GPU of a shard group of `group` under train.optimizer=muon, whose matrices are given to owners as
    muon.py gives them: (the most Newton-Schulz FLOPs a GPU runs a step, the most matrix parameters a GPU owns)."""
    return _muon_load(shape.muon_block_parameters, shape.n_layers, group, ns_steps)


@functools.cache
def _muon_load(block: tuple[tuple[tuple[int, int], tuple[int, ...]], ...], n_layers: int, group: int,
               ns_steps: int) -> tuple[int, int]:
    parameters = list(block) * n_layers
    flops, owned = [0] * group, [0] * group
    for ((rows, cols), splits), owner in zip(parameters, assign_owners(parameters, group), strict=True):
        flops[owner] += sum(ns_flops(r, cols, ns_steps) for r in splits)
        owned[owner] += rows * cols
    return max(flops), max(owned)


def ns_batch_elements(shape: ModelShape, group: int) -> int:
    """Elements alive in the largest Newton-Schulz batch a GPU of a shard group of `group` runs: for each oriented
    shape (short, long), its batch (muon.matrices_per_batch, no more than the GPU's share of that shape's matrices)
    holds three tensors of short x long (the stack, X and the next X) and two short x short (the Gram matrix and the
    polynomial) a matrix."""
    counts: dict[tuple[int, int], int] = {}
    for (_, cols), splits in shape.muon_block_parameters:
        for rows in splits:
            key = (min(rows, cols), max(rows, cols))
            counts[key] = counts.get(key, 0) + shape.n_layers
    return max(min(matrices_per_batch(short, long), math.ceil(count / group)) * (3 * short * long + 2 * short**2)
               for (short, long), count in counts.items())
