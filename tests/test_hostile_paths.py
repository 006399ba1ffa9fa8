"""A symbolic link, a FIFO, a device (like /dev/zero) or a folder at every path of a run's output directory
and its checkpoints that the project reads or writes, and at --resume_from and model.init_from. Each ends
in one error line naming the path, or is replaced: nothing is written through a link (the user's files
elsewhere stay as they were), and nothing blocks (every operation runs under a timeout).

In process: a world-size-1 gloo group, the tiny model of test_checkpoint_input, the functions the trainer
calls for each path.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

from config import CheckpointConfig, Config, save_config
from fsdp_utils.checkpoint import io as checkpoint_io
from fsdp_utils.checkpoint.format import CheckpointError, check_structure
from fsdp_utils.checkpoint.manager import CheckpointManager, TrainState
from fsdp_utils.train.metrics import MetricsWriter
from fsdp_utils.train.run_lock import RunLocked, take_run_lock
from fsdp_utils.train.trackers import TensorBoardTracker, read_ids
from tests.test_checkpoint_input import CONFIG, ENV, model_and_optimizer

TIMEOUT_S = 30  # far more than any of these operations takes; a FIFO opened for reading would block forever
KINDS = ["link", "fifo", "device", "folder"]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def manager(out: Path, fmt: str) -> CheckpointManager:
    section = CheckpointConfig(format=fmt, keep_last_n=0)
    return CheckpointManager(section, out, env=ENV, model_config=dataclasses.asdict(CONFIG))


def save(out: Path, fmt: str, step: int = 1) -> Path:
    model, optimizer = model_and_optimizer()
    return manager(out, fmt).save(model, optimizer, TrainState(step=step, samples_seen=8 * step))


def resume(out: Path, fmt: str, resume_from: str) -> None:
    model, optimizer = model_and_optimizer(seed=1)
    manager(out, fmt).load(model, optimizer, resume_from)


def write_metrics(out: Path) -> None:
    writer = MetricsWriter(out)
    writer.write({"step": 1, "loss": 1.0})
    writer.close()


def write_tensorboard(out: Path) -> None:
    tracker = TensorBoardTracker(out, run_name="hostile", config={})
    tracker.log_metrics({"train/loss": 1.0}, 1)
    tracker.close()


def lock(out: Path) -> None:
    fd = take_run_lock(out, ENV)
    if fd is not None:
        os.close(fd)


def install_tokenizer(out: Path) -> None:
    source = out.parent / "new.model"
    source.write_bytes(b"the run's tokenizer")
    checkpoint_io.install_tokenizer(source, out)


def init_from(out: Path) -> None:
    model, _ = model_and_optimizer()
    manager(out, "full").load_weights(model, str(out / "given"))


def read_given(out: Path) -> None:
    check_structure(out / "given")  # train_fsdp.py's check of --resume_from before the process group starts


# name -> (the hostile path in the output directory, what runs there first, the operation, whether it writes)
Case = tuple[str, Callable[[Path], object] | None, Callable[[Path], object], bool]
CASES: dict[str, Case] = {
    "metrics.jsonl": ("metrics.jsonl", None, write_metrics, True),
    "tensorboard/": ("tensorboard", None, write_tensorboard, True),
    "config.yaml": ("config.yaml", None, lambda out: save_config(Config(), out / "config.yaml"), True),
    "trackers.json": ("trackers.json", None, lambda out: read_ids(out / "trackers.json"), False),
    "run.lock": ("run.lock", None, lock, True),
    "tokenizer.model": ("tokenizer.model", None, install_tokenizer, True),
    "full tmp file": (".tmp-fsdp_cpt1.pth", None, lambda out: save(out, "full"), True),
    "sharded tmp folder": (".tmp-fsdp_sharded_cpt1", None, lambda out: save(out, "sharded"), True),
    "full checkpoint saved over": ("fsdp_cpt1.pth", None, lambda out: save(out, "full"), True),
    "sharded checkpoint saved over": ("fsdp_sharded_cpt1", None, lambda out: save(out, "sharded"), True),
    "checksum record": (".fsdp_cpt1.pth.json", None, lambda out: save(out, "full"), True),
    "checkpoint journal": (".checkpoint_journal.jsonl", None, lambda out: save(out, "sharded"), True),
    "checkpoint journal, read": (".checkpoint_journal.jsonl", lambda out: save(out, "full"),
                                 lambda out: save(out, "full", step=2), True),
    "latest full": ("fsdp_cpt2.pth", lambda out: save(out, "full"), lambda out: resume(out, "full", "latest"), False),
    "latest sharded": ("fsdp_sharded_cpt2", lambda out: save(out, "sharded"),
                       lambda out: resume(out, "sharded", "latest"), False),
    "checksum record read": (".fsdp_cpt1.pth.json", lambda out: save(out, "full"),
                             lambda out: resume(out, "full", "latest"), False),
    "rng.pt in a checkpoint": ("fsdp_sharded_cpt1/rng.pt", lambda out: save(out, "sharded"),
                               lambda out: resume(out, "sharded", "latest"), False),
    "meta.json in a checkpoint": ("fsdp_sharded_cpt1/meta.json", lambda out: save(out, "sharded"),
                                  lambda out: resume(out, "sharded", "latest"), False),
    "--resume_from": ("given", None, lambda out: resume(out, "full", str(out / "given")), False),
    "--resume_from, checked at the start": ("given", None, read_given, False),
    "model.init_from": ("given", None, init_from, False),
}


def make_hostile(path: Path, kind: str, elsewhere: Path) -> None:
    """Put a `kind` at `path` (whatever was there removed). A link leads to the user's own file or folder."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "link":
        target = elsewhere / "users-folder"
        if path.name in ("tensorboard",) or path.name.startswith(".tmp-fsdp_sharded") or "sharded" in path.name:
            target.mkdir()
            (target / "notes.txt").write_text("the user's own folder")
        else:
            target.write_text("the user's own file")
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is: reads never end
        except PermissionError:
            pytest.skip("making a device file needs privileges this test does not have")
    else:
        path.mkdir()
        (path / "notes.txt").write_text("a folder where a file goes")


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def bounded(work: Callable[[], object]) -> BaseException | None:
    """Run `work` in a thread; its exception or None. A call still running after TIMEOUT_S fails the test."""
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            work()
        except BaseException as err:  # handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), f"still running after {TIMEOUT_S} s: it blocks"
    return outcome.get("error")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_path_is_refused_in_one_line_or_replaced(tmp_path, case, kind):
    where, setup, operation, writes = CASES[case]
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    if setup is not None:
        setup(out)
    hostile = out / where
    make_hostile(hostile, kind, elsewhere)
    before = snapshot(elsewhere)
    error = bounded(lambda: operation(out))
    assert snapshot(elsewhere) == before, "the user's files changed: written through a link"
    if error is not None:
        assert isinstance(error, (OSError, CheckpointError, RunLocked)), repr(error)
        line = str(error)
        assert line and "\n" not in line and str(hostile) in line, line
    else:
        # A folder under a sharded checkpoint's name without meta.json is no checkpoint: moved aside as corrupt.
        assert writes or (case, kind) == ("latest sharded", "folder"), f"read {kind} at {hostile} as the run's own"
        # Replaced, or removed (an interrupted save's leftover): never left for the next write to go through.
        if os.path.lexists(hostile):
            mode = os.lstat(hostile).st_mode
            assert stat.S_ISREG(mode) or stat.S_ISDIR(mode), (kind, stat.filemode(mode))
