"""Fixed-length token windows over a sharded token store, addressed by a global sample index, plus a background
prefetcher. The sample order is a pure function of (seed, index), so every rank and every resumed run agrees on it
without communicating; memory does not grow with the corpus (shards memory-mapped, the shuffle a keyed bijection
computed per index). With the folder's recorded hashes each block of a shard is checked at its first read, so a
changed or damaged file stops training with one line naming it before any of its tokens reach the model."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from .errors import DataError
from .store import BlockHashes, block_digest

_MASK64 = (1 << 64) - 1
FEISTEL_ROUNDS = 6
# A target not trained on (mask 0: a fine-tuning prompt): the same value as model/'s IGNORE_INDEX, torch's
# cross_entropy default (data/ and model/ do not import each other).
IGNORE_INDEX = -100


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a fast, well-mixed 64-bit hash of an integer."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class RandomPermutation:
    """A pseudo-random bijection of [0, n) keyed by `key`, in O(1) memory.

    A balanced Feistel network permutes [0, 4**h), the smallest such range holding n (at most 4n); a
    value that lands outside [0, n) is encrypted again ("cycle walking") until it lands inside, which
    keeps the map a bijection of [0, n) and takes fewer than 4 rounds of walking on average."""

    def __init__(self, n: int, key: str):
        if n < 1:
            raise ValueError(f"cannot permute an empty range (n={n})")
        self.n = n
        half_bits = max((n - 1).bit_length() + 1, 2) // 2
        self._half_bits = half_bits
        self._half_mask = (1 << half_bits) - 1
        digest = hashlib.blake2b(key.encode(), digest_size=8 * FEISTEL_ROUNDS).digest()
        self._round_keys = [int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(FEISTEL_ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self._half_bits, x & self._half_mask
        for round_key in self._round_keys:
            left, right = right, left ^ (_mix64(right ^ round_key) & self._half_mask)
        return (left << self._half_bits) | right

    def __call__(self, x: int) -> int:
        if not 0 <= x < self.n:
            raise IndexError(f"{x} is outside [0, {self.n})")
        x = self._encrypt(x)
        while x >= self.n:
            x = self._encrypt(x)
        return x


class TokenDataset:
    """Fixed-length windows over the concatenation of token shards, addressed by a GLOBAL sample index.

    Window w holds tokens [w * seq_len, w * seq_len + seq_len + 1) of the shards read one after the other, so a window
    may span a shard boundary and no token is dropped at one. Epoch e visits every window once, in the order of a
    RandomPermutation keyed by (seed, e) (or in order, shuffle=False).

    With mask_paths (data.format=chat: one byte per token, beside each token file), a target whose mask byte is 0 is
    IGNORE_INDEX in the batches. With hashes (a prepared folder's), every file's blocks are checked against them as they
    are first read, and with vocab_size too, each token block's ids against it: a folder whose records were rewritten to
    fit changed tokens (hashes and largest id sealed again) still never gives the model an id past its vocabulary."""

    def __init__(self, paths: Path | str | Sequence[Path | str], *, dtype, seq_len: int, seed: int,
                 shuffle: bool = True, mask_paths: Sequence[Path | str] = (),
                 hashes: BlockHashes | None = None, vocab_size: int | None = None) -> None:
        self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        if mask_paths and len(mask_paths) != len(self.paths):
            raise DataError(f"{len(mask_paths)} mask files for {len(self.paths)} token files")
        self.dtype = np.dtype(dtype)
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        sizes = [self._num_tokens(path) for path in self.paths]
        for mask_path, size in zip(mask_paths, sizes, strict=False):
            if not Path(mask_path).is_file() or Path(mask_path).stat().st_size != size:
                raise DataError(f"mask file {mask_path} missing or not one byte per token of its token file")
        # Empty shards (a shard's validation part may hold no document) cannot be memory-mapped: skip them.
        self._files = [path for path, size in zip(self.paths, sizes, strict=True) if size]
        self._mask_files = [Path(path) for path, size in zip(mask_paths, sizes, strict=False) if size]
        self._mask_maps: dict[int, _CheckedMap] = {}
        self.hashes = hashes
        self.vocab_size = vocab_size
        if hashes is not None:
            for path in self._files + self._mask_files:
                if path.name not in hashes.by_name:
                    raise DataError(f"{hashes.record} records no hashes for {path}")
        # offsets[i] is the global position of the i-th non-empty shard's first token; one int64 per shard.
        self._offsets = np.concatenate([[0], np.cumsum([size for size in sizes if size], dtype=np.int64)])
        self._maps: dict[int, _CheckedMap] = {}
        self.num_tokens = int(self._offsets[-1])
        # Each window needs seq_len + 1 tokens (inputs plus the shifted target).
        self.num_windows = max(self.num_tokens - 1, 0) // seq_len
        if self.num_windows == 0:
            where = self.paths[0] if len(self.paths) == 1 else f"{len(self.paths)} shards from {self.paths[0]}"
            raise DataError(f"{where} holds {self.num_tokens} tokens, fewer than seq_len+1={seq_len + 1}")
        # (epoch, permutation) kept as one tuple so a reader on another thread sees a matching pair.
        self._perm_cache: tuple[int, RandomPermutation] | None = None

    def _num_tokens(self, path: Path) -> int:
        if not path.is_file():
            raise DataError(f"token file not found: {path}")
        num_bytes = path.stat().st_size
        if num_bytes % self.dtype.itemsize:
            raise DataError(f"{path} is {num_bytes} bytes, not a whole number of {self.dtype.name} tokens")
        return num_bytes // self.dtype.itemsize

    def __len__(self) -> int:
        return self.num_windows

    def _permutation(self, epoch: int) -> RandomPermutation:
        cached = self._perm_cache
        if cached is not None and cached[0] == epoch:
            return cached[1]
        perm = RandomPermutation(self.num_windows, key=f"windows:{self.seed}:{epoch}")
        self._perm_cache = (epoch, perm)
        return perm

    def window_start(self, index: int) -> int:
        """Global token offset of the window that global sample `index` reads."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        epoch, position = divmod(index, self.num_windows)
        slot = self._permutation(epoch)(position) if self.shuffle else position
        return slot * self.seq_len

    def _shard(self, i: int) -> _CheckedMap:
        if i not in self._maps:  # mapped on first use; a dict write is atomic under the GIL
            self._maps[i] = _CheckedMap(self._files[i], self.dtype, self.hashes, vocab_size=self.vocab_size)
        return self._maps[i]

    def _mask_shard(self, i: int) -> _CheckedMap:
        if i not in self._mask_maps:
            self._mask_maps[i] = _CheckedMap(self._mask_files[i], np.dtype(np.uint8), self.hashes)
        return self._mask_maps[i]

    def tokens(self, start: int, length: int) -> np.ndarray:
        """Global tokens [start, start + length) as int64, read across shard boundaries."""
        return self._read(self._shard, start, length)

    def _read(self, shard_map, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self._offsets, start, side="right")) - 1
        filled = 0
        while filled < length:
            begin = start + filled - int(self._offsets[shard])
            piece = shard_map(shard).read(begin, begin + length - filled)
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            shard += 1
        return out

    @property
    def masked(self) -> bool:
        return bool(self._mask_files)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of global sample `index`, each seq_len int64: the window and the window shifted by
        one token, with the targets not trained on (mask 0) as IGNORE_INDEX."""
        start = self.window_start(index)
        window = self.tokens(start, self.seq_len + 1)
        targets = window[1:].copy()
        if self._mask_files:
            targets[self._read(self._mask_shard, start + 1, self.seq_len) == 0] = IGNORE_INDEX
        return window[:-1], targets

    def window(self, index: int) -> np.ndarray:
        """seq_len+1 tokens (int64) for global sample `index`."""
        return self.tokens(self.window_start(index), self.seq_len + 1)

    def batch(self, first_index: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first_index .. first_index+num_samples-1 as (inputs, targets), each (num_samples, seq_len)."""
        return samples_to_batch([self.sample(i) for i in _sample_range(first_index, num_samples)])


