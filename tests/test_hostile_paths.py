"""A symbolic link, a FIFO, a device (like /dev/zero) or a folder at every path of a run's output directory
and its checkpoints that the project reads or writes, and at --resume_from and model.init_from. Each ends
in one error line naming the path, or is replaced: nothing is written through a link (the user's files
elsewhere stay as they were), and nothing blocks (every operation runs under a timeout). The folders that
third-party writers fill (tensorboard/, wandb/, mlruns/, the profiler's and the allocator's) are refused
when they are anything but a folder the run made, before the writer opens a file there.

In process: a world-size-1 gloo group, the tiny model of test_checkpoint_input, the functions the trainer
calls for each path.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from config import CheckpointConfig, Config, LoggingConfig, save_config
from fsdp_utils.checkpoint import io as checkpoint_io
from fsdp_utils.checkpoint.contents import Contents, TrainState
from fsdp_utils.checkpoint.errors import CheckpointError
from fsdp_utils.checkpoint.manager import CheckpointManager
from fsdp_utils.checkpoint.metadata import check_structure
from fsdp_utils.guards.run_lock import RunLocked, take_run_lock
from fsdp_utils.observability.metrics import MetricsWriter
from fsdp_utils.observability.profiling import MemorySnapshots, StepProfiler
from fsdp_utils.observability.trackers import TensorBoardTracker, WandbTracker, mlflow_uri, open_trackers, read_ids
from fsdp_utils.train.microbatch import CACHE_FILE, MicroBatchChoice, read_cache, save_to_cache
from tests.helpers import ROOT, failing_after
from tests.test_checkpoint_input import CONFIG, ENV, TOKENIZER, model_and_optimizer

TIMEOUT_S = 30  # far more than any of these operations takes; a FIFO opened for reading would block forever
KINDS = ["link", "fifo", "device", "folder"]
FOLDERS = ("tensorboard", "wandb", "mlruns", "profile", "steps1-1", "memory")  # the run's folders: a link leads to one


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def manager(out: Path, fmt: str, contents: Contents) -> CheckpointManager:
    section = CheckpointConfig(format=fmt, keep_last_n=0)
    return CheckpointManager(section, out, env=ENV, contents=contents, model_config=dataclasses.asdict(CONFIG))


def save(out: Path, fmt: str, step: int = 1) -> Path:
    model, optimizer = model_and_optimizer()
    return manager(out, fmt, Contents(model, optimizer, TrainState(step=step, samples_seen=8 * step))).save()


def resume(out: Path, fmt: str, resume_from: str) -> None:
    manager(out, fmt, Contents(*model_and_optimizer(seed=1))).load(resume_from)


def write_metrics(out: Path) -> None:
    writer = MetricsWriter(out)
    writer.write({"step": 1, "loss": 1.0})
    writer.close()


def write_tensorboard(out: Path) -> None:
    tracker = TensorBoardTracker(out, run_name="hostile", config={})
    tracker.log_metrics({"train/loss": 1.0}, 1)
    tracker.close()


def write_profile(out: Path) -> None:
    """A profile of step 1 on the CPU, as the trainer's StepProfiler writes it: profile/steps1-1/rank0.pt.trace.json."""
    profiler = StepProfiler(LoggingConfig(profile_steps=[1, 1]), out, rank=0, device=torch.device("cpu"), first_step=0)
    torch.ones(4, 4) @ torch.ones(4, 4)
    profiler.on_step_end(1)
    assert (out / "profile/steps1-1/rank0.pt.trace.json").is_file()


def dump_snapshot(name: str) -> None:
    """What torch.cuda.memory._dump_snapshot does, minus the GPU: the snapshot pickled into a file it opens."""
    with open(name, "wb") as f:
        pickle.dump({"segments": [], "device_traces": []}, f)


def write_memory_snapshot(out: Path) -> None:
    snapshots = MemorySnapshots(LoggingConfig(memory_snapshot=True), out, rank=0, device=torch.device("cpu"))
    with mock.patch.object(torch.cuda.memory, "_dump_snapshot", dump_snapshot):
        assert snapshots.dump("step1").is_file()


def tracked_config(out: Path, *trackers: str) -> Config:
    cfg = Config()
    cfg.run.output_dir, cfg.logging.trackers, cfg.logging.wandb_mode = str(out), list(trackers), "offline"
    return cfg


