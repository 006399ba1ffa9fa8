"""The checkpoint manager in process: retention, listing and quarantine as plain files (no process group),
then save, load, asynchronous saves, faults and `on_step_end` at 2 gloo ranks spawned inside the test
(tests/distributed_harness.py), on a tiny model wrapped in FSDP1. Each check compares real state: the
model's and optimizer's full state dicts taken before a save against those after loading it into a model
built from another seed, and the RNG stream drawn after the save against the one after the load."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import pytest
import torch

from fsdp_utils.checkpoint.errors import CheckpointError
from fsdp_utils.checkpoint.names import sidecar_of
from fsdp_utils.checkpoint.retention import apply_retention, complete_checkpoints, move_aside, remove_incomplete
from model import ModelConfig
from safe_io.journal import Journal
from tests.distributed_harness import RankFailed, cpu_env, run_ranks

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16, multiple_of=16)


def names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if not p.name.startswith("."))


# ---- retention, listing, quarantine: files only ---------------------------------------------------------


def fake_checkpoints(out: Path, *, full: tuple[int, ...] = (), sharded: tuple[int, ...] = (),
                     unfinished: tuple[int, ...] = (), journal: Journal | None = None) -> None:
    """Files and folders named as the manager names them: full files with their checksum record, sharded
    folders with meta.json, and sharded folders without it (a save that never finished). With `journal`, each is
    made as a save makes it, recorded there as the run's own."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for step in full:
        pth = out / f"fsdp_cpt{step}.pth"
        for path, data in ((pth, b"x" * step), (sidecar_of(pth), b"{}")):
            with journal.create_file(path) if journal else path.open("xb") as f:
                f.write(data)
            made.append(path)
    for step in (*sharded, *unfinished):
        folder = out / f"fsdp_sharded_cpt{step}"
        journal.create_dir(folder) if journal else folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x")
        if step in sharded:
            (folder / "meta.json").write_text("{}")
        made.append(folder)
    for path in made if journal else ():
        journal.seal(path)


def test_complete_checkpoints_lists_only_complete_ones_newest_first(tmp_path):
    fake_checkpoints(tmp_path, full=(2, 10), sharded=(5,), unfinished=(7,))
    (tmp_path / ".tmp-fsdp_cpt11.pth").write_bytes(b"x")
    (tmp_path / "corrupt-fsdp_cpt12.pth").write_bytes(b"x")
    (tmp_path / "fsdp_cpt3.pth.bak").write_bytes(b"x")
    assert [(step, p.name) for step, p in complete_checkpoints(tmp_path)] == [
        (10, "fsdp_cpt10.pth"), (5, "fsdp_sharded_cpt5"), (2, "fsdp_cpt2.pth")]
    assert complete_checkpoints(tmp_path / "missing") == []


def test_retention_counts_the_new_checkpoint_first_and_never_touches_corrupt_ones(tmp_path):
    """After a fallback the newest save can have a lower step than checkpoints on disk (here 3 against 4
    and 6): it is kept, then the newest others up to keep_last_n; a corrupt- one is not counted."""
    journal = Journal(tmp_path)
    fake_checkpoints(tmp_path, full=(2, 3, 4, 6), sharded=(5,), journal=journal)
    move_aside(journal, tmp_path / "fsdp_cpt2.pth")
    apply_retention(journal, tmp_path / "fsdp_cpt3.pth", keep_last_n=2)
    assert names(tmp_path) == ["corrupt-fsdp_cpt2.pth", "fsdp_cpt3.pth", "fsdp_cpt6.pth"]
    assert not sidecar_of(tmp_path / "fsdp_cpt4.pth").exists() and sidecar_of(tmp_path / "fsdp_cpt6.pth").exists()
    apply_retention(journal, tmp_path / "fsdp_cpt6.pth", keep_last_n=0)  # 0 keeps everything
    assert names(tmp_path) == ["corrupt-fsdp_cpt2.pth", "fsdp_cpt3.pth", "fsdp_cpt6.pth"]