class _CheckedMap:
    """A memory-mapped shard file whose blocks, with hashes, are checked against them on their first read (and,
    with vocab_size, their token ids against it)."""

    def __init__(self, path: Path, dtype: np.dtype, hashes: BlockHashes | None, *,
                 vocab_size: int | None = None) -> None:
        self.path = path
        self.vocab_size = vocab_size
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.digests = hashes.by_name[path.name] if hashes is not None else []
        self.block_bytes = hashes.block_bytes if hashes is not None else 1
        self.record = hashes.record.name if hashes is not None else ""
        num_blocks = -(-self.tokens.nbytes // self.block_bytes) if hashes is not None else 0
        if len(self.digests) != num_blocks:
            raise DataError(f"{path} holds {num_blocks} blocks but {self.record} records {len(self.digests)} "
                            f"hashes; prepare {path.parent} again")
        self.unchecked = set(range(num_blocks))

    def read(self, begin: int, end: int) -> np.ndarray:
        """Tokens [begin, end) (fewer at the end of the file), their blocks checked first."""
        end = min(end, len(self.tokens))
        if self.unchecked and end > begin:
            size, itemsize = self.block_bytes, self.tokens.itemsize
            for block in range(begin * itemsize // size, (end * itemsize - 1) // size + 1):
                if block in self.unchecked:
                    self._check(block)
        return self.tokens[begin:end]

    def _check(self, block: int) -> None:
        start = block * self.block_bytes
        data = self.tokens.view(np.uint8)[start : start + self.block_bytes]
        if block_digest(data) != self.digests[block]:
            raise DataError(f"{self.path}: bytes {start:,} to {start + len(data):,} do not match the hash "
                            f"{self.record} recorded when the data was prepared (the file was changed or damaged); "
                            f"prepare {self.path.parent} again")
        if self.vocab_size is not None:
            tokens = self.tokens[start // self.tokens.itemsize : (start + len(data)) // self.tokens.itemsize]
            if (largest := int(tokens.max())) >= self.vocab_size:
                raise DataError(f"{self.path}: bytes {start:,} to {start + len(data):,} hold token id {largest}, "
                                f"outside the tokenizer's vocabulary of {self.vocab_size}; prepare {self.path.parent} "
                                f"again")
        self.unchecked.discard(block)


def _sample_range(first_index: int, num_samples: int) -> range:
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    return range(first_index, first_index + num_samples)


def samples_to_batch(samples: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) rows -> (inputs, targets), each (num_samples, seq_len)."""
    return (torch.from_numpy(np.stack([inputs for inputs, _ in samples])),
            torch.from_numpy(np.stack([targets for _, targets in samples])))


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
