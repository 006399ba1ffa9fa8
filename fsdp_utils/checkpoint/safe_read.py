"""Reading a checkpoint without running code from it: nothing in a checkpoint is unpickled by a general unpickler,
and a checkpoint that would need one is refused with CheckpointUnsafe.

What torch.save wrote loads with `torch.load(weights_only=True)` (DCP's non-tensor entries through `SafeLoadPlanner`).
DCP's `.metadata`, a bare pickle, is read by `RestrictedUnpickler` (`SafeFileSystemReader`); a failed torch.load is
told apart as a refusal or as damage by what its pickle imports, read without unpickling (`pickle_globals`), since
torch's words for a refusal differ between releases and between globals."""
from __future__ import annotations

import _compat_pickle
import pickle
import pickletools
import warnings
import zipfile
from collections.abc import Collection
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .contents import PER_RANK_PARTS, TENSOR_PARTS
from .errors import CheckpointCorrupt, CheckpointError, CheckpointUnsafe, first_line
from .metadata import check_meta, check_structure, is_int
from .names import is_file_name, per_rank_name

# What DCP's .metadata holds (FSDP1 and FSDP2 saves): its metadata dataclasses, the
# file-system writer's storage records, torch.Size, dtypes, layouts (by name), and the checkpoint's
# path. Each of these only builds data when unpickled.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided")
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),  # where Python 3.13 pickles it from
    ("collections", "OrderedDict"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that imports only the globals a file of its kind holds: DCP's metadata classes and
    torch's dtypes by default, or exactly the (module, name) pairs of `allowed` (empty: plain data only,
    as in a CUDA memory snapshot). Any other global is refused with CheckpointUnsafe, naming it and `where`;
    `holds` names the kind of file in that message."""

    def __init__(self, f: BinaryIO, where: Path, *, allowed: Collection[tuple[str, str]] | None = None,
                 holds: str = "checkpoint metadata"):
        super().__init__(f)
        self.where, self.allowed, self.holds = where, allowed, holds

    def find_class(self, module: str, name: str) -> Any:
        if self.allowed is None:
            is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            admitted = (module, name) in _METADATA_GLOBALS or is_dtype
        else:
            admitted = (module, name) in self.allowed
        if admitted:
            return super().find_class(module, name)
        raise CheckpointUnsafe(
            f"{self.where}: refused: it references {_py3_name(module, name)}, which {self.holds} never holds "
            f"(loading it would run code; a tampered or foreign file)")


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's .metadata, unpickled with only DCP's metadata classes admitted."""
    try:
        with path.open("rb") as f:
            metadata = RestrictedUnpickler(f, path).load()
    except CheckpointUnsafe:
        raise
    except Exception as err:  # truncated, garbled, or another pickle
        raise CheckpointCorrupt(f"{path}: cannot read checkpoint metadata ({first_line(err)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorrupt(f"{path}: not DCP checkpoint metadata (a {type(metadata).__name__})")
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointCorrupt(f"{path}: not DCP checkpoint metadata (no storage records)")
    for index, info in storage.items():
        where = getattr(info, "relative_path", None)
        if not is_file_name(where):  # DCP would open it relative to the folder: it must not lead out of it
            raise CheckpointUnsafe(f"{path}: refused: a storage record points at {where!r}, outside the checkpoint's "
                                   f"folder (a tampered or foreign file)")
        if not (is_int(info.offset, 0) and is_int(info.length, 0)):
            raise CheckpointCorrupt(f"{path}: corrupt checkpoint metadata (storage record of "
                                    f"{getattr(index, 'fqn', index)!r})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` with the restricted unpickler (read_metadata is the
    StorageReader method DCP calls for it)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP asks for a rank's own metadata file only when the global one failed
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_dcp_metadata(Path(self.path) / name)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# What torch.save writes into the pickles of a checkpoint (a .pth, rng.pt, DCP's non-tensor entries): tensors and
# parameters rebuilt from their storages (one storage class per dtype, named from torch), dtypes, devices, sizes,
# layouts, ordered dicts, and bytes (protocol 2 pickles them through _codecs.encode). Each only builds data.
_TORCH_SAVE_GLOBALS = frozenset({
    *(f"torch._utils.{name}" for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                          "_rebuild_parameter", "_rebuild_parameter_with_state")),
    "torch._tensor._rebuild_from_type_v2", "torch.nn.parameter.Parameter", "torch.Tensor", "torch.Size",
    "torch.device", "torch.serialization._get_layout", "torch.storage.UntypedStorage",  # float8 and newer dtypes
    "collections.OrderedDict", "_codecs.encode",
})


