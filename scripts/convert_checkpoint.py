"""Convert a checkpoint between the two formats, offline: a sharded folder (fsdp_sharded_cpt{step}/) into a full
file (.pth), a full file into a sharded folder.

    python scripts/convert_checkpoint.py checkpoints/llama1B/fsdp_sharded_cpt500 llama1B_500.pth
    python scripts/convert_checkpoint.py checkpoints/llama1B/fsdp_cpt500.pth converted/fsdp_sharded_cpt500

Read in this one process (no GPU; memory for the whole model and optimizer state) and checked against its CRC32s
first; everything a resume needs comes along, so `--resume_from OUT` continues on any number of ranks. The output is
written as train_fsdp.py writes a checkpoint of that format, with its checksums (docs/checkpoints.md)."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_utils.checkpoint import io as checkpoint_io
from fsdp_utils.checkpoint.base import CheckpointContext
from fsdp_utils.checkpoint.checksums import save_full
from fsdp_utils.checkpoint.contents import OPTIMIZER, TENSOR_PARTS, Snapshot, full_payload, parts_of
from fsdp_utils.checkpoint.errors import CheckpointCorrupt, CheckpointError
from fsdp_utils.checkpoint.metadata import META_KEYS, OPTIONAL_META_KEYS
from fsdp_utils.checkpoint.names import size_of
from fsdp_utils.checkpoint.retention import remove
from fsdp_utils.checkpoint.safe_read import dcp_load, load_full, load_per_rank, read_dcp_metadata, set_at
from fsdp_utils.checkpoint.sharded import ShardedCheckpoint
from fsdp_utils.distributed import DistEnv, destroy_distributed


class ConvertError(Exception):
    """A problem with the input or output; the message names the path."""


def check_layout(metadata, src: Path) -> None:
    """The checkpoint's metadata describes what its files can hold, checked before anything is allocated:
    every tensor's declared size fits in the bytes of its files, its chunks lie inside it, and the planner
    data (where each entry goes in the nested state) uses list indices no larger than the number of
    entries. A crafted .metadata could otherwise make this process allocate without bound."""
    where = src / ".metadata"
    data_bytes = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    entries = metadata.state_dict_metadata
    for name, md in entries.items():
        try:
            problem = _tensor_problem(md, data_bytes) if isinstance(md, TensorStorageMetadata) else None
        except (TypeError, AttributeError, ValueError):  # fields of the wrong type
            problem = "its description does not decode"
        path = metadata.planner_data.get(name) if isinstance(metadata.planner_data, dict) else None
        if problem is None and (not isinstance(path, (tuple, list)) or not path or any(
                not isinstance(k, str) and not (type(k) is int and 0 <= k < len(entries)) for k in path)):
            problem = f"its place in the state, {path!r}, is not a path of names and list indices"
        if problem:
            raise CheckpointCorrupt(f"{where}: corrupt checkpoint metadata ({name!r}: {problem})")


def _tensor_problem(md: TensorStorageMetadata, data_bytes: int) -> str | None:
    """What is wrong with a saved tensor's size and chunks, given the checkpoint's bytes on disk."""
    size = tuple(md.size)
    if any(type(d) is not int or d < 0 for d in size) or not isinstance(md.properties.dtype, torch.dtype):
        return f"size {size} of {md.properties.dtype}"
    nbytes = math.prod(size) * md.properties.dtype.itemsize
    if nbytes > data_bytes:
        return f"declares {nbytes:,} bytes, more than the checkpoint's {data_bytes:,}"
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                type(o) is not int or type(n) is not int or not 0 <= o <= o + n <= d
                for o, n, d in zip(offsets, sizes, size, strict=True)):
            return f"a chunk lies outside its size {size}"
    return None


def load_sharded(src: Path) -> dict:
    """{"model": ..., "optimizer": ...} with whole tensors, read without a process group.

    DCP loads in place, so the state is first laid out from the checkpoint's metadata: an empty tensor
    of each saved tensor's full size (read into from every shard) or a slot for each plain value, under
    its flattened name; the saved nesting (DCP's planner data) is restored afterwards."""
    metadata = read_dcp_metadata(src / ".metadata")
    check_layout(metadata, src)
    flat = {name: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
            for name, md in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in a single process" is the intent
        dcp_load(flat, src, no_dist=True)
    state: dict = {}
    try:
        for name, value in flat.items():
            set_at(state, tuple(metadata.planner_data[name]), value)
    except (TypeError, IndexError, AttributeError) as err:  # paths that disagree (a list where a dict was)
        raise CheckpointCorrupt(f"{src / '.metadata'}: corrupt checkpoint metadata (planner data: {err})") from None
    missing = [k for k in TENSOR_PARTS if k not in state]
    if missing:
        raise ConvertError(f"{src}: the shards hold no {' or '.join(missing)} state")
    return state


def check_out(out: Path, *, force: bool, folder: bool) -> None:
    """OUT may be written: it does not exist (or --force), and is of the output's kind (a folder or a file)."""
    if out.exists() and not force:
        raise ConvertError(f"{out} exists; pass --force to overwrite it")
    if folder and (out.suffix == ".pth" or (out.exists() and not out.is_dir())):
        raise ConvertError(f"{out}: a full checkpoint converts to a sharded one, a folder: give the folder's path "
                           "(e.g. fsdp_sharded_cpt<step>), not a file's")
    if not folder and out.is_dir():
        raise ConvertError(f"{out} is a directory; give the path of the .pth file to write")


def convert(src: Path, out: Path, *, force: bool = False) -> dict:
    """Write `src` in the other format at `out` (a sharded folder as a full file, a full file as a sharded
    folder), atomically; return the checkpoint's content in the full layout."""
    if not src.exists():
        raise ConvertError(f"{src}: no such file or directory")
    return to_full(src, out, force=force) if src.is_dir() else to_sharded(src, out, force=force)


def to_full(src: Path, out: Path, *, force: bool = False) -> dict:
    """Write the full checkpoint for sharded checkpoint `src` to `out`; return its payload."""
    check_out(out, force=force, folder=False)
    meta = checkpoint_io.read_meta(src)  # meta.json, every shard's size, the format version
    checkpoint_io.verify(src)
    state = load_sharded(src)
    payload = full_payload({name: state[name] for name in TENSOR_PARTS}, load_per_rank(src, meta["files"]),
                           {k: meta[k] for k in (*META_KEYS, *OPTIONAL_META_KEYS) if k in meta})

    out.parent.mkdir(parents=True, exist_ok=True)
    save_full(payload, out)  # and .OUT.json next to it: a load from OUT verifies its CRC32
    return payload


class SavedContext(CheckpointContext):
    """The checkpoint settings of the run that saved a checkpoint being converted: its metadata keeps the
    world size it was saved at (its RNG states are that many ranks'), not this one process's."""

    def __init__(self, payload: dict, out: Path, env: DistEnv):
        super().__init__(out.parent, env, "sharded", keep_last_n=0, model_config=payload["model_config"],
                         tokenizer_sha256=payload.get("tokenizer_sha256"), lora=payload.get("lora"))
        self.saved_world_size = payload["world_size"]

    def metadata(self, snapshot: Snapshot) -> dict:
        return {**super().metadata(snapshot), "world_size": self.saved_world_size}


@contextlib.contextmanager
def one_process_group() -> Iterator[DistEnv]:
    """A gloo process group of this process alone: the sharded writer's steps are collectives."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConvertError("convert_checkpoint.py runs in one process: start it without torchrun")
        yield DistEnv(0, 0, 1, 1, torch.device("cpu"))
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(0, 0, 1, 1, torch.device("cpu"))
    finally:
        destroy_distributed()


def to_sharded(src: Path, out: Path, *, force: bool = False) -> dict:
    """Write the sharded checkpoint for full checkpoint `src` into folder `out`, through the training job's
    sharded writer (keep_last_n 0: no other checkpoint next to OUT is touched); return the source's payload.
    The tensors are saved whole: a resume at any world size reads each rank's part of them."""
    payload = load_full(src)  # memory-mapped: cheap, and refuses a file that would run code before anything else
    check_out(out, force=force, folder=True)
    checkpoint_io.verify(src)
    tensors, per_rank, meta = parts_of(payload)
    if not tensors[OPTIMIZER].get("state"):
        raise ConvertError(f"{src}: holds no optimizer state (no step taken, as scripts/import_hf.py writes it): "
                           "resume from it as it is, or start from its weights with model.init_from")
    out.parent.mkdir(parents=True, exist_ok=True)
    with one_process_group() as env:
        context = SavedContext(payload, out, env)
        writer = ShardedCheckpoint(context)
        start = time.perf_counter()
        try:
            writer.write(tensors, out)
            writer.commit(out, Snapshot(meta["train_state"], per_rank), start=start)
        except BaseException:  # a failed write removes its folder itself; an interrupted one is removed here
            remove(context.journal, writer.tmp_of(out))
            raise
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path,
                        help="the checkpoint to convert: a sharded folder fsdp_sharded_cpt<step>/ or a full file "
                             "fsdp_cpt<step>.pth")
    parser.add_argument("out", type=Path, help="what to write: the full file (e.g. fsdp_cpt<step>.pth) for a sharded "
                                               "input, the sharded folder (e.g. fsdp_sharded_cpt<step>) for a full one")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    args = parser.parse_args(argv)
    try:
        payload = convert(args.src, args.out, force=args.force)
    except (ConvertError, CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    step = payload["train_state"].get("step")
    print(f"wrote {args.out} (step {step}, saved at world size {payload['world_size']}, "
          f"{size_of(args.out) / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
