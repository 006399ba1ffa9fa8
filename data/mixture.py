"""Training on several prepared folders at once (data.sources), each drawn in proportion to its weight.

The global sample indices are cut into blocks of BLOCK in which source s owns a fixed range of slots (its share of
the weights, the cumulative shares rounded so the ranges fill the block), and position p reads slot
bit_reverse(p): any aligned run of 2**k samples holds each source's share to within one sample. Slot j of block b
is source s's own sample b * (its slots) + j. A pure function of the global index, so a resumed run continues
exactly, on any number of ranks; validation mixes the sources' splits by the same weights."""
from __future__ import annotations

import bisect
import math
from pathlib import Path

import numpy as np
import torch

from .errors import DataError
from .loader import TokenDataset, _sample_range, samples_to_batch
from .store import META_NAME, PreparedData, data_format, format_problem, read_json

BLOCK_BITS = 10
BLOCK = 1 << BLOCK_BITS


def block_slots(weights: list[float]) -> list[int]:
    """Slots per source in a block of BLOCK: differences of the rounded-down cumulative shares."""
    shares, total = weights, sum(weights)
    if not math.isfinite(BLOCK * total):  # finite weights too large to add: the same shares, relative to the largest
        shares = [weight / max(weights) for weight in weights]
        total = sum(shares)
    bounds = [math.floor(BLOCK * sum(shares[: i + 1]) / total + 1e-9) for i in range(len(shares))]
    return [hi - lo for lo, hi in zip([0, *bounds[:-1]], bounds, strict=True)]


def _bit_reverse(position: int) -> int:
    return int(format(position, f"0{BLOCK_BITS}b")[::-1], 2)


class Mixture:
    """Windows drawn from several TokenDatasets by weight, addressed by a GLOBAL sample index."""

    def __init__(self, datasets: list[TokenDataset], weights: list[float]):
        self.datasets = datasets
        self.slots = block_slots(weights)
        self._starts = np.cumsum([0, *self.slots[:-1]]).tolist()
        self.num_tokens = sum(d.num_tokens for d in datasets)
        self.num_windows = sum(d.num_windows for d in datasets)  # an epoch: as many samples as the sources hold
        if 0 in self.slots:
            raise DataError(f"data.sources weights {weights} give a source no share of {BLOCK} samples")

    def locate(self, index: int) -> tuple[int, int]:
        """(source, that source's own sample index) for global sample `index`."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        block, position = divmod(index, BLOCK)
        slot = _bit_reverse(position)
        source = bisect.bisect_right(self._starts, slot) - 1
        return source, block * self.slots[source] + slot - self._starts[source]

    def window(self, index: int) -> np.ndarray:
        source, local = self.locate(index)
        return self.datasets[source].window(local)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        source, local = self.locate(index)
        return self.datasets[source].sample(local)

    def batch(self, first_index: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first_index .. first_index+num_samples-1 as (inputs, targets), each (num_samples, seq_len)."""
        return samples_to_batch([self.sample(i) for i in _sample_range(first_index, num_samples)])


def open_datasets(sources: list[tuple[PreparedData, float]], *, seq_len: int, seed: int):
    """(train, val) datasets: one prepared folder's, or a Mixture of several by weight."""
    train = [TokenDataset(p.train_files, dtype=p.dtype, seq_len=seq_len, seed=seed, mask_paths=p.train_mask_files,
                          hashes=p.hashes, vocab_size=p.vocab_size) for p, _ in sources]
    val = [TokenDataset(p.val_files, dtype=p.dtype, seq_len=seq_len, seed=seed, shuffle=False,
                        mask_paths=p.val_mask_files, hashes=p.hashes, vocab_size=p.vocab_size) for p, _ in sources]
    if len(sources) == 1:
        return train[0], val[0]
    weights = [weight for _, weight in sources]
    return Mixture(train, weights), Mixture(val, weights)


def source_problems(sources: list[tuple[str, float]], *, wanted_format: str = "text") -> list[str]:
    """Config problems of data.sources: missing or unprepared folders, bad weights, different tokenizers, a folder
    of another data.format."""
    problems, metas = [], []
    for i, (path, weight) in enumerate(sources):
        where = f"data.sources[{i}]"
        if not (weight > 0 and math.isfinite(weight)):
            problems.append(f"{where}.weight must be a positive number, got {weight}")
        meta_path = Path(path) / META_NAME
        if not meta_path.is_file():
            problems.append(f"{where}.path: {path} is not a prepared folder (no {META_NAME}); "
                            f"prepare it with scripts/prepare_data.py")
            continue
        try:
            metas.append((where, path, read_json(meta_path)))
        except DataError as err:
            problems.append(f"{where}.path: {err}")
            continue
        if (problem := format_problem(path, data_format(metas[-1][2]), wanted_format)) is not None:
            problems.append(f"{where}.path: {problem}")
    if not problems and 0 in block_slots([w for _, w in sources]):
        problems.append(f"data.sources: a weight below 1/{BLOCK} of the total gives its source no samples")
    for where, path, meta in metas[1:]:
        first_where, first_path, first = metas[0]
        for key in ("tokenizer_sha256", "vocab_size", "dtype"):
            if meta.get(key) != first.get(key):
                problems.append(f"{where}: {path} was prepared with another tokenizer than {first_where} "
                                f"({first_path}): {key} differs; prepare every source with the same "
                                f"data.tokenizer_model (e.g. {first_path}/{first.get('tokenizer_file')})")
                break
    return problems
