"""Hugging Face datasets as a corpus (data.hf_dataset): a `save_to_disk` folder, a folder of data files as a hub
snapshot holds them, or a dataset name found in the local caches. Read with the `datasets` library (imported only
here, only when used) and offline only: nothing is ever downloaded.

The parent reads the dataset in order as pieces like a parquet file's (the text column, or the conversation columns),
so the workers, the chunking, the resume and the output are those of local files."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from safe_io import nofollow
from safe_io.names import shown

from .chat import ChatFields
from .errors import DataError, first_line
from .jsonfile import MAX_JSON_BYTES, read_json_file
from .readers import Piece, optional_import
from .settings import HFDatasetConfig
from .store import is_plain_name

BATCH_ROWS = 1024  # rows per piece, as a parquet file's batches
SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what Dataset.save_to_disk / DatasetDict.save_to_disk write


@dataclass
class OpenedDataset:
    """A dataset ready to read: its rows (a datasets Dataset or IterableDataset), the files they come from (for the
    fingerprint and the corpus size), and the columns to read."""

    where: str  # the path or name, for messages
    rows: Any
    files: list[Path]
    columns: list[str]
    num_rows: int | None  # None for a streamed dataset, whose length is known only at its end
    chat: bool  # data.format=chat: the rows are conversations

    def pieces(self, *, disk_bytes: int) -> Iterator[Piece]:
        """Each batch of rows as a piece: "rows" (the text column) or "records" (the conversation columns); its
        disk_end is the share of the corpus's bytes on disk read so far (by rows where the length is known)."""
        import pyarrow as pa

        row = num_bytes = 0
        tables = self.rows.select_columns(self.columns).with_format("arrow").iter(batch_size=BATCH_ROWS)
        while (table := self._next(tables, row)) is not None:
            # Copies: a slice of a memory-mapped file would send its whole record batch to a worker.
            columns = [pa.concat_arrays(column.chunks) for column in table.columns]
            data = pa.Table.from_arrays(columns, names=table.column_names) if self.chat else columns[0]
            row += table.num_rows
            num_bytes += data.nbytes
            done = disk_bytes * row // self.num_rows if self.num_rows else min(num_bytes, disk_bytes)
            yield Piece("records" if self.chat else "rows", self.where, data, row - table.num_rows, data.nbytes, done)

    def _next(self, tables: Iterator, row: int):
        """The next batch of rows (a pyarrow table), or None at the end; a file that cannot be read is one line."""
        import pyarrow as pa

        try:
            return next(tables, None)
        except (pa.ArrowException, OSError, ValueError) as err:  # damaged files, JSON that is not
            raise DataError(f"{self.where}: cannot read the rows from {row} on ({err})") from None


def open_dataset(spec: HFDatasetConfig, *, text_field: str, chat: ChatFields | None) -> OpenedDataset:
    """The dataset at spec.path, checked: its split exists and has the text column (or the conversation columns).
    Reads only local files, and of a folder only files inside it; DataError in one line otherwise."""
    datasets = optional_import("datasets", "datasets", Path(spec.path))
    root = Path(spec.path).expanduser()
    folder = root if root.is_dir() else _hub_snapshot(spec.path)
    if folder is None:
        # A name the datasets cache holds (from an earlier load_dataset): memory-mapped arrow files already.
        rows, _ = _load(datasets, spec.path, spec, streaming=False)
        files = [Path(entry["filename"]) for entry in rows.cache_files]
    else:
        # Every file read is fingerprinted (data/prepare.py): the data files the dataset's records name, and the
        # folder's own files (its README.md decides what is read). All are named below the folder's real path, as
        # the datasets library names them, so that each is listed once.
        real = folder.resolve()
        below = _files_below(real)  # first: it refuses what the library would follow or block on
        if any((folder / name).is_file() for name in SAVED_MARKERS):
            rows = _saved(datasets, folder, real, spec)
            read = [Path(entry["filename"]) for entry in rows.cache_files]
        else:
            rows, read = _load(datasets, str(folder), spec, streaming=spec.streaming, folder=real)
        files = sorted({*below, *read})
    where = f"{shown(spec.path)}{f' ({shown(spec.name)})' if spec.name else ''}[{shown(spec.split)}]"
    columns = _columns(datasets, rows, where, text_field=text_field, chat=chat)
    num_rows = None if isinstance(rows, datasets.IterableDataset) else rows.num_rows
    return OpenedDataset(where, rows, files, columns, num_rows, chat=chat is not None)


