"""Corpus preparation (text -> tokenizer + sharded token files) and deterministic batch loading.

The loader and mixtures need torch; they are imported on first use, so the preparation's worker
processes, which import data.worker, start without it."""

from .errors import DataError
from .prepare import PrepareSettings, default_dataset_dir, prepare_data, prepare_for_training, stdlib_source_files
from .store import PreparedData, load_prepared

_LAZY = {"BatchPrefetcher": "loader", "TokenDataset": "loader", "Mixture": "mixture", "open_datasets": "mixture"}

__all__ = ["DataError", "PrepareSettings", "PreparedData", "default_dataset_dir", "load_prepared", "prepare_data",
           "prepare_for_training", "stdlib_source_files", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
