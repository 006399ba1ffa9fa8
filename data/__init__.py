"""Corpus preparation (text -> tokenizer + flat token files) and deterministic batch loading."""

from .loader import BatchPrefetcher, TokenDataset
from .prepare import DataError, PreparedData, load_prepared, prepare_data, stdlib_source_files

__all__ = [
    "BatchPrefetcher",
    "DataError",
    "PreparedData",
    "TokenDataset",
    "load_prepared",
    "prepare_data",
    "stdlib_source_files",
]