@contextlib.contextmanager
def hub_offline(datasets) -> Iterator[None]:
    """datasets and huggingface_hub in offline mode while a dataset is opened: a name is looked up in the local
    caches only, and nothing reaches the network whatever HF_HUB_OFFLINE says. Every call that opens a dataset is
    made inside it (tests/test_hf_loading.py checks the source)."""
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _hub_snapshot(name: str) -> Path | None:
    """The hub cache's snapshot folder of dataset `name` (where `huggingface-cli download --repo-type dataset`
    puts it), at the revision its main ref names, or None."""
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return None
    import huggingface_hub.constants as hub

    repo = Path(hub.HF_HUB_CACHE) / ("datasets--" + name.replace("/", "--"))
    if not (repo / "refs" / "main").exists():
        return None
    revision = _metadata_text(repo / "refs" / "main").strip()
    # A revision names a folder of snapshots/ (a commit hash): `..` or a path would lead out of the repository.
    if revision in (".", "..") or any(c in revision for c in "/\\\0"):
        raise DataError(f"{repo / 'refs' / 'main'}: names the revision {revision!r}, which is not a folder of "
                        f"{repo / 'snapshots'}; download the dataset again")
    snapshot = repo / "snapshots" / revision
    return snapshot if revision and snapshot.is_dir() else None


def _saved(datasets, folder: Path, real: Path, spec: HFDatasetConfig):
    """A save_to_disk folder (real: its resolved path): one Dataset (one split), or a DatasetDict of splits."""
    if spec.name:
        raise DataError(f"data.hf_dataset.name={spec.name}: {folder} is a save_to_disk folder, which has no "
                        f"configurations; leave data.hf_dataset.name empty")
    _check_saved_records(folder)
    try:
        with hub_offline(datasets):
            saved = datasets.load_from_disk(str(real), keep_in_memory=False)  # memory-mapped: its cache_files
    except IndexError:  # datasets concatenates a split's arrow files, of which one saved without rows has none
        raise DataError(f"cannot load {folder} with the datasets library: a split of it has no arrow file (one saved "
                        f"without rows)") from None
    except Exception as err:  # noqa: BLE001 - records it cannot read (missing, not JSON, fields of other kinds)
        raise DataError(f"{folder}: not a readable save_to_disk folder ({_said(err)})") from None
    if isinstance(saved, datasets.DatasetDict):
        return _split(saved, spec, str(folder))
    if saved.split is not None and str(saved.split) != spec.split:
        raise DataError(f"{folder} holds the split '{saved.split}', not '{spec.split}'; set "
                        f"data.hf_dataset.split={saved.split}")
    return saved


def _check_saved_records(folder: Path) -> None:
    """A save_to_disk folder's records name its files (dataset_dict.json its splits' folders, each state.json its
    arrow files), which load_from_disk joins to the folder as they are: each must be a plain name, so that no file
    outside the folder is read."""
    records = [(folder / "dataset_dict.json", "splits", ""), (folder / "state.json", "_data_files", "filename")]
    while records:
        path, field, key = records.pop()
        if not path.exists():
            continue  # the library says what is missing
        if key and (path.parent / "dataset_info.json").exists():  # read by the library beside state.json: bounded
            read_json_file(path.parent / "dataset_info.json")
        try:
            names = [entry[key] if key else entry for entry in read_json_file(path)[field]]
        except (LookupError, TypeError) as err:
            raise DataError(f"{path}: not a save_to_disk record the datasets library reads ({_said(err)})") from None
        if (bad := next((name for name in names if not is_plain_name(name)), None)) is not None:
            raise DataError(f"{path} names {str(bad)[:200]!r} in '{field}', not a name inside {path.parent}: only "
                            f"files inside the dataset folder are read")
        if not key:
            records += [(path.parent / name / "state.json", "_data_files", "filename") for name in names]


