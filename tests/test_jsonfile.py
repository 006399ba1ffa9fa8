"""data/jsonfile.py, the bounded JSON reader that config/, data/, fsdp_utils/ and the scripts share: a deeply
nested, oversized, undecodable or non-regular file is one line naming it, never a RecursionError or a blocked
read; brackets inside strings do not count as nesting."""
from __future__ import annotations

import json
import os

import pytest

from data.errors import DataError
from data.jsonfile import MAX_JSON_DEPTH, parse_json, read_json_file


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def test_nesting_is_bounded_before_json_recurses():
    # 100,000 levels: json.loads itself raises RecursionError (the traceback a config.json gave).
    with pytest.raises(RecursionError):
        json.loads(nested(100_000))
    with pytest.raises(ValueError, match=r"^nested more than 64 levels deep \(line 1, column 65\)$"):
        parse_json(nested(100_000))
    # Objects and arrays mixed: the 65th opening bracket, the 63rd of line 3 (after two spaces), is where it is said.
    text = '{"a":\n {"b":\n  ' + nested(63) + "}}"
    with pytest.raises(ValueError, match=r"\(line 3, column 65\)"):
        parse_json(text)
    assert parse_json('{"a": {"b": ' + nested(62) + "}}") == {"a": {"b": json.loads(nested(62))}}
    assert MAX_JSON_DEPTH == 64


def test_brackets_inside_strings_do_not_nest():
    # 200 brackets, and escaped quotes, inside one string: one level deep.
    text = json.dumps({"text": "[{" * 100 + '\\" ]'})
    assert parse_json(text) == json.loads(text)
    assert parse_json(json.dumps(["[" * 100])) == ["[" * 100]


@pytest.mark.parametrize("data, problem", [
    (b'{"a": 1', "not valid JSON (Expecting ',' delimiter at line 1, column 8)"),
    (b'{"a": "\xff"}', "not valid UTF-8 text (invalid start byte at byte 7)"),
    ("9" * 5000, "not readable JSON (Exceeds the limit (4300 digits)"),
])
def test_what_is_not_json_is_one_line(data, problem):
    with pytest.raises(ValueError) as err:
        parse_json(data)
    assert str(err.value).startswith(problem) and "\n" not in str(err.value)


def test_files_are_bounded_and_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(nested(10_000))
    with pytest.raises(DataError, match=f"^{path}: nested more than 64 levels deep"):
        read_json_file(path)
    path.write_text(json.dumps({"x": "y" * 100}))
    assert read_json_file(path) == {"x": "y" * 100}
    with pytest.raises(DataError, match=f"^{path}: more than 100 bytes, more than a JSON file of its kind ever holds$"):
        read_json_file(path, max_bytes=100)
    with pytest.raises(DataError, match=f"^{tmp_path / 'missing.json'}: cannot read it \\(No such file"):
        read_json_file(tmp_path / "missing.json")
    with pytest.raises(DataError, match=f"^{tmp_path}: a folder, not a regular file$"):
        read_json_file(tmp_path)
    os.mkfifo(tmp_path / "fifo.json")  # reading it would wait for a writer forever
    with pytest.raises(DataError, match="fifo.json: a FIFO, not a regular file$"):
        read_json_file(tmp_path / "fifo.json")
    (tmp_path / "link.json").symlink_to(path)  # a hub cache's files are links to its blobs
    assert read_json_file(tmp_path / "link.json") == {"x": "y" * 100}