def test_retention_deletes_only_checkpoints_the_journal_records(tmp_path):
    """Checkpoints copied into the folder, or replaced by another file under the same name, are not the run's:
    never counted, never deleted, whatever their names."""
    journal = Journal(tmp_path)
    fake_checkpoints(tmp_path, full=(1, 2, 3, 4), journal=journal)
    fake_checkpoints(tmp_path, full=(5,), sharded=(6,))  # the user's, under checkpoints' names
    replaced = tmp_path / "fsdp_cpt2.pth"
    replaced.unlink()
    replaced.write_bytes(b"the user's own file")  # the name the journal records, another file
    apply_retention(journal, tmp_path / "fsdp_cpt4.pth", keep_last_n=1)
    assert names(tmp_path) == ["fsdp_cpt2.pth", "fsdp_cpt4.pth", "fsdp_cpt5.pth", "fsdp_sharded_cpt6"]
    assert replaced.read_bytes() == b"the user's own file" and sidecar_of(tmp_path / "fsdp_cpt5.pth").exists()


def test_move_aside_never_overwrites_and_takes_the_checksum_record_along(tmp_path):
    journal = Journal(tmp_path)
    fake_checkpoints(tmp_path, full=(4,))
    first = move_aside(journal, tmp_path / "fsdp_cpt4.pth")
    fake_checkpoints(tmp_path, full=(4,))
    second = move_aside(journal, tmp_path / "fsdp_cpt4.pth")
    assert (first.name, second.name) == ("corrupt-fsdp_cpt4.pth", "corrupt-2-fsdp_cpt4.pth")
    assert sidecar_of(first).exists() and sidecar_of(second).exists()
    assert complete_checkpoints(tmp_path) == []


def test_remove_incomplete_removes_only_what_interrupted_saves_made(tmp_path):
    """The `.tmp-` file and folder an interrupted save made (recorded in the journal) go; the user's `.tmp-`
    folder, a `.tmp-` file put where the run's own was, and finished checkpoints stay."""
    journal = Journal(tmp_path)
    fake_checkpoints(tmp_path, full=(1,), unfinished=(2,), journal=journal)
    with journal.create_file(tmp_path / ".tmp-fsdp_cpt3.pth") as f:
        f.write(b"x")
    journal.create_dir(tmp_path / ".tmp-fsdp_sharded_cpt4")
    journal.create_dir(tmp_path / ".tmp-fsdp_sharded_cpt5")
    (tmp_path / ".tmp-fsdp_sharded_cpt5").rmdir()
    (tmp_path / ".tmp-fsdp_sharded_cpt5").write_bytes(b"put there after the run's own was gone")
    (tmp_path / ".tmp-mybackup").mkdir()
    (tmp_path / ".tmp-mybackup" / "notes.txt").write_text("the user's")
    remove_incomplete(journal)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".checkpoint_journal.jsonl", ".fsdp_cpt1.pth.json", ".tmp-fsdp_sharded_cpt5", ".tmp-mybackup",
        "fsdp_cpt1.pth", "fsdp_sharded_cpt2"]
    assert (tmp_path / ".tmp-mybackup" / "notes.txt").read_text() == "the user's"


# ---- 2 ranks ---------------------------------------------------------------------------------------------
# Each test spawns its ranks (a few seconds of start-up): marked slow, like every test that starts processes.


def build(seed: int):
    from torch.distributed.fsdp import FullyShardedDataParallel

    from model import Transformer

    torch.manual_seed(seed)
    model = FullyShardedDataParallel(Transformer(CONFIG), use_orig_params=True, device_id=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, rank: int) -> None:
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Model and optimizer as full state dicts (a collective), flattened to {"model.x": tensor, ...}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    flat: dict[str, torch.Tensor] = {}

    def walk(obj, key):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}.{i}")
        else:
            is_number = isinstance(obj, (int, float))
            flat[key] = obj if isinstance(obj, torch.Tensor) else torch.tensor(obj) if is_number else obj

    walk({"model": model_sd, "optimizer": optim_sd}, "")
    return flat


def differences(a: dict, b: dict) -> list[str]:
    """Keys whose values are not bit-identical (or missing on one side)."""
    diff = sorted(set(a) ^ set(b))
    for key in set(a) & set(b):
        x, y = a[key], b[key]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        if not same:
            diff.append(key)
    return diff