def _holds_only_data(name: str) -> bool:
    """Whether a pickled global (in Python 3 names) is one torch.save writes into a checkpoint."""
    module, _, attr = name.rpartition(".")
    if name in _TORCH_SAVE_GLOBALS:
        return True
    value = getattr(torch, attr, None) if module == "torch" else None
    return isinstance(value, torch.dtype) or (isinstance(value, type) and attr.endswith("Storage"))


def _py3_name(module: str, name: str) -> str:
    """`module.name` as Python 3 imports it: pickles of protocols 0 to 2 may name Python 2 modules
    (`__builtin__.exec`, `copy_reg._reconstructor`, `commands.Popen`), which the unpickler maps."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


_MARK = object()  # a MARK on the simulated stack


def _pop(stack: list, before: list) -> list:
    """Pop what an opcode consumes (pickletools' stack_before): through the topmost mark where it takes a
    mark and the items above it, then the fixed items below. Returns the fixed items, bottom first."""
    if pickletools.markobject in before:
        while stack.pop() is not _MARK:  # IndexError: no mark, not a whole pickle
            pass
        fixed = before.index(pickletools.markobject)
    else:
        fixed = len(before)
    return [stack.pop() for _ in range(fixed)][::-1]


def pickle_globals(data: bytes) -> list[str] | None:
    """`module.name` of every global a pickle imports (GLOBAL, INST, STACK_GLOBAL), in order, in Python 3
    names, read without unpickling: the unpickler's stack is simulated (strings, memo, marks), so
    STACK_GLOBAL names what it would really take, whatever was pushed and popped around it. None when the
    bytes do not decode as one whole pickle (damage, not a refusal)."""
    found: list[str] = []
    stack: list = []
    memo: dict[Any, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                assert isinstance(arg, str)  # pickletools decodes their argument as "module name"
                found.append(_py3_name(*arg.split(" ", 1)))
            if op.name in _IN_PLACE:
                _in_place(op.name, arg, stack, memo)
                continue
            taken = _pop(stack, op.stack_before)
            pushed: list = [None] * len(op.stack_after)
            if op.name == "STACK_GLOBAL":
                module, name = taken
                found.append(_py3_name(module, name) if isinstance(module, str) and isinstance(name, str) else "?")
            elif isinstance(arg, str) and len(pushed) == 1:  # the string opcodes
                pushed = [arg]
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                pushed = [memo.get(arg)]
            stack.extend(_MARK if kind is pickletools.markobject else value
                         for kind, value in zip(op.stack_after, pushed, strict=True))
    except (ValueError, IndexError):  # bytes that are not one whole pickle
        return None
    return found


# Opcodes that leave the stack's items as they are (pickletools' stack effects would lose their values).
_IN_PLACE = ("DUP", "POP", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")


def _in_place(name: str, arg: Any, stack: list, memo: dict) -> None:
    if name == "DUP":
        stack.append(stack[-1])
    elif name == "POP":  # the top item, or the topmost mark when that is on top
        stack.pop()
    else:  # PUT and MEMOIZE store the top item, which stays
        memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]


def _pickle_of(f: Any) -> bytes | None:
    """The data.pkl of a torch.save file (a path or a file object), None if it is not one."""
    try:
        if hasattr(f, "seek"):
            f.seek(0)
        with zipfile.ZipFile(f) as archive:
            name = next((n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")), None)
            return archive.read(name) if name else None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):  # not a whole zip
        return None


def _refused(f: Any) -> list[str]:
    """The globals of a torch.save file that no checkpoint holds, read from its pickle (not from the words of
    torch's refusal, which differ between releases and between globals, and which may name an opcode it stopped
    at before the global). [] when the pickle does not decode as a whole (damage), or holds only data."""
    names = pickle_globals(_pickle_of(f) or b"") or []
    return list(dict.fromkeys(n for n in names if not _holds_only_data(n)))


def _load_plain(f: Any, where: Path, **kwargs: Any) -> Any:
    """torch.load(weights_only=True). A failed load of a pickle that imports anything but data is CheckpointUnsafe,
    naming those globals, whatever torch's exception says; any other failure is raised as it is. Torch's warnings
    of a load that fails are dropped (the error says it all); those of a load that succeeds are shown."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = torch.load(f, map_location="cpu", weights_only=True, **kwargs)
        except Exception:
            if refused := _refused(f):
                raise CheckpointUnsafe(f"{where}: refused: it references {', '.join(refused)}, which a checkpoint "
                                       f"never holds (loading it would run code; a tampered or foreign file)") from None
            raise
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return result


def set_at(root: dict, path: tuple, value: Any) -> None:
    """root[path[0]][path[1]]... = value, creating dicts (str keys) and lists (int keys) on the way."""
    node: Any = root
    for key, next_key in pairwise(path):
        empty: dict | list = {} if isinstance(next_key, str) else []
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = empty
        else:
            node.setdefault(key, empty)
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries load with weights_only=True."""

    def __init__(self, where: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.where = where

    def load_bytes(self, read_item, value) -> None:
        obj = _load_plain(value, self.where)
        if self.flatten_state_dict:
            set_at(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_load(state: dict, path: Path, *, no_dist: bool = False) -> None:
    """dcp.load into `state` in place, through the safe reader and planner. The metadata is read first,
    so that a refused or unreadable one is reported as itself rather than as a DCP failure."""
    reader = SafeFileSystemReader(str(path))
    read_dcp_metadata(path / ".metadata")
    try:
        with warnings.catch_warnings():
            if no_dist:  # "loading in a single process" is what was asked for
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(path), no_dist=no_dist)
    except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
        raise _dcp_error(err, path) from None


def _dcp_error(err: BaseException, path: Path) -> CheckpointError:
    """The CheckpointError a failed dcp.load stands for: a refusal from our planner, else damage."""
    inner = err
    if isinstance(err, dcp.CheckpointException) and err.failures:
        failure = err.failures[min(err.failures)]
        inner = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(inner, CheckpointError):
        return inner
    return CheckpointCorrupt(f"{path}: cannot read sharded checkpoint ({first_line(err)})")


def load_per_rank(folder: Path, files: Collection[str]) -> dict:
    """The per-rank parts a sharded checkpoint holds, {part: every rank's value}; one whose file its meta.json does not
    list (`files`: a checkpoint saved before the part existed) is left out."""
    found = {}
    for name in PER_RANK_PARTS:
        path = folder / per_rank_name(name)
        if path.name not in files:
            continue
        try:
            found[name] = _load_plain(path, path)[name]
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointCorrupt(f"{path}: cannot read ({first_line(err)})") from None
    return found


def load_full(path: Path) -> dict:
    """The payload of a full checkpoint file, memory-mapped (every rank maps the same pages; nothing is
    copied per rank), with the library's metadata keys checked and each tensor part there."""
    check_structure(path)
    try:
        payload = _load_plain(path, path, mmap=True)
    except CheckpointError:
        raise
    except Exception as err:  # truncated, corrupt, or not a torch file at all
        raise CheckpointCorrupt(f"{path}: cannot read checkpoint ({first_line(err)})") from None
    check_meta(payload, path, checkpoint=path, extra_keys=(*TENSOR_PARTS, *PER_RANK_PARTS))
    if missing := [name for name in TENSOR_PARTS if not isinstance(payload.get(name), dict)]:
        raise CheckpointCorrupt(f"{path}: not a checkpoint of this library (no {missing[0]} state)")
    return payload
