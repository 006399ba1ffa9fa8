"""JSON that comes from outside (a model folder's config.json, a checkpoint's or a prepared folder's records, a
cache, a metrics line), read within bounds: a file's size, and the nesting depth, which Python's json module
follows by recursion (a file of a few hundred kilobytes of brackets is otherwise a RecursionError traceback).
data/ is the lowest package, so config/, fsdp_utils/ and the scripts all read JSON through here."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from safe_io import nofollow

from .errors import DataError

# Configs, indexes and records nest a handful of levels; far deeper is not a file any library wrote.
MAX_JSON_DEPTH = 64
# A model's config.json or a sharded checkpoint's index is kilobytes; a file far larger is something else.
MAX_JSON_BYTES = 64 * 2**20

# A JSON string (escapes included) or one bracket: brackets inside strings do not nest anything.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


def _depth_problem(text: str, max_depth: int) -> str | None:
    """Where `text` first nests deeper than max_depth, without recursing (None when it does not)."""
    if text.count("[") + text.count("{") <= max_depth:  # too few brackets to nest that deep
        return None
    depth = 0
    for match in _TOKENS.finditer(text):
        char = match.group()
        if char in ("[", "{"):
            depth += 1
            if depth > max_depth:
                pos = match.start()
                line, column = text.count("\n", 0, pos) + 1, pos - text.rfind("\n", 0, pos)
                return f"nested more than {max_depth} levels deep (line {line}, column {column})"
        elif char in ("]", "}"):
            depth -= 1
    return None


def parse_json(data: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads of `data`, nested at most max_depth levels; ValueError in one line (which the caller prefixes
    with where the data came from) for text that is not UTF-8, not JSON or nested deeper."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = data.decode(json.detect_encoding(data))
        except UnicodeDecodeError as err:
            raise ValueError(f"not valid UTF-8 text ({err.reason} at byte {err.start})") from None
    if (problem := _depth_problem(data, max_depth)) is not None:
        raise ValueError(problem)
    try:
        return json.loads(data)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    except RecursionError:  # only when called with the stack nearly full already
        raise ValueError("nested too deeply to read") from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise ValueError(f"not readable JSON ({err})") from None


def read_json_file(path: Path, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value in the file `path` (links followed: a hub cache's files are links), DataError in one line
    naming it when it cannot be read, is not a regular file (a FIFO would block), holds more than max_bytes
    (nofollow.read_capped: whatever its size says), is not JSON or nests deeper than max_depth."""
    try:
        data = nofollow.read_capped(path, limit=max_bytes, follow_links=True, what="a JSON file of its kind")
    except nofollow.UnsafePath as err:
        raise DataError(str(err)) from None
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        return parse_json(data, max_depth=max_depth)
    except ValueError as err:
        raise DataError(f"{path}: {err}") from None
