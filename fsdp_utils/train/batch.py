"""The batch split of a training step, computed in one place and passed on: each of the world's ranks
runs `grad_accum` micro-batches of `micro_batch_size` samples, and together they make the global batch."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from config import TrainConfig, check_batch_split
from data import BatchPrefetcher

from ..distributed import DistEnv


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class BatchSplit:
    global_batch_size: int
    world_size: int
    micro_batch_size: int

    def __post_init__(self):
        # A split from the config comes through from_config, which reports an impossible one to the user.
        assert self.global_batch_size % (self.micro_batch_size * self.world_size) == 0, self

    @classmethod
    def from_config(cls, t: TrainConfig, world_size: int, micro_batch: int) -> BatchSplit:
        """train.global_batch_size over `world_size` ranks in micro-batches of `micro_batch`; ConfigError (the
        config's check_batch_split, which launch_problems also runs) when it does not split whole."""
        check_batch_split(t, world_size, micro_batch=micro_batch)
        return cls(t.global_batch_size, world_size, micro_batch)

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def grad_accum(self) -> int:
        return self.per_rank // self.micro_batch_size

    def halved(self) -> BatchSplit | None:
        """The same samples in smaller micro-batches (for an out-of-memory retry): half the micro-batch, or for
        an odd size the largest divisor below half, so the accumulation stays whole; None at micro-batch 1."""
        smaller = [d for d in divisors(self.micro_batch_size) if d <= self.micro_batch_size // 2]
        return BatchSplit(self.global_batch_size, self.world_size, max(smaller)) if smaller else None

    def sample_indices(self, *, rank: int, first_step: int, samples_seen: int, max_steps: int) -> Iterator[int]:
        """Global sample index of the first sample of each of this rank's micro-batches, from `first_step`
        (at data position `samples_seen`) to `max_steps`: a step's samples are its global batch, split, so
        the order is the same on any world size and micro-batch."""
        for step in range(first_step, max_steps):
            start = samples_seen + (step - first_step) * self.global_batch_size
            for micro in range(self.grad_accum):
                yield start + (micro * self.world_size + rank) * self.micro_batch_size


class TrainBatches:
    """This rank's micro-batches from the resumed step to train.max_steps, at the current split, read ahead on a
    thread (data.BatchPrefetcher); `resplit` goes on at another split from the next step (an out-of-memory retry
    at half the micro-batch: the same samples)."""

    def __init__(self, dataset, env: DistEnv, split: BatchSplit, *, first_step: int, samples_seen: int,
                 max_steps: int):
        self.dataset, self.env, self.max_steps = dataset, env, max_steps
        self.split = split
        self._prefetcher = self._open(first_step, samples_seen)

    def _open(self, first_step: int, samples_seen: int) -> BatchPrefetcher:
        indices = self.split.sample_indices(rank=self.env.rank, first_step=first_step, samples_seen=samples_seen,
                                            max_steps=self.max_steps)
        return BatchPrefetcher(self.dataset, indices, num_samples=self.split.micro_batch_size, device=self.env.device)

    def resplit(self, split: BatchSplit, *, step: int, samples_seen: int) -> None:
        """From step `step` (0-based, at data position samples_seen) on, micro-batches of `split`."""
        self._prefetcher.close()
        self.split = split
        self._prefetcher = self._open(step, samples_seen)

    def __iter__(self) -> TrainBatches:
        return self

    def __next__(self):
        return next(self._prefetcher)

    def close(self) -> None:
        self._prefetcher.close()