def open_wandb(out: Path) -> None:
    with mock.patch.dict(os.environ, {"WANDB_CONSOLE": "off", "WANDB_SILENT": "true"}):
        tracker = WandbTracker(out, cfg=tracked_config(out, "wandb"), config={}, run_id=None)
        tracker.log_metrics({"train/loss": 1.0}, 1)
        tracker.close()


def open_mlflow(out: Path) -> None:
    """A fresh run tracked by MLflow's default store, <output_dir>/mlruns; its run id goes to trackers.json."""
    with mock.patch.dict(os.environ):
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        (tracker,) = open_trackers(tracked_config(out, "mlflow"), resumed=False)
        tracker.log_metrics({"train/loss": 1.0}, 1)
        tracker.close()
    assert read_ids(out / "trackers.json")["mlflow"] == tracker.run_id


CACHE_KEY = {"model": {"dim": 64}, "gpu": "H100", "global_batch_size": 16, "world_size": 2}


def cache_round_trip(out: Path) -> None:
    save_to_cache(out, CACHE_KEY, MicroBatchChoice(8, "search", {1: 2.0, 8: 20.0}, 79.0, 71.1, 9.0))
    assert read_cache(out, CACHE_KEY)["micro_batch_size"] == 8


def made(*folders: str) -> Callable[[Path], None]:
    """A setup that makes these folders of the output directory (a hostile path then goes inside them)."""
    return lambda out: [(out / folder).mkdir(parents=True) for folder in folders] and None


def lock(out: Path) -> None:
    held = take_run_lock(out, ENV)
    if held is not None:
        held.release()


def install_tokenizer(out: Path) -> None:
    source = out.parent / "new.model"
    source.write_bytes(b"the run's tokenizer")
    checkpoint_io.install_tokenizer(source, out)


def init_from(out: Path) -> None:
    manager(out, "full", Contents(*model_and_optimizer())).load_weights(str(out / "given"))


def read_given(out: Path) -> None:
    check_structure(out / "given")  # train_fsdp.py's check of --resume_from before the process group starts


def find_tokenizer(out: Path, sha256: str | None = TOKENIZER) -> None:
    """What generate.py, export_hf.py and evaluate.py do first with a checkpoint: find the run's tokenizer beside it."""
    checkpoint_io.find_tokenizer(out / "fsdp_cpt1.pth", None, sha256)


# name -> (the hostile path in the output directory, what runs there first, the operation, whether it writes)
Case = tuple[str, Callable[[Path], object] | None, Callable[[Path], object], bool]
CASES: dict[str, Case] = {
    "metrics.jsonl": ("metrics.jsonl", None, write_metrics, True),
    "tensorboard/": ("tensorboard", None, write_tensorboard, True),
    "config.yaml": ("config.yaml", None, lambda out: save_config(Config(), out / "config.yaml"), True),
    "trackers.json": ("trackers.json", None, lambda out: read_ids(out / "trackers.json"), False),
    "trackers.json written": ("trackers.json", None, open_mlflow, True),
    "trackers.json tmp file": (".tmp-trackers.json", None, open_mlflow, True),
    "mlruns/": ("mlruns", None, open_mlflow, True),
    "wandb/": ("wandb", None, open_wandb, True),
    "wandb/debug.log": ("wandb/debug.log", made("wandb"), open_wandb, True),
    "profile/": ("profile", None, write_profile, True),
    "profile/steps1-1/": ("profile/steps1-1", made("profile"), write_profile, True),
    "profile trace": ("profile/steps1-1/rank0.pt.trace.json", made("profile/steps1-1"), write_profile, True),
    "memory/": ("memory", None, write_memory_snapshot, True),
    "memory snapshot": ("memory/step1_rank0.pickle", made("memory"), write_memory_snapshot, True),
    "micro-batch cache": (CACHE_FILE, None, cache_round_trip, True),
    "micro-batch cache tmp file": (f".tmp-{CACHE_FILE}", None, cache_round_trip, True),
    "config.yaml tmp file": (".tmp-config.yaml", None, lambda out: save_config(Config(), out / "config.yaml"), True),
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
    "tokenizer.model, read by the tools": ("tokenizer.model", None, find_tokenizer, False),
    "tokenizer.model of a checkpoint without its hash": ("tokenizer.model", None,
                                                         lambda out: find_tokenizer(out, None), False),
    "hf_tokenizer/, read by the tools": ("hf_tokenizer", None, find_tokenizer, False),
}