def _load(datasets, path: str, spec: HFDatasetConfig, *, streaming: bool,
          folder: Path | None = None) -> tuple[Any, list[Path]]:
    """A local folder (folder: its resolved path) or a cached name as load_dataset reads it, all its splits, then
    the one asked for; with the data files read, each checked to lie inside the folder."""
    if folder is not None and (script := Path(path) / f"{Path(path).name}.py").is_file():  # where datasets looks
        raise DataError(f"{path} holds a loading script ({script.name}), which is never run (nor does the datasets "
                        f"library run them): give a folder of the dataset's data files (parquet, JSON lines), or a "
                        f"save_to_disk folder")
    try:
        splits, files = _build(datasets, path, spec, streaming=streaming, folder=folder)
    except DataError:
        raise
    except (ConnectionError, FileNotFoundError) as err:
        if Path(path).is_dir():
            raise DataError(f"{path}: no data files the datasets library reads ({first_line(err)})") from None
        if Path(path).expanduser().exists():
            raise DataError(f"data.hf_dataset.path={path} is a file: give the dataset's folder (or name the file in "
                            f"data.files)") from None
        raise DataError(f"data.hf_dataset.path={path} is not a folder, and no dataset of that name is in the local "
                        f"caches (the hub cache and the datasets cache); nothing is downloaded: download it first "
                        f"(huggingface-cli download --repo-type dataset NAME), or give its folder") from None
    except datasets.exceptions.DatasetGenerationError as err:  # a data file that fails while converted into the cache
        raise DataError(f"cannot read {path} with the datasets library: {first_line(err.__cause__ or err)}") from None
    except Exception as err:  # noqa: BLE001 - an unknown configuration, or metadata (README.md's configs and
        # dataset_info) of kinds the library does not expect, which it reports as any of several errors
        hint = ("; check data.hf_dataset.name and the metadata atop its README.md (configs, dataset_info)"
                if folder is not None and (folder / "README.md").is_file() else "")
        raise DataError(f"cannot read {path} with the datasets library ({_said(err)}){hint}") from None
    return _split(splits, spec, path), files


def _build(datasets, path: str, spec: HFDatasetConfig, *, streaming: bool,
           folder: Path | None) -> tuple[Any, list[Path]]:
    """load_dataset's own steps (its builder, then the splits streamed or converted into the datasets cache), with
    the data files the builder resolved checked before any is read."""
    with hub_offline(datasets):
        if folder is not None:
            _check_card(folder, path)
        builder = datasets.load_dataset_builder(path, spec.name or None)
        files = _data_files(builder, folder, path) if folder is not None else []
        if streaming:
            return builder.as_streaming_dataset(), files
        builder.download_and_prepare()
        return builder.as_dataset(in_memory=False), files


def _data_files(builder, folder: Path, path: str) -> list[Path]:
    """The data files of every split of the builder's configuration, each named below the folder's real path without
    '..': metadata naming a file elsewhere (an absolute path, ../) is refused, as the folder's fingerprint would not
    follow that file. A file reached through a link inside the folder is read, and fingerprinted where it leads."""
    files = []
    for names in (builder.config.data_files or {}).values():
        for name in names:
            file = Path(name)
            if not file.is_relative_to(folder) or ".." in file.relative_to(folder).parts:
                raise DataError(f"{path}: its metadata (README.md configs) names the data file {name}, outside the "
                                f"dataset folder: only files inside it are read; copy or link the file into it")
            files.append(file)
    return files


