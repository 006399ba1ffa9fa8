"""Small records of the run's output directory (trackers.json, the micro-batch cache) replaced whole, without
following links: written under a temporary name beside them, then renamed into place."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ..checkpoint import nofollow


def replace_file(path: Path, data: bytes) -> None:
    """`path` holds `data`, or (interrupted) what it held before. The bytes go to .tmp-<name> beside it (what
    was left there removed, a link as itself; the new file opened exclusively), which is then renamed over
    `path`: a link there is replaced, never written through. A folder at either name is refused (UnsafePath)."""
    tmp = path.with_name(f".tmp-{path.name}")
    for name in (tmp, path):
        try:
            if stat.S_ISDIR(os.lstat(name).st_mode):
                raise nofollow.refusal(name, "a folder")
        except FileNotFoundError:
            pass
    nofollow.remove(tmp)
    with nofollow.open_new(tmp) as f:
        f.write(data)
    os.replace(tmp, path)