# Written into a new file of a unique name beside the file (nofollow.write_beside), never at `.tmp-<name>`.
WRITTEN_BESIDE = ("trackers.json tmp file", "micro-batch cache tmp file", "config.yaml tmp file")


def make_hostile(path: Path, kind: str, elsewhere: Path) -> None:
    """Put a `kind` at `path` (whatever was there removed). A link leads to the user's own file or folder."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "link":
        target = elsewhere / "users-folder"
        if path.name in FOLDERS or path.name.startswith(".tmp-fsdp_sharded") or "sharded" in path.name:
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


def set_up_case(tmp_path: Path, case: str) -> tuple[Path, Path, Path]:
    """The output directory (the case's setup run in it), a folder elsewhere, and the case's path."""
    where, setup, _, _ = CASES[case]
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    if setup is not None:
        setup(out)
    return out, elsewhere, out / where


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
    out, elsewhere, hostile = set_up_case(tmp_path, case)
    operation, writes = CASES[case][2:]
    make_hostile(hostile, kind, elsewhere)
    before, there = snapshot(elsewhere), os.lstat(hostile)
    error = bounded(lambda: operation(out))
    assert snapshot(elsewhere) == before, "the user's files changed: written through a link"
    if case in WRITTEN_BESIDE:  # a unique temporary name: what stands at `.tmp-<name>` is not the writer's, and stays
        assert error is None and (os.lstat(hostile).st_ino, os.lstat(hostile).st_mode) == (there.st_ino, there.st_mode)
        return
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
            # W&B keeps wandb/debug.log as its own link to the current run's log, inside the run's folder.
            inside = stat.S_ISLNK(mode) and hostile.resolve().is_relative_to(out.resolve())
            assert stat.S_ISREG(mode) or stat.S_ISDIR(mode) or inside, (kind, stat.filemode(mode))


@pytest.mark.parametrize(("folder", "users_file", "operation"), [
    ("profile", "steps1-1/rank0.pt.trace.json", write_profile),
    ("wandb", "debug.log", open_wandb),
    ("mlruns", "0/meta.yaml", open_mlflow),  # MLflow's file store: its default experiment's record
    ("memory", "step1_rank0.pickle", write_memory_snapshot),
], ids=["profile", "wandb", "mlruns", "memory"])
def test_a_linked_tracker_or_profile_folder_leaves_the_users_files_alone(tmp_path, folder, users_file, operation):
    """The run's profile/ (or wandb/) is a link to a folder of the user's that holds a file under the very name
    the profiler (or W&B) writes: refused in one line naming the link, the user's file unchanged."""
    out, users = tmp_path / "run", tmp_path / "users-folder"
    (users / users_file).parent.mkdir(parents=True)
    (users / users_file).write_text("the user's own")
    out.mkdir()
    (out / folder).symlink_to(users)
    with pytest.raises(OSError) as err:
        operation(out)
    assert str(err.value) == (f"{out / folder}: a symbolic link where this library expects a folder; refusing to "
                              "use it (move it away)")
    assert (users / users_file).read_text() == "the user's own" and [p.name for p in users.iterdir()] == [
        Path(users_file).parts[0]]


def test_the_default_mlflow_store_is_named_without_resolving_a_link(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (tmp_path / "users-folder").mkdir()
    (out / "mlruns").symlink_to(tmp_path / "users-folder")
    with mock.patch.dict(os.environ):
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        assert mlflow_uri(tracked_config(out, "mlflow")) == (out.resolve() / "mlruns").as_uri()


# ---- hard links: a copied run folder (`cp -al`, `rsync --link-dest`) shares its files' contents ------------------

# The cases that write a file of the output directory (not a folder; W&B's own log is W&B's to write).
LINKABLE = [case for case, (where, _, _, writes) in CASES.items()
            if writes and Path(where).name not in FOLDERS and "sharded" not in where and where != "wandb/debug.log"]


@pytest.mark.parametrize("case", LINKABLE)
def test_a_hard_link_is_never_written_through(tmp_path, case):
    """A file of the output directory that is a second name of a file elsewhere (as in a folder copied with cp -al):
    the run writes a file of its own there, or refuses in one line naming it; the file elsewhere keeps its bytes."""
    out, elsewhere, hostile = set_up_case(tmp_path, case)
    operation = CASES[case][2]
    if hostile.is_file():  # what the setup wrote there is what the other copy holds
        shutil.copyfile(hostile, elsewhere / "users-file")
        hostile.unlink()
    else:
        (elsewhere / "users-file").write_text("the user's own file\n")
    os.link(elsewhere / "users-file", hostile)
    before = snapshot(elsewhere)
    error = bounded(lambda: operation(out))
    assert snapshot(elsewhere) == before, "the user's file changed: written through a hard link"
    if error is not None:
        line = str(error)
        assert isinstance(error, OSError) and "\n" not in line and str(hostile) in line, repr(error)


@pytest.mark.parametrize("kind", ["file", "folder"])
@pytest.mark.parametrize("case", WRITTEN_BESIDE)
def test_a_users_entry_at_a_temporary_name_is_kept_and_the_write_goes_on(tmp_path, case, kind):
    """A file or folder of the user's at `.tmp-config.yaml` (or the other small records' `.tmp-` names) is neither
    deleted nor in the way: the record is written beside it under a name of its own."""
    where, _, operation, _ = CASES[case]
    out = tmp_path / "run"
    out.mkdir()
    if kind == "file":
        (out / where).write_text("the user's own file")
    else:
        (out / where).mkdir()
        (out / where / "notes.txt").write_text("the user's own file")
    operation(out)
    users = out / where if kind == "file" else out / where / "notes.txt"
    assert users.read_text() == "the user's own file"
    final = out / where.removeprefix(".tmp-")
    assert final.is_file() and not final.is_symlink()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".tmp-")) == [where]


