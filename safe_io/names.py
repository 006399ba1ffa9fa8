"""A name from outside (a file's path, a dataset's name) as one line of output shows it."""
from __future__ import annotations


def shown(path: object) -> str:
    """A path (or another name from outside) as an error line names it: as it is when every character of it prints,
    else quoted as Python writes a string, so that a newline or a control character in a file's name can neither
    split the line nor forge another."""
    text = str(path)
    return text if text.isprintable() else repr(text)