def new_manager(out: Path, rank: int, world_size: int, fmt: str, model, optimizer, **section_fields):
    """The manager of checkpoints of `model` and `optimizer` (its train state: manager.contents.state)."""
    from config import CheckpointConfig
    from fsdp_utils.checkpoint import CheckpointManager, Contents

    section = CheckpointConfig(**{"format": fmt, "keep_last_n": 0, **section_fields})
    return CheckpointManager(section, out, contents=Contents(model, optimizer), model_config=dataclasses.asdict(CONFIG),
                             env=cpu_env(rank, world_size))


def load_and_compare(out: Path, rank: int, world_size: int, fmt: str, reference: dict, resume_from: str = "latest"):
    """Load into a model built from another seed (RNG scrambled first): (TrainState, differing keys,
    the RNG stream right after the load)."""
    model, optimizer = build(seed=1)
    torch.manual_seed(1000 + rank)
    state = new_manager(out, rank, world_size, fmt, model, optimizer).load(resume_from)
    return state, differences(reference, full_state(model, optimizer)), torch.rand(4)


def round_trip(rank: int, world_size: int, *, out: Path, fmt: str, writer: str | None) -> dict:
    """Train a step, save at step 3 (in the background with `writer`), load into another model."""
    model, optimizer = build(seed=0)
    train_step(model, optimizer, rank)
    manager = new_manager(out, rank, world_size, fmt, model, optimizer, async_save=writer is not None,
                          async_writer=writer or "thread")
    manager.prepare_saving()
    reference = full_state(model, optimizer)
    manager.contents.state.step, manager.contents.state.samples_seen, manager.contents.state.tokens_seen = 3, 24, 192
    path = manager.save()
    stream = torch.rand(4)  # the RNG as saved: the load restores it
    in_flight, polls = manager.in_flight, 0
    while manager.in_flight:  # every rank polls as often: each poll agrees on "every write done"
        time.sleep(0.05)
        manager.poll()
        polls += 1
    manager.close()
    state, diff, loaded_stream = load_and_compare(out, rank, world_size, fmt, reference)
    return {"path": path.name, "state": (state.step, state.samples_seen, state.tokens_seen), "diff": diff,
            "compared": len(reference), "rng_restored": torch.equal(stream, loaded_stream), "in_flight": in_flight,
            "polls": polls, "modes": [row["mode"] for row in manager.stats]}


@pytest.mark.slow
@pytest.mark.parametrize("fmt, writer", [("full", None), ("sharded", None), ("sharded", "thread")],
                         ids=["full", "sharded", "sharded-async-thread"])
def test_save_then_load_restores_everything_at_2_ranks(tmp_path, fmt, writer):
    results = run_ranks(round_trip, out=tmp_path, fmt=fmt, writer=writer)
    name = "fsdp_cpt3.pth" if fmt == "full" else "fsdp_sharded_cpt3"
    assert names(tmp_path) == [name]
    for r in results:
        assert r["path"] == name and r["state"] == (3, 24, 192)
        assert r["diff"] == [] and r["compared"] > 10, r["diff"]
        assert r["rng_restored"]
        assert r["in_flight"] == (writer is not None) and r["modes"] == ["async" if writer else "sync"]
    assert results[0]["polls"] == results[1]["polls"]


def failing_background_write(rank: int, world_size: int, *, out: Path, faults: dict, on_error: str) -> dict:
    """An asynchronous save of step 2 whose background write fails (tests/fault_injection.py), through
    on_step_end at the interval; then the last step's save."""
    from tests import fault_injection

    fault_injection.install(faults)
    model, optimizer = build(seed=0)
    train_step(model, optimizer, rank)
    manager = new_manager(out, rank, world_size, "sharded", model, optimizer, interval=2, async_save=True,
                          on_async_error=on_error)
    manager.prepare_saving()
    reference = full_state(model, optimizer)
    error = None
    try:
        manager.contents.state.step = 2
        manager.on_step_end(stopping=False, last=False)
        while manager.in_flight:  # as the loop's next steps would: the failure shows at a poll
            time.sleep(0.05)
            manager.poll()
    except CheckpointError as err:
        error = str(err)
    result = {"error": error}
    if (out / "fsdp_sharded_cpt2").exists():
        _, result["diff"], _ = load_and_compare(out, rank, world_size, "sharded", reference)
    after = None
    if error is None:
        manager.contents.state.step = 3
        after = manager.on_step_end(stopping=False, last=True)
    manager.close()
    return {**result, "modes": [row["mode"] for row in manager.stats], "last": after and after.name}