def test_a_link_swapped_in_at_the_temporary_name_is_never_written_through(tmp_path):
    """Another writer in the folder puts a symbolic link to the user's file at the name save_config is about to open
    for its new file, between its check and its open: the open must not follow it (O_EXCL | O_NOFOLLOW) and the
    config goes to a name of its own. An audit hook makes the swap land at that very moment, every time."""
    import sys

    out, users = tmp_path / "run", tmp_path / "users-file"
    out.mkdir()
    users.write_text("the user's own file")
    swapped: list[str] = []

    def swap_in_a_link(event: str, args: tuple) -> None:
        if event == "open" and not swapped and isinstance(args[0], (str, os.PathLike)) and \
                os.path.basename(args[0]).startswith(".tmp-config.yaml") and args[1] != "r":
            swapped.append(os.fspath(args[0]))
            if os.path.lexists(args[0]):
                os.unlink(args[0])
            os.symlink(users, args[0])

    sys.addaudithook(swap_in_a_link)  # hooks stay for the process: `swapped` turns this one off after its swap
    try:
        save_config(Config(), out / "config.yaml")
    finally:
        swapped.append("done")
    assert len(swapped) == 2 and users.read_text() == "the user's own file"
    assert "model:" in (out / "config.yaml").read_text() and not (out / "config.yaml").is_symlink()


# ---- a run that trains nothing leaves no folder it made -------------------------------------------------------


def test_a_run_that_trained_nothing_removes_the_folder_it_made_and_only_that(tmp_path):
    """What a run wrote into a folder it made (run.lock, the journal, files the journal records) goes with the
    folder. A folder that was there before, or that holds anything else, stays with all it holds."""
    from safe_io.journal import Journal

    made = tmp_path / "made"
    lock = take_run_lock(made, ENV)
    Journal(made).install_file(made / "config.yaml", lambda f: f.write(b"run: {}\n"))
    lock.release(discard=True)
    assert not made.exists()

    for users in ("notes.txt", "config.yaml"):  # a file of the user's, or under a name the run writes
        lock = take_run_lock(made, ENV)
        Journal(made).install_file(made / "metrics.jsonl", lambda f: f.write(b""))
        (made / users).write_text("the user's own file")
        lock.release(discard=True)
        assert sorted(p.name for p in made.iterdir()) == sorted(
            {".checkpoint_journal.jsonl", "metrics.jsonl", "run.lock", users})
        assert (made / users).read_text() == "the user's own file"
        shutil.rmtree(made)

    there = tmp_path / "there"
    there.mkdir()
    lock = take_run_lock(there, ENV)
    lock.release(discard=True)
    assert there.is_dir()
    lock = take_run_lock(made, ENV)
    lock.release(discard=False)  # a run that trained keeps its folder
    assert (made / "run.lock").is_file()


# ---- a tokenizer the tools are given ---------------------------------------------------------------------

FIXTURE = ROOT / "tests/fixtures/checkpoints_2026_12"  # a trained checkpoint, and the tokenizer it records


