"""The sharded format: torch.distributed.checkpoint writes one file per rank into `.tmp-fsdp_sharded_cpt{step}/`; each
rank hashes the files it wrote, rank 0 writes each per-rank part's file (rng.pt) and then `meta.json` (every file's size
and CRC32) last, and renames the folder into place. It reloads at any world size. Writing and committing are separate
steps, so an asynchronous save (async_save.py) commits its background write the same way."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from safe_io.journal import TMP_PREFIX, Journal

from ..distributed import agree, barrier
from .base import CheckpointFormat, write_error
from .checksums import hash_own_files, save_with_checksum, with_meta_crc32, write_json
from .contents import MODEL, Contents, Snapshot, quiet_state_dict_warnings, state_dict_options
from .metadata import read_sharded_meta
from .names import META_NAME, per_rank_name, sharded_name
from .retention import remove
from .safe_read import dcp_load, load_per_rank


def replace_dir(src: Path, dst: Path, journal: Journal) -> None:
    """Rename folder `src` to `dst`. What stands at `dst` is replaced only if the run's saves made it (else it is
    kept aside). os.replace cannot replace a non-empty folder, so the run's own `dst` is first renamed to a `.tmp-`
    name, which the next save removes should we stop before deleting it here."""
    journal.keep_foreign(dst, why=f"the save of {dst.name}")
    if os.path.lexists(dst):
        old = dst.with_name(f"{TMP_PREFIX}replaced-{dst.name}")
        journal.clear(old)
        journal.rename(dst, old)
        journal.rename(src, dst)
        journal.remove(old)
    else:
        journal.rename(src, dst)


class ShardedCheckpoint(CheckpointFormat):
    def path_of(self, step: int) -> Path:
        return self.context.dir / sharded_name(step)

    def tmp_of(self, final: Path) -> Path:
        return final.with_name(f"{TMP_PREFIX}{final.name}")

    def make_tmp(self, final: Path) -> Path:
        """Collective: rank 0 makes final's `.tmp-` folder, recorded as the run's own, for DCP to write into."""
        tmp, error = self.tmp_of(final), None
        if self.env.is_main:
            try:
                self.context.journal.create_dir(tmp)
            except OSError as err:
                error = write_error(final, err)
        agree(self.env, error)
        return tmp

    def tensors(self, contents: Contents, *, trial: bool = False) -> dict:
        """Collective: this rank's state dict of each tensor part, as a sharded save writes it (`trial`: see
        contents.OptimizerPart.take)."""
        offload = contents.fsdp.offloads_sharded_state_dict()
        return contents.take_tensors(state_dict_options(contents.model, cpu_offload=offload), trial=trial)

    def save(self, contents: Contents, snapshot: Snapshot, *, start: float) -> Path:
        final = self.path_of(snapshot.step)
        with quiet_state_dict_warnings():
            tensors = self.tensors(contents)
            self.context.check_space(final, tensors)
            self.write(tensors, final)
        return self.commit(final, snapshot, start=start)

    def write(self, state_dict: dict, final: Path, *, process_group: Any = None) -> None:
        """Collective: DCP writes `state_dict` into final's `.tmp-` folder; CheckpointError on every rank if
        any rank's write fails, the folder removed."""
        tmp = self.make_tmp(final)
        error = None
        try:
            dcp.save(state_dict, checkpoint_id=str(tmp), process_group=process_group)
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
            error = write_error(final, err)
        barrier(self.env)  # every rank is done with the folder before it is removed
        if error is not None and self.env.is_main:
            remove(self.context.journal, tmp)
        agree(self.env, error)

    def commit(self, final: Path, snapshot: Snapshot, *, start: float, hashed: tuple[dict, float] | None = None,
               mode: str | None = "sync") -> Path:
        """Collective, once every shard is written: each rank hashes the files it wrote (an asynchronous save
        did that in the background: `hashed`), rank 0 writes each per-rank part's file and meta.json (every file's
        size and CRC32) and renames the folder into place; retention."""
        tmp = self.tmp_of(final)
        error = None
        if hashed is None:
            try:
                hashed = hash_own_files(tmp, self.env.rank, self.env.world_size)
            except OSError as err:  # a shard that cannot be read back
                hashed, error = ({}, 0.0), write_error(final, err)
        mine, seconds = hashed
        parts: list = [None] * self.env.world_size
        dist.all_gather_object(parts, (mine, seconds, error))
        records = {name: record for part, _, _ in parts for name, record in part.items()}
        crc_s = max(seconds for _, seconds, _ in parts)  # the ranks hash in parallel
        error = next((e for _, _, e in parts if e is not None), None)
        if self.env.is_main:
            try:
                if error is None:
                    for name, values in snapshot.per_rank.items():
                        records[per_rank_name(name)], part_crc_s = save_with_checksum({name: values},
                                                                                      tmp / per_rank_name(name))
                        crc_s += part_crc_s
                    write_json(tmp / META_NAME, with_meta_crc32({**self.context.metadata(snapshot),
                                                                 "files": dict(sorted(records.items()))}))
                    self.context.journal.seal(tmp)  # every file is in: the folder as the save leaves it
                    replace_dir(tmp, final, self.context.journal)
            except Exception as err:  # agreed with the other ranks below
                error = write_error(final, err)
            if error is not None:
                remove(self.context.journal, tmp)
        agree(self.env, error)
        self.context.end_save(final, start=start, crc_s=crc_s, mode=mode)
        return final

    def load(self, contents: Contents, path: Path) -> tuple[dict, dict]:
        meta = read_sharded_meta(path)
        self.context.check_model(meta, path)
        contents.check_optimizer(meta["train_state"], path)
        options = state_dict_options(contents.model)
        with quiet_state_dict_warnings():
            tensors = contents.take_tensors(options)
            dcp_load(tensors, path)  # reads in place, resharding to this world size
            per_rank = load_per_rank(path, meta["files"])
            contents.restore_tensors(tensors, options, path)
        return meta, per_rank

    def load_weights(self, contents: Contents, path: Path) -> dict:
        meta = read_sharded_meta(path)
        self.context.check_weights(meta, path)
        model = contents.model_part
        with quiet_state_dict_warnings():
            # Only the model's tensors are read, resharded to this world size.
            weights = {MODEL: model.weights()}
            dcp_load(weights, path)
            model.restore_weights(weights[MODEL], path, full=False)
        return meta