@pytest.mark.slow
def test_a_failed_background_write_is_redone_synchronously_from_the_staged_copy(tmp_path):
    results = run_ranks(failing_background_write, out=tmp_path, faults={"write": {"step": 2, "fail": True}},
                        on_error="stop")
    for r in results:
        assert r["error"] is None and r["diff"] == []
        # Step 2 written again in the foreground; the last save synchronous, as after any failed async save.
        assert r["modes"] == ["sync-retry", "sync"] and r["last"] == "fsdp_sharded_cpt3"
    assert names(tmp_path) == ["fsdp_sharded_cpt2", "fsdp_sharded_cpt3"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_background_write_whose_retry_fails_too(tmp_path, policy):
    results = run_ranks(failing_background_write, out=tmp_path, on_error=policy,
                        faults={"write": {"step": 2, "fail": True}, "sync_write_fail": [2]})
    for r in results:
        if policy == "stop":
            assert r["error"].startswith(f"{tmp_path / 'fsdp_sharded_cpt2'}: the background write failed (rank 0: "
                                         f"OSError: [Errno 5] injected write failure"), r["error"]
            assert "the synchronous retry failed too" in r["error"] and "checkpoint.on_async_error=stop" in r["error"]
        else:
            assert r["error"] is None and r["last"] == "fsdp_sharded_cpt3"
    assert names(tmp_path) == ([] if policy == "stop" else ["fsdp_sharded_cpt3"])


def fallback_and_retention(rank: int, world_size: int, *, out: Path, fmt: str) -> dict:
    """Checkpoints 2 and 4 (keep_last_n=2), the newest damaged; `latest` falls back to 2 and moves 4 aside;
    the next saves (3, then 4 again) count only good checkpoints and never touch the one moved aside."""
    import torch.distributed as dist

    from fsdp_utils.checkpoint import io as checkpoint_io

    model, optimizer = build(seed=0)
    manager = new_manager(out, rank, world_size, fmt, model, optimizer, keep_last_n=2)
    reference = None
    for step in (2, 4):
        train_step(model, optimizer, rank)
        if step == 2:
            reference = full_state(model, optimizer)
        manager.contents.state.step = step
        manager.save()
    if rank == 0:
        newest = out / ("fsdp_cpt4.pth" if fmt == "full" else "fsdp_sharded_cpt4")
        damaged = newest if fmt == "full" else sorted(newest.glob("*.distcp"))[-1]
        with open(damaged, "r+b") as f:
            f.truncate(damaged.stat().st_size // 2)
    dist.barrier()
    state, diff, _ = load_and_compare(out, rank, world_size, fmt, reference)
    seen = {"loaded": state.step, "diff": diff, "after_fallback": names(out)}
    manager = new_manager(out, rank, world_size, fmt, *build(seed=2), keep_last_n=2)
    for step in (3, 4):
        manager.contents.state.step = step
        manager.save()
        dist.barrier()  # rank 0 applies retention after the save's last collective
        seen[f"after_{step}"] = names(out)
    for _, path in manager.complete_checkpoints():
        checkpoint_io.verify(path)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_latest_falls_back_past_a_damaged_checkpoint_and_retention_keeps_the_good_one(tmp_path, fmt):
    name = "fsdp_cpt{}.pth" if fmt == "full" else "fsdp_sharded_cpt{}"
    results = run_ranks(fallback_and_retention, out=tmp_path, fmt=fmt)
    for r in results:
        assert r["loaded"] == 2 and r["diff"] == []
        assert r["after_fallback"] == ["corrupt-" + name.format(4), name.format(2)]
        assert r["after_3"] == ["corrupt-" + name.format(4), name.format(2), name.format(3)]
        assert r["after_4"] == ["corrupt-" + name.format(4), name.format(3), name.format(4)]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def step_end_calls(rank: int, world_size: int, *, out: Path, writer: str | None, stop_at: int | None) -> dict:
    """on_step_end at every step of 8 (interval 2, keep_last_n=2), stopping at `stop_at` if given."""
    lines = _Lines()
    logging.getLogger("fsdp_utils.checkpoint").addHandler(lines)
    logging.getLogger("fsdp_utils.checkpoint").setLevel(logging.INFO)
    model, optimizer = build(seed=0)
    manager = new_manager(out, rank, world_size, "sharded", model, optimizer, interval=2, keep_last_n=2,
                          async_save=writer is not None, async_writer=writer or "thread")
    returned = {}
    for step in range(1, 9):
        train_step(model, optimizer, rank)
        stopping = step == stop_at
        manager.contents.state.step = step
        path = manager.on_step_end(stopping=stopping, last=step == 8)
        returned[step] = path and path.name
        if stopping:
            break
    in_flight = manager.in_flight
    manager.close()
    torch.distributed.barrier()  # rank 0 applies retention after the save's last collective
    return {"returned": returned, "in_flight": in_flight, "names": names(out),
            "removed": sum("removing old checkpoint" in line for line in lines.lines)}


@pytest.mark.slow
@pytest.mark.parametrize("writer", [None, "thread"], ids=["sync", "async-thread"])
def test_on_step_end_saves_at_the_interval_and_the_last_step(tmp_path, writer):
    """Saves at 2, 4, 6 and 8; keep_last_n=2 leaves 6 and 8, removing 2 (at the save of 6) and 4 (at 8);
    the last step's save is complete when on_step_end returns."""
    results = run_ranks(step_end_calls, out=tmp_path, writer=writer, stop_at=None)
    for r in results:
        assert r["returned"] == {s: f"fsdp_sharded_cpt{s}" if s % 2 == 0 else None for s in range(1, 9)}
        assert not r["in_flight"] and r["names"] == ["fsdp_sharded_cpt6", "fsdp_sharded_cpt8"]
    assert results[0]["removed"] == 2  # rank 0 applies retention


@pytest.mark.slow
def test_on_step_end_saves_and_completes_at_a_stop_signal(tmp_path):
    results = run_ranks(step_end_calls, out=tmp_path, writer="thread", stop_at=3)
    for r in results:
        assert r["returned"] == {1: None, 2: "fsdp_sharded_cpt2", 3: "fsdp_sharded_cpt3"}
        assert not r["in_flight"] and r["names"] == ["fsdp_sharded_cpt2", "fsdp_sharded_cpt3"]


def raises_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1's own failure")
    return rank


@pytest.mark.slow
def test_the_harness_returns_values_and_reports_a_rank_failure_with_its_traceback():
    assert run_ranks(raises_on_rank_1, world_size=1) == [0]
    with pytest.raises(RankFailed,
                       match=r"(?s)rank 1 of 2 raised:.*raises_on_rank_1.*ValueError: rank 1's own failure"):
        run_ranks(raises_on_rank_1, world_size=2)


def files_a_save_runs(rank: int, world_size: int, *, out: Path, fmt: str) -> list[str]:
    """The files of fsdp_utils/checkpoint/ whose functions run during one synchronous save (the manager built
    and prepared beforehand), as sys.setprofile sees the calls."""
    import sys

    package = Path(__file__).resolve().parents[1] / "fsdp_utils" / "checkpoint"
    manager = new_manager(out, rank, world_size, fmt, *build(seed=0), async_save=False)
    manager.contents.state.step = 1
    manager.prepare_saving()
    ran: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            ran.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        manager.save()
    finally:
        sys.setprofile(None)
    manager.close()
    return sorted(Path(name).name for name in ran if Path(name).resolve().parent == package)


@pytest.mark.slow
def test_a_synchronous_sharded_save_runs_few_files_of_the_package(tmp_path):
    """The work of a save stays in the modules of its jobs (the manager, with the settling of a background save, the
    contents, the context and the format, the format's names, checksums and checks, retention): one more file on the
    path is a file that should not be there."""
    files = run_ranks(files_a_save_runs, world_size=1, out=tmp_path, fmt="sharded")[0]
    assert (tmp_path / "fsdp_sharded_cpt1" / "meta.json").is_file()
    assert "manager.py" in files and "sharded.py" in files
    assert set(files) <= {"manager.py", "async_save.py", "contents.py", "base.py", "sharded.py", "names.py",
                          "checksums.py", "metadata.py", "retention.py"}, files