def damaged_tokenizer(path: Path) -> None:
    """The fixture's tokenizer with the first byte of one of its pieces (of two bytes or more) made 0xff: no longer
    UTF-8, which SentencePiece loads and Python cannot decode."""
    from sentencepiece import sentencepiece_model_pb2

    data = (FIXTURE / "tokenizer.model").read_bytes()
    proto = sentencepiece_model_pb2.ModelProto.FromString(data)
    piece = next(p.piece.encode() for p in proto.pieces if p.type == p.NORMAL and len(p.piece.encode()) > 2)
    at = data.index(b"\x0a" + bytes([len(piece)]) + piece) + 2  # field 1 (the piece) of its entry: tag, length
    path.write_bytes(data[:at] + b"\xff" + data[at + 1:])


def hostile_tokenizer(path: Path, kind: str) -> Path:
    """A `kind` of tokenizer at `path` (/dev/zero itself for a device given by name); the path to give."""
    if kind == "sparse":  # 20 GiB of size, no disk: read whole, it exhausted memory
        with path.open("wb") as f:
            f.truncate(20 << 30)
    elif kind == "damaged":
        damaged_tokenizer(path)
    elif kind == "device" and path.name != "tokenizer.model":
        return Path("/dev/zero")
    else:
        make_hostile(path, kind, path.parent)
    return path


def evaluate_tool(checkpoint: Path, tokenizer: Path | None, out_dir: Path) -> int:
    """scripts/evaluate.py as far as the tokenizer: what its main() prints is the error's line."""
    from scripts import evaluate

    try:
        evaluate.load_for_eval(checkpoint, device=torch.device("cpu"), tokenizer=tokenizer)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def generate_tool(checkpoint: Path, tokenizer: Path | None, out_dir: Path) -> int:
    from scripts import generate

    given = ["--tokenizer", str(tokenizer)] if tokenizer else []
    return generate.main([str(checkpoint), "--prompt", "x", "--device", "cpu", *given])


def export_tool(checkpoint: Path, tokenizer: Path | None, out_dir: Path) -> int:
    from scripts import export_hf

    return export_hf.main([str(checkpoint), str(out_dir), *(["--tokenizer", str(tokenizer)] if tokenizer else [])])


TOOLS = {"generate": generate_tool, "export_hf": export_tool, "evaluate": evaluate_tool}
# What the line says of each kind: given by name it is loaded; beside the checkpoint, found by its hash first.
SAYS = {"fifo": "a FIFO", "device": "a device", "sparse": "more than 67,108,864 bytes, more than a tokenizer file",
        "damaged": "a piece of it is not valid UTF-8 text"}


@pytest.mark.parametrize("kind", list(SAYS))
@pytest.mark.parametrize("where", ["--tokenizer", "beside the checkpoint"])
@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_hostile_tokenizer_is_one_error_line_of_every_tool(tmp_path, capsys, tool, where, kind):
    """A FIFO blocked generate.py and export_hf.py for ever, /dev/zero or a sparse file exhausted memory, a damaged
    piece was a UnicodeDecodeError traceback: each is now one line naming the file, read in bounded time and memory."""
    pytest.importorskip("sentencepiece")
    if tool == "evaluate":
        pytest.importorskip("lm_eval")
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "full", run)
    given = hostile_tokenizer(tmp_path / "given.model" if where == "--tokenizer" else run / "tokenizer.model", kind)
    with failing_after(120):  # a FIFO opened for reading blocks for ever: fail instead
        code = TOOLS[tool](run / "fsdp_cpt2.pth", given if where == "--tokenizer" else None, tmp_path / "out")
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and str(given) in err, err
    says = "is another" if (kind, where) == ("damaged", "beside the checkpoint") else SAYS[kind]  # found by its hash
    assert says in err, err
    assert not (tmp_path / "out").exists()


def test_a_fifo_inside_the_runs_tokenizer_folder_is_refused_by_name(tmp_path):
    """A Hugging Face tokenizer's folder beside the checkpoint is hashed file by file: a FIFO there was skipped, for
    transformers to block on when it opened the folder."""
    (tmp_path / "hf_tokenizer").mkdir()
    (tmp_path / "hf_tokenizer/tokenizer_config.json").write_text("{}")
    os.mkfifo(tmp_path / "hf_tokenizer/vocab.json")
    with failing_after(30), pytest.raises(OSError) as caught:
        find_tokenizer(tmp_path)
    assert str(caught.value) == f"{tmp_path / 'hf_tokenizer/vocab.json'}: a FIFO, not a regular file"
