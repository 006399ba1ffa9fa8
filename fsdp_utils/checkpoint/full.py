"""The full format: one `torch.save` file gathered to rank 0 on the CPU, written to `.tmp-fsdp_cpt{step}.pth`
with its CRC32 computed while writing, renamed into place, then its checksum record written next to it."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from safe_io.journal import Journal

from ..distributed import agree
from .base import (
    CheckpointFormat,
    TrainState,
    check_loaded,
    check_param_groups,
    full_save_options,
    is_adapter_key,
    quiet_state_dict_warnings,
    state_dict_options,
    write_error,
)
from .format import (
    FULL_PAYLOAD_KEYS,
    TMP_PREFIX,
    CheckpointMismatch,
    checksum_record,
    first_line,
    full_name,
    load_full,
    sidecar_of,
    write_checksummed,
    write_json_to,
)
from .retention import remove

log = logging.getLogger(__name__)


def install(journal: Journal, tmp: Path, final: Path) -> None:
    """Rename a written full checkpoint into place. A record left by a file of the same name goes first: it must
    never describe the new file (until its own is written, the new file loads unverified). A file there that the
    run did not make is kept aside, never replaced."""
    journal.keep_foreign(final, why=f"the save of {final.name}", along=sidecar_of(final))
    journal.clear(sidecar_of(final), why=f"the save of {final.name}")
    journal.rename(tmp, final)


def write_record(journal: Journal, final: Path, record: dict) -> None:
    """Write a full checkpoint's checksum record next to it, atomically, through the run's journal."""
    sidecar = sidecar_of(final)
    tmp = sidecar.with_name(TMP_PREFIX + sidecar.name)
    try:
        journal.write_file(tmp, lambda f: write_json_to(f, checksum_record(final, record)))
        journal.clear(sidecar, why=f"the checksum record of {final.name}")
        journal.rename(tmp, sidecar)
    finally:
        journal.remove(tmp)


class FullCheckpoint(CheckpointFormat):
    def path_of(self, step: int) -> Path:
        return self.context.dir / full_name(step)

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, *,
             start: float) -> Path:
        # Gather to rank 0 on the CPU: no GPU memory spike, no other rank holds a copy. On the CPU the
        # tensors are already in host memory (and FSDP1's offload path fails there), so no offload.
        options, frozen = full_save_options(model, on_gpu=self.env.device.type == "cuda")
        with quiet_state_dict_warnings():
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        for name in frozen:
            model_sd.pop(name, None)
        final = self.path_of(state.step)
        self.context.check_space(final, (model_sd, optim_sd))
        tmp = final.with_name(f"{TMP_PREFIX}{final.name}")
        error, record, crc_s = None, None, 0.0
        journal = self.context.journal
        if self.env.is_main:
            payload = {"model": model_sd, "optimizer": optim_sd, "rng": state.rng, **self.context.metadata(state)}
            try:
                record, crc_s = journal.write_file(tmp, lambda f: write_checksummed(payload, f))
            except Exception as err:  # disk full, quota, I/O error: agreed with the other ranks below
                remove(journal, tmp)
                error = write_error(final, err)
        agree(self.env, error)
        return self._commit(tmp, final, record, start=start, crc_s=crc_s)

    def _commit(self, tmp: Path, final: Path, record: dict | None, *, start: float, crc_s: float) -> Path:
        """Collective: rank 0 renames the written file into place, then writes its checksum record; retention."""
        error, journal = None, self.context.journal
        if self.env.is_main:
            try:
                install(journal, tmp, final)
            except OSError as err:
                remove(journal, tmp)
                error = write_error(final, err)
            else:
                assert record is not None, "rank 0 wrote the file and its record"
                try:
                    write_record(journal, final, record)
                except OSError as err:  # the checkpoint is in place, only its record is missing: it loads unverified
                    log.warning("%s: cannot write its checksum record (%s): it will load unverified", final,
                                first_line(err))
        agree(self.env, error)
        self.context.end_save(final, start=start, crc_s=crc_s)
        return final

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> tuple[dict, list | None]:
        payload = load_full(path)
        meta = {k: v for k, v in payload.items() if k not in FULL_PAYLOAD_KEYS}
        self.context.check_model(meta, path)
        check_param_groups(payload["optimizer"], model, optimizer, path)
        if not payload["optimizer"].get("state"):  # no step taken yet (scripts/import_hf.py): a fresh optimizer
            self._set_model(model, payload["model"], path)
            return meta, payload.get("rng")
        try:
            with quiet_state_dict_warnings():
                loaded = set_state_dict(model, optimizer, model_state_dict=payload["model"],
                                        optim_state_dict=payload["optimizer"],
                                        options=state_dict_options(model, full_state_dict=True))
        except Exception as err:  # readable, but not this model's (missing or extra tensors)
            raise CheckpointMismatch(f"{path}: does not fit this model ({first_line(err)})") from None
        check_loaded(loaded, model, path)
        return meta, payload.get("rng")

    def load_weights(self, model: torch.nn.Module, path: Path) -> dict:
        payload = load_full(path)
        meta = {k: v for k, v in payload.items() if k not in FULL_PAYLOAD_KEYS}
        self.context.check_weights(meta, path)
        try:
            with quiet_state_dict_warnings():
                result = set_model_state_dict(model, payload["model"],
                                              options=StateDictOptions(full_state_dict=True, strict=False))
        except Exception as err:  # readable, but not this model's (other shapes)
            raise CheckpointMismatch(f"{path}: does not fit this model ({first_line(err)})") from None
        missing = [k for k in result.missing_keys if not is_adapter_key(k)]  # LoRA's adapters start fresh
        if missing or result.unexpected_keys:
            raise CheckpointMismatch(f"{path}: does not fit this model (missing {missing[:3]}, unexpected "
                                     f"{list(result.unexpected_keys)[:3]})")
        return meta

    @staticmethod
    def _set_model(model: torch.nn.Module, state_dict: dict, path: Path) -> None:
        try:
            with quiet_state_dict_warnings():
                set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
        except Exception as err:  # readable, but not this model's (missing or extra tensors, other shapes)
            raise CheckpointMismatch(f"{path}: does not fit this model ({first_line(err)})") from None
