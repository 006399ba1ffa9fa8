"""The sharded format: torch.distributed.checkpoint writes one file per rank into
`.tmp-fsdp_sharded_cpt{step}/`; each rank hashes the files it wrote, rank 0 writes rng.pt and then
`meta.json` (every file's size and CRC32) last, and renames the folder into place. It reloads at any world
size. Writing and committing are separate steps, so an asynchronous save (async_save.py) commits its
background write the same way."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from safe_io.journal import Journal

from ..distributed import agree, barrier
from .base import (
    CheckpointFormat,
    TrainState,
    check_loaded,
    check_param_groups,
    frozen_names,
    is_adapter_key,
    quiet_state_dict_warnings,
    state_dict_options,
    write_error,
)
from .format import (
    META_NAME,
    RNG_NAME,
    TMP_PREFIX,
    CheckpointMismatch,
    dcp_load,
    first_line,
    hash_own_files,
    load_rng,
    read_sharded_meta,
    save_with_checksum,
    sharded_name,
    with_meta_crc32,
    write_json,
)
from .retention import remove


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

    def state_dicts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """This rank's (model, optimizer) state dicts as a save writes them (call within
        quiet_state_dict_warnings)."""
        return get_state_dict(model, optimizer,
                              options=state_dict_options(model, cpu_offload=self.context.offload(model)))

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, *,
             start: float) -> Path:
        final = self.path_of(state.step)
        with quiet_state_dict_warnings():
            model_sd, optim_sd = self.state_dicts(model, optimizer)
            self.context.check_space(final, (model_sd, optim_sd))
            self.write({"model": model_sd, "optimizer": optim_sd}, final)
        return self.commit(final, state, start=start)

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

    def commit(self, final: Path, state: TrainState, *, start: float, hashed: tuple[dict, float] | None = None,
               mode: str | None = "sync") -> Path:
        """Collective, once every shard is written: each rank hashes the files it wrote (an asynchronous save
        did that in the background: `hashed`), rank 0 writes rng.pt and meta.json (every file's size and
        CRC32) and renames the folder into place; retention."""
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
                    records[RNG_NAME], rng_crc_s = save_with_checksum({"rng": state.rng}, tmp / RNG_NAME)
                    crc_s += rng_crc_s
                    write_json(tmp / META_NAME, with_meta_crc32({**self.context.metadata(state),
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

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> tuple[dict, list | None]:
        meta = read_sharded_meta(path)
        self.context.check_model(meta, path)
        with quiet_state_dict_warnings():
            options = state_dict_options(model)
            # Every tensor of the model, the frozen ones too (a LoRA run's base, which the checkpoint does not hold):
            # FSDP1 loads a unit's parameters together and warns for each one absent, so those go back as they are.
            model_sd, optim_sd = get_state_dict(model, optimizer,
                                                options=dataclasses.replace(options, ignore_frozen_params=False))
            frozen = frozen_names(model)
            saved = {k: v for k, v in model_sd.items() if k not in frozen}
            state: dict[str, Any] = {"model": saved, "optimizer": optim_sd}
            dcp_load(state, path)  # reads in place, resharding to this world size
            rng = load_rng(path)
            check_param_groups(state["optimizer"], model, optimizer, path)
            try:
                loaded = set_state_dict(model, optimizer, model_state_dict={**model_sd, **state["model"]},
                                        optim_state_dict=state["optimizer"], options=options)
            except (Exception, dcp.CheckpointException) as err:
                raise CheckpointMismatch(f"{path}: does not fit this model ({first_line(err)})") from None
            check_loaded(loaded, model, path)
        return meta, rng

    def load_weights(self, model: torch.nn.Module, path: Path) -> dict:
        meta = read_sharded_meta(path)
        self.context.check_weights(meta, path)
        with quiet_state_dict_warnings():
            # Only the model's tensors are read, resharded to this world size; LoRA's adapters start fresh.
            weights = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter_key(k)}
            state: dict[str, Any] = {"model": weights}
            dcp_load(state, path)
            try:
                set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
            except (Exception, dcp.CheckpointException) as err:
                raise CheckpointMismatch(f"{path}: does not fit this model ({first_line(err)})") from None
        return meta