def _check_card(folder: Path, path: str) -> None:
    """The data_dir and data_files patterns of the folder's configs (README.md's metadata, with .huggingface.yaml over
    it, as the datasets library reads them), checked before the library globs them: each must stay below the folder
    (no absolute path, '..' or URL), or the glob itself could walk the whole disk."""
    import yaml
    from huggingface_hub import DatasetCard

    readme, extra = folder / "README.md", folder / ".huggingface.yaml"
    card = DatasetCard(_metadata_text(readme)).data.to_dict() if readme.exists() else {}
    if extra.exists():
        card.update(yaml.safe_load(_metadata_text(extra)) or {})
    configs = card.get("configs")
    for config in configs if isinstance(configs, list) else []:
        for key in ("data_dir", "data_files"):
            for pattern in _strings(config.get(key) if isinstance(config, dict) else None):
                where = PurePosixPath(pattern)
                if where.is_absolute() or ".." in where.parts or "://" in pattern or "::" in pattern:
                    raise DataError(f"{path}: its metadata (README.md configs) names {key} {pattern[:200]!r}, which "
                                    f"reaches outside the dataset folder: only files inside it are read; copy or link "
                                    f"the files into it")


def _strings(value: object) -> Iterator[str]:
    """Every string in a config's data_dir or data_files (a pattern, a list of them, or splits with their patterns)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key != "split":
                yield from _strings(item)


def _metadata_text(path: Path) -> str:
    """A dataset's metadata file (README.md, a hub cache's ref) as text, read within MAX_JSON_BYTES whatever its size
    says (a sparse file of many GB reads as nothing but zeros), and only if it is a regular file (a link followed:
    a hub snapshot's files are links); DataError in one line otherwise."""
    try:
        return nofollow.read_capped(path, limit=MAX_JSON_BYTES, follow_links=True,
                                    what="a dataset's metadata file").decode("utf-8")
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not valid UTF-8 text ({err.reason} at byte {err.start})") from None


def _said(err: BaseException) -> str:
    return f"{type(err).__name__}: {first_line(err)}"


def _split(splits, spec: HFDatasetConfig, where: str):
    if spec.split not in splits:
        raise DataError(f"{where} has no split '{spec.split}' (it has {', '.join(splits)}); set "
                        f"data.hf_dataset.split")
    return splits[spec.split]


def _files_below(folder: Path) -> list[Path]:
    """The regular files below a dataset folder, sorted, outside hidden folders (a download's own records). Anywhere
    below it, a link to a folder is refused (the datasets library follows one wherever it leads: to /, or in a loop
    without end), and so is anything that is not a file or a folder (a FIFO blocks its reader forever)."""
    files = []
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() and path.is_dir():
            raise DataError(f"{shown(path)} is a link to a folder: a dataset folder's data is read only inside it; "
                            f"give data.hf_dataset.path a folder without such links (a link to a file is fine)")
        if not (path.is_file() or path.is_dir()):
            raise DataError(f"{shown(path)} is not a regular file (a FIFO, device or socket, or a link to nothing): a "
                            f"dataset folder holds files and folders")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts):
            files.append(path)
    return files


def _columns(datasets, rows, where: str, *, text_field: str, chat: ChatFields | None) -> list[str]:
    """The columns to read, checked against those the dataset has."""
    kinds = _column_kinds(datasets, rows)
    names = ", ".join(kinds)
    if chat is not None:
        if chat.messages in kinds or (chat.prompt in kinds and chat.response in kinds):
            return [name for name in (chat.messages, chat.prompt, chat.response) if name in kinds]
        raise DataError(f"{where} has no column '{chat.messages}' (nor '{chat.prompt}' and '{chat.response}'); it has "
                        f"{names}: set data.messages_field")
    if text_field not in kinds:
        raise DataError(f"{where} has no column '{text_field}' (it has {names}); set data.text_field")
    if kinds[text_field] not in ("string", "large_string"):
        raise DataError(f"{where}: column '{text_field}' holds {kinds[text_field]}, not text")
    return [text_field]


def _column_kinds(datasets, rows) -> dict[str, str]:
    """Each column's name and type (a string column's: string or large_string), from the dataset's features, or from
    its first row where it has none (a streamed folder of JSON lines)."""
    import pyarrow as pa

    if rows.features is not None:
        return {name: feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__
                for name, feature in rows.features.items()}
    first = next(iter(rows.with_format("arrow").iter(batch_size=1)), pa.table({}))
    return {field.name: str(field.type) for field in first.schema}
