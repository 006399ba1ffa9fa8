"""Fixed-length token windows addressed by a global sample index, plus a background prefetcher.

The sample order is a pure function of (seed, index), so every rank and every
resumed run agrees on it without communicating.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from .prepare import DataError


class TokenDataset:
    """Fixed-length windows over a flat token file, addressed by a GLOBAL sample index."""

    def __init__(self, path: Path | str, *, dtype, seq_len: int, seed: int, shuffle: bool = True) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if not self.path.is_file():
            raise DataError(f"token file not found: {self.path}")
        num_bytes = self.path.stat().st_size
        if num_bytes % self.dtype.itemsize:
            raise DataError(f"{self.path} is {num_bytes} bytes, not a whole number of {self.dtype.name} tokens")
        self.num_tokens = num_bytes // self.dtype.itemsize
        # Each window needs seq_len + 1 tokens (inputs plus the shifted target).
        self.num_windows = max(self.num_tokens - 1, 0) // seq_len
        if self.num_windows == 0:
            raise DataError(
                f"{self.path} holds {self.num_tokens} tokens, fewer than seq_len+1={seq_len + 1}"
            )
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        # (epoch, permutation) kept as one tuple so a reader on another thread sees a matching pair.
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_windows

    def _permutation(self, epoch: int) -> np.ndarray:
        cached = self._perm_cache
        if cached is not None and cached[0] == epoch:
            return cached[1]
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        self._perm_cache = (epoch, perm)
        return perm

    def window_start(self, index: int) -> int:
        """Token offset of the window that global sample `index` reads."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        epoch, position = divmod(index, self.num_windows)
        slot = int(self._permutation(epoch)[position]) if self.shuffle else position
        return slot * self.seq_len

    def window(self, index: int) -> np.ndarray:
        """seq_len+1 tokens (int64) for global sample `index`."""
        start = self.window_start(index)
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, first_index: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first_index .. first_index+num_samples-1 as (inputs, targets), each (num_samples, seq_len)."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        rows = np.empty((num_samples, self.seq_len + 1), dtype=np.int64)
        for row, index in enumerate(range(first_index, first_index + num_samples)):
            rows[row] = self.window(index)
        windows = torch.from_numpy(rows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class _Failure:
    """Carries an exception from the producer thread to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE = object()


class BatchPrefetcher:
    """Produces batches for a known sequence of first-indices on a background thread, pinned when CUDA."""

    def __init__(
        self,
        dataset: TokenDataset,
        indices: Iterable[int],
        *,
        num_samples: int,
        device: torch.device,
        depth: int = 2,
    ) -> None:
        self.dataset = dataset
        self.num_samples = num_samples
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(
            target=self._produce, args=(iter(indices),), name="batch-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, item) -> bool:
        # Poll so close() can stop a producer that is blocked on a full queue.
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, indices: Iterator[int]) -> None:
        try:
            for first_index in indices:
                if self._stop.is_set():
                    return
                inputs, targets = self.dataset.batch(first_index, self.num_samples)
                if self._pin:
                    inputs, targets = inputs.pin_memory(), targets.pin_memory()
                if not self._put((inputs, targets)):
                    return
            self._put(_DONE)
        except BaseException as error:  # noqa: BLE001 - every failure must reach the consumer
            self._put(_Failure(error))

    def __iter__(self) -> BatchPrefetcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        inputs, targets = item
        # Pinned source memory lets these copies overlap with compute on CUDA.
        return (
            inputs.to(self.device, non_blocking=self._pin),
            targets.to(self.device, non_blocking=self._pin),
        )

    def close(self) -> None:
        """Stop the producer thread and drop any batches it had queued."""
        self._stop.set()
        self._finished = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5.0)

    def __enter__(self) -> BatchPrefetcher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
