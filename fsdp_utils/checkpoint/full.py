"""The full format: one `torch.save` file gathered to rank 0 on the CPU, written to `.tmp-fsdp_cpt{step}.pth`
with its CRC32 computed while writing, renamed into place, then its checksum record written next to it."""
from __future__ import annotations

import logging
from pathlib import Path

from safe_io.journal import TMP_PREFIX, Journal

from ..distributed import agree
from .base import CheckpointFormat, write_error
from .checksums import checksum_record, write_checksummed, write_json_to
from .contents import MODEL, Contents, Snapshot, full_payload, parts_of, state_dict_options
from .errors import first_line
from .names import full_name, sidecar_of
from .retention import remove
from .safe_read import load_full

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

    def save(self, contents: Contents, snapshot: Snapshot, *, start: float) -> Path:
        # Gather to rank 0 on the CPU: no GPU memory spike, no other rank holds a copy. On the CPU the
        # tensors are already in host memory (and FSDP1's offload path fails there), so no offload.
        options, frozen = contents.fsdp.full_save_options(contents.model, on_gpu=self.env.device.type == "cuda")
        tensors = contents.take_tensors(options)
        for name in frozen:
            tensors[MODEL].pop(name, None)
        final = self.path_of(snapshot.step)
        self.context.check_space(final, tensors)
        tmp = final.with_name(f"{TMP_PREFIX}{final.name}")
        error, record, crc_s = None, None, 0.0
        journal = self.context.journal
        if self.env.is_main:
            payload = full_payload(tensors, snapshot.per_rank, self.context.metadata(snapshot))
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

    def load(self, contents: Contents, path: Path) -> tuple[dict, dict]:
        tensors, per_rank, meta = parts_of(load_full(path))
        self.context.check_model(meta, path)
        contents.check_optimizer(meta["train_state"], path)
        contents.restore_tensors(tensors, state_dict_options(contents.model, full_state_dict=True), path)
        return meta, per_rank

    def load_weights(self, contents: Contents, path: Path) -> dict:
        tensors, _, meta = parts_of(load_full(path))
        self.context.check_weights(meta, path)
        contents.model_part.restore_weights(tensors[MODEL], path, full=True)
        return meta
