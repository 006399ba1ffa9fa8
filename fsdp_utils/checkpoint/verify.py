"""Checksums spread over the ranks: which rank hashes which file of a checkpoint when it is written, and
the check of every file's size and CRC32 against the checkpoint's record when it is loaded."""
from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from ..distributed import DistEnv, agree
from .format import (
    CheckpointCorrupt,
    CheckpointError,
    check_archive,
    check_file,
    checksum_records,
    file_record,
    sidecar_of,
)

log = logging.getLogger(__name__)

_DCP_FILE_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


def owner(name: str, index: int, world_size: int) -> int:
    """The rank that hashes file `name` (the index-th of the checkpoint's files): DCP's `__{rank}_{i}.distcp`
    goes to the rank that wrote it (still in its page cache), everything else round-robin."""
    if (m := _DCP_FILE_RE.match(name)) and int(m.group(1)) < world_size:
        return int(m.group(1))
    return index % world_size


def hash_own_files(folder: Path, rank: int, world_size: int) -> tuple[dict, float]:
    """{name: {"size", "crc32"}} of the files of a written checkpoint that this rank hashes, and the
    seconds it took."""
    start = time.perf_counter()
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    mine = {n: file_record(folder / n) for i, n in enumerate(names) if owner(n, i, world_size) == rank}
    return mine, time.perf_counter() - start


def verify(path: Path, env: DistEnv) -> float:
    """Collective: check every file's size and CRC32 against the checkpoint's record, the files spread over
    the ranks; CheckpointCorrupt on every rank if any differs. Returns the seconds it took."""
    start = time.perf_counter()
    error, records = None, None
    try:
        records = checksum_records(path)
    except CheckpointError as err:
        error = err
    agree(env, error)
    if records is None:  # a .pth without its record: checked against the CRC32s in its own archive
        verified, problem = check_archive(path) if env.is_main else (True, None)
        agree(env, CheckpointCorrupt(problem) if problem else None)
        if env.is_main and not verified:
            log.warning("%s has no checksum record (%s) and its archive holds no CRC32s: loading it unverified", path,
                        sidecar_of(path).name)
        return time.perf_counter() - start
    folder = path if path.is_dir() else path.parent
    names = sorted(records)
    mine = [n for i, n in enumerate(names) if owner(n, i, env.world_size) == env.rank]
    problem = next((p for n in mine if (p := check_file(folder / n, records[n]))), None)
    agree(env, CheckpointCorrupt(problem) if problem else None)
    return time.perf_counter() - start
