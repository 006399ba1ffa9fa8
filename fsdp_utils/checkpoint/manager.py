"""The checkpoint manager: what the training loop calls. Saving the run's `Contents` in one format (full.py or
sharded.py), synchronously or in the background (async_save.py), at the configured interval, at a stop signal and
at the last step (`on_step_end`); resuming from a path or `latest`, a checkpoint that fails its checks moved aside
as `corrupt-<name>` and the previous one tried. Every rank calls every method, and every rank reaches the same
outcome (an error on one rank is raised on all). A checkpoint counts only once complete: written under a `.tmp-`
name, renamed into place with its checksums; `.tmp-` names are never loaded and the next save removes them."""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from safe_io import nofollow
from safe_io.journal import TMP_PREFIX

from ..distributed import DistEnv, agree, barrier
from .async_save import AsyncSaveFailed, AsyncSaver, resolve_async_save
from .base import CheckpointContext, CheckpointFormat
from .checksums import META_CRC_KEY, verify
from .contents import Contents, TrainState
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointUnsafe, first_line
from .full import FullCheckpoint
from .metadata import check_structure, train_state_problem
from .names import META_NAME, size_of
from .retention import complete_checkpoints, incomplete_sharded, move_aside, odd_checkpoints
from .sharded import ShardedCheckpoint
from .staging import state_bytes

if TYPE_CHECKING:
    from config import CheckpointConfig

__all__ = ["AsyncSaveFailed", "CheckpointManager", "Contents", "TrainState"]

log = logging.getLogger(__name__)


def odd_checkpoint_problem(path: Path) -> str:
    """The refusal of `latest` where something other than a checkpoint has a checkpoint's name (odd_checkpoints)."""
    return (f"{path}: {nofollow.kind_of(os.lstat(path).st_mode)} under a checkpoint's name in the output directory, "
            "where only the run's own checkpoints belong; move it away")


def newer_work(resume_from: Path, step: int, directory: Path) -> str | None:
    """The refusal of resuming the checkpoint `resume_from` (of `step`) into `directory` when that holds a newer one:
    continuing there would overwrite, or let retention delete, work that is further along."""
    newer = [path for saved, path in complete_checkpoints(directory) if saved > step]
    if not newer:
        return None
    return (f"--resume_from {resume_from} (step {step}): {directory} already holds the newer {newer[0].name}; "
            "continue in a fresh run.output_dir, or use --resume_from latest")


