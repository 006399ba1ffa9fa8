"""The files a run keeps in its output directory beside its checkpoints: the record of its settings, its tokenizer,
the micro-batch search's result, metrics.jsonl and tensorboard/, each recorded in the directory's journal when the
run makes it. Rank 0 writes them once the resume has loaded, and only for a run that will train. config.yaml holds
the settings the run started with; a later start that trains with other settings adds config.1.yaml, ... (each naming
the step it trained from). A fresh start keeps aside as kept-<name> what stands at a name it writes and is not the
run's own (Journal.keep_foreign), never writing over or appending to a file of the user's."""
from __future__ import annotations

import os
import re
from pathlib import Path

from config import Config
from config.loading import MAX_CONFIG_BYTES, config_text
from safe_io import nofollow
from safe_io.journal import Journal

from ..checkpoint.io import install_tokenizer
from ..observability.metrics import METRICS_NAME
from ..observability.trackers import IDS_FILE
from ..parallel.hf import RUN_CONFIG_NAME
from .build_run import BuiltRun
from .microbatch import save_to_cache

TENSORBOARD = "tensorboard"  # the tracker, and its folder (TensorBoardTracker)
_RECORD_RE = re.compile(r"^config\.(\d+)\.yaml$")


def write_run_files(cfg: Config, *, tokenizer: Path, built: BuiltRun, step: int, resumed: Path | None) -> None:
    """Rank 0, before the first step of a run that starts at `step`, resumed from the checkpoint `resumed` (None: a
    fresh start): the record of its settings; the run's tokenizer beside its checkpoints (generate.py and
    export_hf.py find it there); the micro-batch search's result for the next start; metrics.jsonl and tensorboard/."""
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    journal = Journal(out)
    trackers = cfg.logging.trackers
    if resumed is None:
        writes = [RUN_CONFIG_NAME, METRICS_NAME, *([TENSORBOARD] if TENSORBOARD in trackers else []),
                  *([IDS_FILE] if set(trackers) - {TENSORBOARD} else [])]  # the other trackers' run ids
        for name in writes:
            journal.keep_foreign(out / name, why=f"this run's {name}")
    record_settings(journal, cfg, step=step, resumed=resumed)
    install_tokenizer(tokenizer, out)
    if built.choice.how == "search":
        save_to_cache(out, built.cache_key, built.choice)
    if not os.path.lexists(out / METRICS_NAME):
        journal.create_file(out / METRICS_NAME).close()
    if TENSORBOARD in trackers and not os.path.lexists(out / TENSORBOARD):
        journal.create_dir(out / TENSORBOARD)


def settings_records(out: Path) -> list[Path]:
    """The records of a run's settings in its output directory, oldest first: config.yaml, then config.<k>.yaml."""
    numbered = sorted((int(m.group(1)), entry.name) for entry in os.scandir(out) if (m := _RECORD_RE.match(entry.name)))
    first = [out / RUN_CONFIG_NAME] if os.path.lexists(out / RUN_CONFIG_NAME) else []
    return first + [out / name for _, name in numbered]


def record_settings(journal: Journal, cfg: Config, *, step: int, resumed: Path | None) -> None:
    """Add the record of this start's settings where they differ from the newest record (or there is none); never
    change a record there is."""
    text = config_text(cfg)
    records = settings_records(journal.dir)
    if not records:
        name = RUN_CONFIG_NAME
        header = "" if resumed is None else f"# this run's settings from step {step} on (resumed from {resumed})\n"
    elif _settings_of(records[-1]) == text:
        return
    else:
        last = _RECORD_RE.match(records[-1].name)
        name = f"config.{int(last.group(1)) + 1 if last else 1}.yaml"
        since = f"resumed from {resumed}" if resumed is not None else "started again"
        header = (f"# this run's settings from step {step} on ({since}); {records[0].name} holds those it started "
                  "with\n")
    journal.install_file(journal.dir / name, lambda f: f.write((header + text).encode()))


def _settings_of(record: Path) -> str | None:
    """A record's YAML without its opening comment lines; None if it cannot be read (it is then not these settings)."""
    try:
        text = nofollow.read_small(record, limit=MAX_CONFIG_BYTES).decode(errors="replace")
    except OSError:
        return None
    lines = text.splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)
