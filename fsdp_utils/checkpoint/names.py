"""The names of a checkpoint's files and folders, as a save writes them and every reader and listing finds them.

    fsdp_cpt{step}.pth            full: one torch.save file (the parts of contents.py and the metadata)
    .fsdp_cpt{step}.pth.json      its checksum record (a sidecar: the .pth stays a plain torch.save file)
    fsdp_sharded_cpt{step}/       sharded: DCP's __{rank}_0.distcp files and .metadata, a {part}.pt file for each
                                  per-rank part (rng.pt), and meta.json (train state and every file's size and
                                  CRC32), written last

A save writes under the name with safe_io.journal's TMP_PREFIX (`.tmp-`) before it renames it into place."""
from __future__ import annotations

import re
from pathlib import Path

FULL_RE = re.compile(r"^fsdp_cpt(\d+)\.pth$")
SHARDED_RE = re.compile(r"^fsdp_sharded_cpt(\d+)$")
DCP_FILE_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # a shard DCP wrote: __{rank}_{i}.distcp
CORRUPT_PREFIX = "corrupt-"  # moved aside after failing its checks: never loaded, never deleted automatically
META_NAME = "meta.json"
FORMAT_VERSION = 1


def full_name(step: int) -> str:
    return f"fsdp_cpt{step}.pth"


def sharded_name(step: int) -> str:
    return f"fsdp_sharded_cpt{step}"


def per_rank_name(part: str) -> str:
    """The file of a sharded checkpoint that holds a per-rank part (contents.PER_RANK_PARTS): rng.pt."""
    return f"{part}.pt"


def sidecar_of(pth: Path) -> Path:
    """The checksum record of a full checkpoint file."""
    return pth.with_name(f".{pth.name}.json")


def step_in_name(path: Path) -> int | None:
    """The step a checkpoint's name says (fsdp_cpt{step}.pth, fsdp_sharded_cpt{step}), None for another name."""
    found = FULL_RE.match(path.name) or SHARDED_RE.match(path.name)
    return int(found.group(1)) if found else None


def is_file_name(name: object) -> bool:
    """A plain file name inside a checkpoint's folder: no path, nothing that leads out of it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
            and len(name) < 256)


def size_of(path: Path) -> int:
    """Bytes on disk of a checkpoint file or folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