class CheckpointManager:
    """The run's checkpoints of `contents` (its model, optimizer, train state and the other parts: contents.py) as the
    `checkpoint` config section describes them (format, interval, retention, verification, asynchronous saves,
    tokenizer changes), in `output_dir`. The rest is what the section cannot know: the ranks (`env`), the model's
    signature (`model_config`), the tokenizer's hash, the LoRA record and the process group's timeout (run.timeout_s),
    which bounds a background write."""

    def __init__(self, section: CheckpointConfig, output_dir: Path, *, env: DistEnv, contents: Contents,
                 model_config: dict, timeout_s: float = 600, tokenizer_sha256: str | None = None,
                 lora: dict | None = None):
        self.dir = Path(output_dir)
        self.env = env
        self.contents = contents
        self.interval = section.interval  # save every `interval` steps (0: only at a stop signal and the last step)
        self.verify = section.verify
        fmt = section.format
        self.context = CheckpointContext(self.dir, env, fmt, section.keep_last_n, model_config, tokenizer_sha256,
                                         section.allow_tokenizer_change, lora)
        self.stats = self.context.stats  # one row per committed save: what benchmarks/benchmark.py reports
        self._full, self._sharded = FullCheckpoint(self.context), ShardedCheckpoint(self.context)
        self.format: CheckpointFormat = self._sharded if fmt == "sharded" else self._full
        enabled = resolve_async_save(section.async_save, fmt=fmt, device=env.device)
        self.background = AsyncSaver(self._sharded, enabled=enabled, writer=section.async_writer,
                                     on_error=section.on_async_error, timeout_s=timeout_s)
        self._prepared = False
        self.loaded: tuple[Path, int] | None = None  # what a resume loaded, and the world size it was saved at

    @property
    def model_config(self) -> dict:
        return self.context.model_config

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint in the output directory, newest first."""
        return complete_checkpoints(self.dir)

    # ---- saving ------------------------------------------------------------------------------
    def prepare_saving(self) -> None:
        """Before the first step (every rank; `save` does it if not done): try whatever could make a save impossible,
        so that a run that cannot save stops now with one line: every writing rank writes a file in the output
        directory, the disk has room for a checkpoint, host memory (and /dev/shm) holds what saves stage, and an
        asynchronous save stages this very state once (a state it cannot copy makes the saves synchronous)."""
        if self._prepared:
            return
        self._prepared = True
        self._check_writable()
        self.context.check_space(self.dir, None, estimate=state_bytes(self.contents.model, self.contents.optimizer))
        self.background.prepare(self.contents)

    def _check_writable(self) -> None:
        """Every rank that writes checkpoint files (sharded: all; full: rank 0) creates, writes and removes a file of
        its own in the output directory: a read-only folder, or one another node cannot see, shows now."""
        error = None
        if self.context.fmt == "sharded" or self.env.is_main:
            probe, made = None, None
            try:
                if self.env.is_main:
                    self.dir.mkdir(parents=True, exist_ok=True)
                # a name of its own (another rank or job probing the same folder never meets it), created anew:
                # nothing that stands in the folder, a planted link included, is opened or removed
                probe, f = nofollow.open_unique(self.dir, f"{TMP_PREFIX}write-check-rank{self.env.rank}-")
                with f:
                    try:
                        f.write(b"checkpoint write check\n")
                        f.flush()
                        os.fsync(f.fileno())
                    finally:
                        made = nofollow.written(f)  # removed below only while it is still this file
            except OSError as err:
                hint = "" if self.dir.is_dir() else (" (the folder does not exist here: sharded checkpoints need "
                                                     "a filesystem every node sees)")
                error = CheckpointError(f"{self.dir}: checkpoints cannot be written there by rank {self.env.rank} on "
                                        f"{socket.gethostname()} ({first_line(err)}){hint}; fix the permissions or "
                                        f"choose another run.output_dir")
            finally:
                if probe is not None and made is not None:  # the very file made just above, and only it
                    nofollow.remove_made(probe, made)
        agree(self.env, error)

    def on_step_end(self, *, stopping: bool, last: bool) -> Path | None:
        """Every rank, once per step after the optimizer step: commit the save in flight if done (`poll`), then save
        at the interval, at a stop signal (`stopping`) or the last step (`last`), the last two waited for
        (`finish`). Returns the path of a save started or made at this step, else None."""
        self.poll()
        final = stopping or last
        if not final and not (self.interval and self.contents.state.step % self.interval == 0):
            return None
        path = self.save(last=final)
        if final:
            self.finish()
        return path

    def save(self, *, last: bool = False) -> Path:
        """Write a complete checkpoint of the contents at step contents.state.step; CheckpointError (on every rank)
        if it cannot be written, the previous checkpoints as they were. An asynchronous save returns once its write
        has started, complete once `poll` or `finish` commits it; one that cannot stage or start is made
        synchronously at once, and so is a `last` save once an asynchronous save of this run has failed."""
        step = self.contents.state.step
        # What no checkpoint may hold, the same on every rank: each raises it, none waits in a collective.
        if problem := train_state_problem(self.contents.record()):
            raise CheckpointError(f"{self.format.path_of(step)}: not saved: {problem} (a checkpoint holding it "
                                  "would not load)")
        self.prepare_saving()
        background = self.background
        if background.enabled and not (last and background.failed):
            try:
                return background.start(self.contents)
            except AsyncSaveFailed as err:
                background.failed = True
                if self.env.is_main:
                    log.warning("%s; saving step %d synchronously instead", err, step)
        background.settle()  # one save at a time: the one in flight is committed first
        start = time.perf_counter()
        snapshot = self.contents.snapshot(self.env)
        self.context.begin_save()
        return self.format.save(self.contents, snapshot, start=start)

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous save has been started and not committed yet."""
        return self.background.in_flight

    def poll(self) -> None:
        """Every rank, at the same point of every step: commit the save in flight once every rank's background write is
        done (async_save.py says why the ranks agree first); a failed write is reported here, naming the checkpoint."""
        self.background.poll()

    def finish(self) -> None:
        """At the end of a run (every rank: the last step, or a stop signal): wait for the save in
        flight and commit it. A failure is raised whatever checkpoint.on_async_error says."""
        self.background.finish()

    def close(self) -> None:
        """Release the writer and the staging memory. A save still in flight here (an error ended the run)
        is not committed: it stays a `.tmp-` folder, which the next save removes."""
        self.background.close()

    # ---- loading -----------------------------------------------------------------------------
    def resolve(self, resume_from: str) -> list[Path]:
        """Candidates to try in order: the given path, or for `latest` every complete one, newest first."""
        if resume_from == "latest":
            if odd := odd_checkpoints(self.dir):  # never read, counted or deleted: the user's to sort out
                raise CheckpointUnsafe(odd_checkpoint_problem(odd[0]))
            # A folder under a sharded checkpoint's name without meta.json is tried too (and moved aside as corrupt,
            # named in the warning), never passed over in silence: the save of its step would have to replace it.
            found = self.complete_checkpoints() + incomplete_sharded(self.dir)
            candidates = [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]
            if not candidates:
                raise CheckpointError(f"--resume_from latest: no complete checkpoint in {self.dir}")
            return candidates
        path = Path(resume_from)
        if not path.exists():
            raise CheckpointError(f"--resume_from {resume_from}: no such file or directory")
        return [path]

    def load(self, resume_from: str) -> TrainState:
        """Restore every part of the contents from `resume_from`; return the train state (the contents' own).

        With `latest`, a corrupt checkpoint is reported, moved aside, and the previous one is tried."""
        candidates = self.resolve(resume_from)
        if resume_from != "latest":
            state = self._load_one(candidates[0])
            if newer := newer_work(candidates[0], state.step, self.dir):
                raise CheckpointMismatch(newer)
            return state
        for i, path in enumerate(candidates):
            try:
                return self._load_one(path)
            except CheckpointCorrupt as err:
                if i == len(candidates) - 1:
                    raise
                if self.env.is_main:
                    log.warning("%s; falling back to the previous checkpoint", err)
                    move_aside(self.context.journal, path)
                barrier(self.env)
        raise AssertionError("unreachable")

    def load_weights(self, init_from: str) -> None:
        """model.init_from: only the model's weights from a checkpoint (full, sharded, or written by
        scripts/import_hf.py), checked like a resume's; the optimizer, step, data position and RNG stay fresh."""
        path = Path(init_from)
        start = time.perf_counter()
        crc_s = self._check_files(path)
        error = None
        try:
            (self._sharded if path.is_dir() else self._full).load_weights(self.contents, path)
        except CheckpointError as err:
            error = err
        agree(self.env, error)
        if self.env.is_main:
            log.info("model.init_from: loaded the weights of %s (%.1f MiB) in %.2f s (CRC32 check %.2f s); optimizer "
                     "and step start fresh", path, size_of(path) / 2**20, time.perf_counter() - start, crc_s)

    def _check_files(self, path: Path) -> float:
        """Every rank agrees the checkpoint is complete, then its CRC32s are checked (checkpoint.verify);
        returns the seconds the CRC32 check took."""
        error, records = None, None
        try:
            records = check_structure(path)
        except CheckpointError as err:
            error = err
        agree(self.env, error)
        return verify(path, records, self.env) if self.verify else 0.0

    def _load_one(self, path: Path) -> TrainState:
        start = time.perf_counter()
        crc_s = self._check_files(path)
        error, meta = None, None
        per_rank: dict = {}
        try:  # the path's kind, not checkpoint.format, decides: a run may resume from either format
            meta, per_rank = (self._sharded if path.is_dir() else self._full).load(self.contents, path)
        except CheckpointError as err:
            error = err
        agree(self.env, error)
        assert meta is not None, "every rank loaded, or agree() raised"
        self.contents.restore_plain(meta["train_state"], per_rank, self.env)
        state = self.contents.state
        self.loaded = (path, meta["world_size"])
        if self.env.is_main and path.is_dir() and META_CRC_KEY not in meta:
            # Its files are checked against meta.json, but nothing checks meta.json: show what it made the run take.
            log.warning("%s has no checksum of its own (saved before meta.json carried one): its train state is "
                        "taken unverified: step %d, samples_seen %d, tokens_seen %d", path / META_NAME, state.step,
                        state.samples_seen, state.tokens_seen)
        if self.env.is_main:
            log.info("loaded checkpoint %s (%.1f MiB, step %d, saved at world size %d) in %.2f s (CRC32 check %.2f s)",
                     path, size_of(path) / 2**20, state.step, meta["world_size"], time.perf_counter() - start, crc_s)
        return state
