"""Checkpoints end to end: real train_fsdp.py processes (torchrun, gloo on the CPU) on a tiny model.

What is checked: exact stop-and-resume for both formats with gradient accumulation; resume at
another world size; atomic saves (a killed save is ignored and cleaned up); fallback past a corrupt
checkpoint; clear errors for a mismatched model, a missing or corrupt path; the full
checkpoint as plain torch.load-able weights; and scripts/convert_checkpoint.py. Retention, and the manager
itself at 2 ranks, are tested in process in tests/test_checkpoint_manager.py.

The expensive runs (a few seconds each) are made once per module by `Runs` and shared by the tests.
"""
from __future__ import annotations

import importlib.util
import io
import json
import pickle
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from fsdp_utils.checkpoint import io as checkpoint_io
from fsdp_utils.checkpoint.checksums import META_CRC_KEY, meta_crc32
from fsdp_utils.checkpoint.names import sidecar_of
from fsdp_utils.guards.run_lock import LOCK_NAME
from model import ModelConfig, Transformer
from tests import helpers
from tests.helpers import ROOT, losses, read_metrics, run_train, worker_tracebacks

pytestmark = pytest.mark.slow  # every test here launches training processes

# 6 steps of global batch 8 = micro-batch 2 x 2 ranks x 2 accumulation steps.
STEPS = 6
SPLIT = 3  # the step the "stopped" runs checkpoint at
CONVERT = ROOT / "scripts" / "convert_checkpoint.py"
FORMATS = ("full", "sharded")
# The runs' arguments per train.optimizer: Muon needs FSDP2 (the tiny config's default is FSDP1).
OPTIMIZER_ARGS = {"adamw": (), "muon": ("--fsdp.version=2", "--train.optimizer=muon")}


def ckpt_name(fmt: str, step: int) -> str:
    return f"fsdp_cpt{step}.pth" if fmt == "full" else f"fsdp_sharded_cpt{step}"


def checkpoint_names(out_dir: Path) -> list[str]:
    """Checkpoints and leftovers in out_dir (a refused run may not have created it at all)."""
    if not out_dir.exists():
        return []
    return sorted(p.name for p in out_dir.iterdir() if p.name.startswith(("fsdp_", ".tmp-")))


def copy_checkpoint(src: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / src.name
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy2(src, dst)
    return dst


def truncate_to_half(path: Path) -> None:
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size // 2)


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def assert_clean_error(proc, *needles: str) -> str:
    """Non-zero exit, an 'error:' line holding every needle, and no Python traceback."""
    assert proc.returncode != 0, f"expected a failure:\n{proc.stderr[-3000:]}"
    lines = error_lines(proc)
    assert lines, f"no 'error:' line in:\n{proc.stderr[-3000:]}"
    text = "\n".join(lines)
    for needle in needles:
        assert needle in text, f"{needle!r} not in the error:\n{text}"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    return text


def structure(obj):
    """The shape of a payload: dict keys, sequence lengths, tensor dtypes/shapes, and leaf types."""
    if isinstance(obj, dict):
        return {k: structure(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [structure(v) for v in obj])
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, tuple(obj.shape))
    return type(obj).__name__


def assert_identical(a, b, where: str = "") -> None:
    """Same structure and bit-identical tensors (non-tensor leaves compared with ==)."""
    assert structure(a) == structure(b), f"{where}: structures differ"
    if isinstance(a, dict):
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where}: tensors differ (max abs diff {(a.double() - b.double()).abs().max()})"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def load_full(path: Path) -> dict:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    # Loaded by FSDP2 from a full state dict, torch gives AdamW's betas back as a list: the same numbers.
    for group in payload.get("optimizer", {}).get("param_groups", []):
        group.update({k: list(v) for k, v in group.items() if isinstance(v, tuple)})
    return payload


def converter():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_full(checkpoint: Path, scratch: Path) -> dict:
    """A checkpoint's payload in the full layout: a full one as is, a sharded one converted (to `scratch`)."""
    return load_full(checkpoint) if checkpoint.is_file() else converter().convert(checkpoint, scratch)


# train_fsdp.py itself, run with fault injection and inspection hooks (environment variables):
#   KILL_AT_STEP=k     SIGKILL this process in the middle of the save of step k (no cleanup): full: after
#                      half of the temporary file is on disk; sharded: after this rank's shard is written,
#                      before meta.json.
#   SAVE_LOADED_TO=dir right after a resume has loaded its checkpoint (RNG scrambled before the load, so
#                      the load must restore it), write what every rank now holds as a full checkpoint
#                      into dir, then train on as usual.
HOOKED_TRAIN = '''
import os, runpy, signal, sys
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from config import CheckpointConfig
from fsdp_utils.checkpoint import manager as ckpt

kill_at = os.environ.get("KILL_AT_STEP")
torch_save, dcp_save, load = torch.save, dcp.save, ckpt.CheckpointManager.load

def save(obj, f, *args, **kwargs):
    torch_save(obj, f, *args, **kwargs)
    name = str(getattr(f, "name", f))
    if kill_at and name.endswith(f".tmp-fsdp_cpt{{kill_at}}.pth"):
        f.flush()
        os.truncate(name, os.path.getsize(name) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

def sharded_save(state_dict, *args, checkpoint_id=None, **kwargs):
    result = dcp_save(state_dict, *args, checkpoint_id=checkpoint_id, **kwargs)
    if kill_at and str(checkpoint_id).endswith(f".tmp-fsdp_sharded_cpt{{kill_at}}"):
        os.kill(os.getpid(), signal.SIGKILL)
    return result

def load_then_save(self, resume_from):
    torch.manual_seed(1000 + self.env.rank)
    state = load(self, resume_from)
    out = Path(os.environ["SAVE_LOADED_TO"])
    section = CheckpointConfig(format="full", keep_last_n=0)
    ckpt.CheckpointManager(section, out, contents=self.contents, model_config=self.model_config, env=self.env).save()
    return state

torch.save, dcp.save = save, sharded_save
if os.environ.get("SAVE_LOADED_TO"):
    ckpt.CheckpointManager.load = load_then_save
runpy.run_path({train!r}, run_name="__main__")
'''


class Runs:
    """Training runs shared by the tests, each made on first use."""

    def __init__(self, root: Path, corpus: Path, dataset_dir: Path):
        self.root, self.corpus, self.dataset_dir = root, corpus, dataset_dir
        self._cache: dict = {}
        self.hooked_train = root / "hooked_train.py"
        self.hooked_train.write_text(HOOKED_TRAIN.format(train=str(helpers.TRAIN)))

    def train(self, out_dir: Path | str, *args: str, nproc: int = 2, check: bool = True, hooks: dict | None = None):
        """run_train with STEPS steps (a later --train.max_steps wins) into `out_dir` (a name: under root);
        with `hooks` (environment variables), through HOOKED_TRAIN."""
        out_dir = self.root / out_dir if isinstance(out_dir, str) else out_dir
        real = helpers.TRAIN
        if hooks:
            helpers.TRAIN = self.hooked_train  # run_train launches helpers.TRAIN
        try:
            return run_train(f"--train.max_steps={STEPS}", *args, nproc=nproc, out_dir=out_dir, corpus=self.corpus,
                             dataset_dir=self.dataset_dir, check=check, extra_env=hooks)
        finally:
            helpers.TRAIN = real

    def _once(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def baseline(self, optimizer: str = "adamw") -> dict[int, float]:
        """Losses of the uninterrupted run: 2 ranks, no checkpoint before the last step."""
        def make():
            self.train(f"baseline-{optimizer}", *OPTIMIZER_ARGS[optimizer])
            return losses(self.root / f"baseline-{optimizer}")
        return self._once(("baseline", optimizer), make)

    def saved(self, fmt: str, optimizer: str = "adamw") -> Path:
        """The same run, checkpointing every SPLIT steps: fsdp_*cpt3 and fsdp_*cpt6."""
        def make():
            self.train(f"saved-{fmt}-{optimizer}", f"--checkpoint.format={fmt}", f"--checkpoint.interval={SPLIT}",
                       *OPTIMIZER_ARGS[optimizer])
            return self.root / f"saved-{fmt}-{optimizer}"
        return self._once(("saved", fmt, optimizer), make)

    def saved12(self, fmt: str, optimizer: str = "adamw") -> Path:
        """Global batch 12 (divisible by 1, 2 and 3 ranks x micro-batch 2), 2 ranks, checkpoints at 3 and 6."""
        def make():
            self.train(f"saved12-{fmt}-{optimizer}", "--train.global_batch_size=12", f"--checkpoint.format={fmt}",
                       f"--checkpoint.interval={SPLIT}", *OPTIMIZER_ARGS[optimizer])
            return self.root / f"saved12-{fmt}-{optimizer}"
        return self._once(("saved12", fmt, optimizer), make)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, dataset_dir) -> Runs:
    return Runs(tmp_path_factory.mktemp("ckpt"), corpus, dataset_dir)


def resumed_losses(out_dir: Path, rows_before: int = 0) -> dict[int, float]:
    """step -> loss of the rows a resumed run appended to metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_metrics(out_dir)[rows_before:] if "loss" in r}


# ---- 1. exact stop-and-resume ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_stop_and_resume_is_bit_exact(runs, fmt, optimizer, tmp_path):
    """Resuming from step 3 in a fresh process reproduces the uninterrupted run's steps 4..6 exactly.

    The "stopped" run is the saved run's checkpoint at step 3 (max_steps stays 6, so the lr schedule is
    the same): the resumed process gets nothing but that checkpoint. full: the checkpoint is copied into
    a new output directory and picked up by checkpoint.auto_resume; sharded: --resume_from its path.
    """
    baseline = runs.baseline(optimizer)
    saved = runs.saved(fmt, optimizer)
    # Writing checkpoints does not disturb training.
    assert losses(saved) == baseline
    assert checkpoint_names(saved) == sorted([ckpt_name(fmt, SPLIT), ckpt_name(fmt, STEPS)])

    out = tmp_path / "resumed"
    source = saved / ckpt_name(fmt, SPLIT)
    args = (f"--checkpoint.format={fmt}", *OPTIMIZER_ARGS[optimizer])
    if fmt == "full":
        source = copy_checkpoint(source, out)
        proc = runs.train(out, *args)
        assert "checkpoint.auto_resume" in proc.stderr
    else:
        proc = runs.train(out, *args, f"--resume_from={source}")
    assert f"loaded checkpoint {source} " in proc.stderr

    got = losses(out)
    assert sorted(got) == list(range(SPLIT + 1, STEPS + 1)), "the resumed run must start at step 4"
    for step in got:
        assert got[step] == baseline[step], f"step {step}: resumed {got[step]!r} != uninterrupted {baseline[step]!r}"

    # The end state is the uninterrupted run's, bit for bit: weights, optimizer, step and data position.
    mine = as_full(out / ckpt_name(fmt, STEPS), tmp_path / "mine.pth")
    theirs = as_full(saved / ckpt_name(fmt, STEPS), tmp_path / "theirs.pth")
    for key in ("model", "optimizer", "train_state", "rng"):
        assert_identical(mine[key], theirs[key], key)
    if optimizer == "muon":  # Muon's state is its momentum, one buffer per block matrix; AdamW's elsewhere
        kinds = {tuple(sorted(state)) for state in mine["optimizer"]["state"].values()}
        assert kinds == {("momentum_buffer",), ("exp_avg", "exp_avg_sq", "step")}, kinds
        assert mine["train_state"]["optimizer"] == "muon"


# ---- 2. resume at another world size ----------------------------------------------------------

@pytest.mark.parametrize(("nproc", "optimizer"), [(1, "adamw"), (3, "adamw"), (3, "muon")])
def test_resume_at_another_world_size(runs, nproc, optimizer, tmp_path):
    """Checkpoints saved by 2 ranks, resumed on 1 and on 3: right after loading, model, optimizer, step,
    data position and the old ranks' RNG are exactly what the 2 ranks saved; training then continues on
    the next unseen samples (losses match the 2-rank run's up to the reduction order)."""
    # The full and the sharded run trained identically, so one full checkpoint is the truth for both.
    reference = load_full(runs.saved12("full", optimizer) / ckpt_name("full", SPLIT))
    expected = losses(runs.saved12("full", optimizer))
    assert losses(runs.saved12("sharded", optimizer)) == expected
    for fmt in FORMATS:
        source = runs.saved12(fmt, optimizer) / ckpt_name(fmt, SPLIT)
        out, loaded_dir = tmp_path / f"resumed-{fmt}", tmp_path / f"loaded-{fmt}"
        proc = runs.train(out, "--train.global_batch_size=12", f"--checkpoint.format={fmt}", f"--resume_from={source}",
                          *OPTIMIZER_ARGS[optimizer], nproc=nproc, hooks={"SAVE_LOADED_TO": str(loaded_dir)})
        assert f"loaded checkpoint {source} " in proc.stderr and "saved at world size 2" in proc.stderr

        loaded = load_full(loaded_dir / ckpt_name("full", SPLIT))
        assert loaded["world_size"] == nproc
        for key in ("model", "optimizer", "train_state", "model_config"):
            assert_identical(loaded[key], reference[key], f"{fmt} loaded on {nproc} rank(s): {key}")
        # Ranks that existed at save time get their RNG back; a new rank keeps its own.
        for rank in range(min(nproc, 2)):
            assert torch.equal(loaded["rng"][rank]["cpu"], reference["rng"][rank]["cpu"]), f"{fmt}: rank {rank}'s RNG"

        got = losses(out)
        assert sorted(got) == list(range(SPLIT + 1, STEPS + 1))
        for step in got:
            assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=0), f"{fmt}, {nproc} rank(s), step {step}"


# ---- 3. an interrupted save --------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_killed_save_is_ignored_and_cleaned_up(runs, fmt, tmp_path):
    """A save killed half-way leaves the previous checkpoint intact (keep_last_n=1 deletes only after a
    newer one is complete); resuming ignores the leftover, continues exactly from the previous
    checkpoint, and the next save removes it (the journal records it as the run's). Files under `.tmp-` names
    that the run's saves did not make stay as they are."""
    baseline = runs.baseline()
    out = tmp_path / "run"
    args = [f"--checkpoint.format={fmt}", f"--checkpoint.interval={SPLIT}", "--checkpoint.keep_last_n=1"]
    killed = runs.train(out, *args, hooks={"KILL_AT_STEP": str(STEPS)}, check=False)
    assert killed.returncode != 0, killed.stderr[-3000:]
    leftover = f".tmp-{ckpt_name(fmt, STEPS)}"
    assert checkpoint_names(out) == sorted([leftover, ckpt_name(fmt, SPLIT)])
    if fmt == "sharded":
        assert not (out / leftover / "meta.json").exists() and any((out / leftover).glob("*.distcp"))
    # Files of both kinds under `.tmp-` names that no save of this run made.
    (out / ".tmp-fsdp_cpt9.pth").write_bytes(b"PK\x03\x04 half a zip file")
    (out / ".tmp-fsdp_sharded_cpt9").mkdir()
    (out / ".tmp-fsdp_sharded_cpt9" / "__0_0.distcp").write_bytes(b"\0" * 100)
    rows_before = len(read_metrics(out))

    resume = ["--resume_from=latest"] if fmt == "full" else []  # sharded: checkpoint.auto_resume
    proc = runs.train(out, *args, *resume)
    assert f"loaded checkpoint {out / ckpt_name(fmt, SPLIT)} " in proc.stderr
    assert "removing incomplete checkpoint" in proc.stderr
    got = resumed_losses(out, rows_before)
    assert got == {step: baseline[step] for step in range(SPLIT + 1, STEPS + 1)}
    assert checkpoint_names(out) == sorted([ckpt_name(fmt, STEPS), ".tmp-fsdp_cpt9.pth", ".tmp-fsdp_sharded_cpt9"]), \
        "the leftover removed, keep_last_n=1 kept the newest, the files the run did not make left alone"
    assert (out / ".tmp-fsdp_cpt9.pth").read_bytes() == b"PK\x03\x04 half a zip file"


# ---- 4. a corrupt newest checkpoint -----------------------------------------------------------


def copy_newest_two(runs: Runs, fmt: str, out: Path, *, copy=copy_checkpoint) -> tuple[Path, Path]:
    """The saved run's checkpoints SPLIT and STEPS copied into out: (the newest, the file in it to damage:
    the .pth, or rank 1's shard)."""
    for step in (SPLIT, STEPS):
        copy(runs.saved(fmt) / ckpt_name(fmt, step), out)
    newest = out / ckpt_name(fmt, STEPS)
    return newest, newest if fmt == "full" else sorted(newest.glob("*.distcp"))[-1]


@pytest.mark.parametrize("fmt, damage", [("full", "truncated"), ("sharded", "truncated"), ("sharded", "garbled")])
def test_corrupt_checkpoint(runs, fmt, damage, tmp_path):
    """A damaged newest checkpoint: loading it by path fails naming it; `latest` warns and falls back to
    the previous complete one, resuming exactly; the next save replaces it. Damage: the file (full) or
    rank 1's shard (sharded) truncated to half, or the shard overwritten with garbage of the same size
    (which passes meta.json's size check: it is the read that fails)."""
    baseline = runs.baseline()
    out = tmp_path / "run"
    newest, broken = copy_newest_two(runs, fmt, out)
    if damage == "truncated":
        truncate_to_half(broken)
    else:
        broken.write_bytes(b"\xff" * broken.stat().st_size)
        broken = newest  # DCP does not say which file of the folder failed to decode

    proc = runs.train(tmp_path / "by-path", f"--checkpoint.format={fmt}", f"--resume_from={newest}", nproc=1,
                      check=False)
    assert_clean_error(proc, str(broken))
    assert not (tmp_path / "by-path" / "metrics.jsonl").exists()

    proc = runs.train(out, f"--checkpoint.format={fmt}", "--resume_from=latest")
    warnings = [line for line in proc.stderr.splitlines() if str(broken) in line and "falling back" in line]
    assert warnings, proc.stderr[-3000:]
    assert f"loaded checkpoint {out / ckpt_name(fmt, SPLIT)} " in proc.stderr
    assert losses(out) == {step: baseline[step] for step in range(SPLIT + 1, STEPS + 1)}
    # The damaged step-6 checkpoint was replaced by a whole one: the uninterrupted run's final state.
    assert checkpoint_names(out) == sorted([ckpt_name(fmt, SPLIT), ckpt_name(fmt, STEPS)])
    mine, theirs = as_full(newest, tmp_path / "mine.pth"), as_full(runs.saved(fmt) / ckpt_name(fmt, STEPS),
                                                                   tmp_path / "theirs.pth")
    for key in ("model", "optimizer", "train_state"):
        assert_identical(mine[key], theirs[key], key)


def copy_with_record(src: Path, dst_dir: Path) -> Path:
    """copy_checkpoint, with a full checkpoint's checksum record (a sharded one holds it in meta.json)."""
    dst = copy_checkpoint(src, dst_dir)
    if src.is_file():
        shutil.copy2(sidecar_of(src), sidecar_of(dst))
    return dst


def tensor_byte(path: Path) -> int:
    """The offset of a byte in the middle of the largest tensor's data in a .pth or a .distcp file, where a
    flipped bit leaves the file readable. Both are torch.save zips (a .distcp, one per tensor), stored
    uncompressed: a member's data follows its 30-byte local header, name and extra field."""
    def middle_of_largest_member(blob: bytes) -> int:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            info = max(z.infolist(), key=lambda i: i.file_size)
        name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
        return info.header_offset + 30 + name_len + extra_len + info.file_size // 2

    data = path.read_bytes()
    if path.suffix == ".pth":
        return middle_of_largest_member(data)
    metadata = pickle.loads((path.parent / ".metadata").read_bytes())  # our own checkpoint: trusted here
    item = max((i for i in metadata.storage_data.values() if i.relative_path == path.name), key=lambda i: i.length)
    return item.offset + middle_of_largest_member(data[item.offset:item.offset + item.length])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_byte_is_caught_and_latest_falls_back(runs, fmt, tmp_path):
    """One byte flipped inside a tensor's data keeps the file's size and its readability: before checksums
    it loaded silently, a damaged weight. Now loading it by path is an error naming the file, and `latest`
    moves the checkpoint aside and resumes exactly from the previous one."""
    baseline = runs.baseline()
    out = tmp_path / "run"
    newest, broken = copy_newest_two(runs, fmt, out, copy=copy_with_record)
    data = bytearray(broken.read_bytes())
    data[tensor_byte(broken)] ^= 0x10
    broken.write_bytes(bytes(data))

    proc = runs.train(tmp_path / "by-path", f"--checkpoint.format={fmt}", f"--resume_from={newest}", nproc=1,
                      check=False)
    assert_clean_error(proc, f"{broken}: corrupt checkpoint (CRC32")

    proc = runs.train(out, f"--checkpoint.format={fmt}", "--resume_from=latest")
    fallbacks = [line for line in proc.stderr.splitlines() if str(broken) in line and "falling back" in line]
    assert fallbacks, proc.stderr[-3000:]
    assert f"loaded checkpoint {out / ckpt_name(fmt, SPLIT)} " in proc.stderr
    assert losses(out) == {step: baseline[step] for step in range(SPLIT + 1, STEPS + 1)}
    assert checkpoint_names(out) == sorted([ckpt_name(fmt, SPLIT), ckpt_name(fmt, STEPS)])
    assert (out / f"corrupt-{ckpt_name(fmt, STEPS)}").exists()  # moved aside, never deleted


# ---- 5. retention ------------------------------------------------------------------------------
# keep_last_n, and retention after `latest` fell back past a damaged checkpoint: in process, at 2 ranks
# (tests/test_checkpoint_manager.py).


# ---- 5b. a full disk ------------------------------------------------------------------------------

# Runs a command with its output directory on a tmpfs of $SIZE (mounted in a user namespace: no root
# needed), then copies what is left there to $KEEP for the test to look at.
ON_SMALL_DISK = ('mount -t tmpfs -o size="$SIZE" tmpfs "$OUT" || exit 97; "$@"; status=$?; '
                 'cp -a "$OUT/." "$KEEP/"; exit $status')


def worker_error(proc) -> str:
    """The one error line of a failed job whose ranks raised no traceback (a real torchrun reports their failure
    in a traceback of its own)."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-4000:]
    assert worker_tracebacks(proc.stderr) == 0, proc.stderr[-4000:]
    assert hasattr(proc, "exitcodes") or "ChildFailedError" in proc.stderr, proc.stderr[-4000:]  # forked, or torchrun
    return errors[0]


@pytest.mark.slow
def test_a_resume_without_room_for_one_more_checkpoint_says_why_retention_needs_it(corpus, dataset_dir, tmp_path):
    """A resume onto a disk with less room than a checkpoint (its free space shown as half of one), with
    checkpoint.keep_last_n=1: the line names the output directory, not a checkpoint that does not exist, and says that
    the checkpoint it has stays until the next is complete. Nothing is written."""
    out = tmp_path / "run"
    run_train("--train.max_steps=2", "--checkpoint.keep_last_n=1", nproc=1, out_dir=out, corpus=corpus,
              dataset_dir=dataset_dir)
    size, before = (out / "fsdp_cpt2.pth").stat().st_size, sorted(p.name for p in out.iterdir())
    proc = run_train("--train.max_steps=4", "--checkpoint.keep_last_n=1", nproc=1, out_dir=out, corpus=corpus,
                     dataset_dir=dataset_dir, check=False, faults={"disk_free_bytes": size // 2})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and errors == [
        f"error: {out}: not enough disk space to save a checkpoint ({size / 2**20:,.1f} MiB needed (checkpoint."
        "keep_last_n=1 removes fsdp_cpt2.pth only once the next checkpoint is complete: the disk must hold both), "
        f"{size // 2 / 2**20:,.1f} MiB free in {out}); stopped before the first training step. Free some space and "
        "resume with --resume_from latest"], proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_disk_with_room_for_one_checkpoint(fmt, corpus, dataset_dir, tmp_path):
    """The second save into a disk with room for one checkpoint (2 ranks): refused before anything is
    written, with one line saying so; the first checkpoint stays whole and no .tmp- is left. (Before: both
    ranks crashed half-way through the write, "unexpected pos", with tracebacks.)"""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm (a user namespace to mount a small tmpfs in) is not permitted here")
    out, keep = tmp_path / "small", tmp_path / "after"
    out.mkdir()
    keep.mkdir()
    proc = run_train("--train.max_steps=4", "--checkpoint.interval=2", f"--checkpoint.format={fmt}", nproc=2,
                     out_dir=out, corpus=corpus, dataset_dir=dataset_dir, check=False,
                     prefix=("unshare", "-rm", "sh", "-c", ON_SMALL_DISK, "sh"),
                     extra_env={"OUT": str(out), "KEEP": str(keep), "SIZE": "3m"})  # a checkpoint is ~1.8 MiB
    assert proc.returncode != 97, proc.stderr
    line = worker_error(proc)
    assert f"{out / ckpt_name(fmt, 4)}: not enough disk space" in line and "stopped before writing" in line, line
    assert checkpoint_names(keep) == [ckpt_name(fmt, 2)]
    checkpoint_io.verify(keep / ckpt_name(fmt, 2))


@pytest.mark.slow
@pytest.mark.parametrize("fmt, limit", [("full", 1_000_000), ("sharded", 500_000)])
def test_a_write_that_fails_half_way(fmt, limit, corpus, dataset_dir, tmp_path):
    """A write that fails with the checkpoint partly on disk (here a file size limit, EFBIG, where a full
    disk gives ENOSPC): one line naming the checkpoint and the cause, the previous checkpoint intact, no
    .tmp- left behind."""
    out = tmp_path / "run"
    run_train("--train.max_steps=2", f"--checkpoint.format={fmt}", nproc=2, out_dir=out, corpus=corpus,
              dataset_dir=dataset_dir)
    proc = run_train("--train.max_steps=4", f"--checkpoint.format={fmt}", nproc=2, out_dir=out, corpus=corpus,
                     dataset_dir=dataset_dir, check=False, fsize_limit=limit)
    line = worker_error(proc)
    assert f"{out / ckpt_name(fmt, 4)}: cannot write checkpoint" in line, line
    assert "File too large" in line or "stopped short" in line, line
    assert checkpoint_names(out) == [ckpt_name(fmt, 2)]
    checkpoint_io.verify(out / ckpt_name(fmt, 2))


# ---- 6. errors that must never become a fresh start ---------------------------------------------


def test_mismatched_model_config_is_an_error(runs, tmp_path):
    source = runs.saved("full") / ckpt_name("full", STEPS)
    out = tmp_path / "explicit"
    proc = runs.train(out, f"--resume_from={source}", "--model.dim=128", nproc=1, check=False)
    assert_clean_error(proc, "model.dim", str(source))
    assert not (out / "metrics.jsonl").exists() and checkpoint_names(out) == []

    # auto_resume into a directory of another model's (sharded) checkpoints: the same error, and no
    # fallback to the older checkpoint of that model either.
    out = tmp_path / "auto"
    for step in (SPLIT, STEPS):
        copy_checkpoint(runs.saved("sharded") / ckpt_name("sharded", step), out)
    proc = runs.train(out, "--checkpoint.format=sharded", "--model.n_layers=3", nproc=1, check=False)
    assert_clean_error(proc, "model.n_layers", str(out / ckpt_name("sharded", STEPS)))
    assert "falling back" not in proc.stderr
    assert not (out / "metrics.jsonl").exists()
    assert checkpoint_names(out) == sorted([ckpt_name("sharded", SPLIT), ckpt_name("sharded", STEPS)])


@pytest.mark.parametrize(("saved_with", "resumed_with"), [("muon", "adamw"), ("adamw", "muon")])
def test_a_resume_under_another_optimizer_is_one_error_line(runs, saved_with, resumed_with, tmp_path):
    # Both formats: the line comes before any tensor is read into the other optimizer's state.
    for fmt in FORMATS:
        source = runs.saved(fmt, saved_with) / ckpt_name(fmt, SPLIT)
        needles = (str(source), f"saved with train.optimizer={saved_with}",
                   f"this run has train.optimizer={resumed_with}")
        out = tmp_path / f"{fmt}-resumed"
        args = (f"--resume_from={source}", f"--checkpoint.format={fmt}", "--fsdp.version=2",
                f"--train.optimizer={resumed_with}")
        proc = runs.train(out, *args, nproc=1, check=False)
        assert len(error_lines(proc)) == 1, proc.stderr[-3000:]
        assert_clean_error(proc, *needles)
        assert not (out / "metrics.jsonl").exists() and checkpoint_names(out) == []
        # --check reads the optimizer from the checkpoint's metadata and says the same.
        proc = runs.train(out, *args, "--check", nproc=1, check=False)
        assert proc.returncode == 2 and len(error_lines(proc)) == 1
        assert_clean_error(proc, *needles)


def test_missing_resume_path_is_an_error(runs, tmp_path):
    out = tmp_path / "run"
    missing = tmp_path / "no-such-checkpoint.pth"
    proc = runs.train(out, f"--resume_from={missing}", nproc=1, check=False)
    assert_clean_error(proc, str(missing))
    assert not (out / "metrics.jsonl").exists() and checkpoint_names(out) == []

    # `latest` with nothing to resume from (only an interrupted save): an error too, not a fresh start.
    out.mkdir(exist_ok=True)
    (out / ".tmp-fsdp_cpt2.pth").write_bytes(b"partial")
    proc = runs.train(out, "--resume_from=latest", nproc=1, check=False)
    assert_clean_error(proc, "no complete checkpoint", str(out))
    assert not (out / "metrics.jsonl").exists() and checkpoint_names(out) == [".tmp-fsdp_cpt2.pth"]


# ---- 7. the full checkpoint is plain PyTorch ----------------------------------------------------


@pytest.mark.parametrize("variant", ["fsdp1", "fsdp2+ac"])
def test_full_checkpoint_is_a_plain_state_dict(runs, variant, tmp_path):
    """torch.load(weights_only=True)["model"] is the plain Transformer's state dict: same names (no
    wrapper prefixes), shapes and dtypes, and load_state_dict takes it as is."""
    if variant == "fsdp1":
        path = runs.saved("full") / ckpt_name("full", STEPS)
    else:  # FSDP2 and activation checkpointing: still the plain names
        runs.train(tmp_path / "run", "--train.max_steps=1", "--train.warmup_steps=1", "--fsdp.version=2",
                   "--fsdp.activation_checkpointing=full")
        path = tmp_path / "run" / ckpt_name("full", 1)
    ckpt = torch.load(path, weights_only=True)
    assert set(ckpt) == {"model", "optimizer", "rng", "format_version", "world_size", "model_config", "train_state",
                         "tokenizer_sha256"}
    model = Transformer(ModelConfig(**ckpt["model_config"]))
    plain = model.state_dict()
    assert list(ckpt["model"]) == list(plain)
    for name, tensor in plain.items():
        assert not any(w in name for w in ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped"))
        assert ckpt["model"][name].shape == tensor.shape and ckpt["model"][name].dtype == tensor.dtype, name
    model.load_state_dict(ckpt["model"], strict=True)
    assert torch.equal(model.tok_embeddings.weight, ckpt["model"]["tok_embeddings.weight"])
    # The optimizer state is keyed by the same names.
    assert set(ckpt["optimizer"]["state"]) == set(plain)
    assert sorted(n for g in ckpt["optimizer"]["param_groups"] for n in g["params"]) == sorted(plain)


# ---- scripts/convert_checkpoint.py ---------------------------------------------------------------


def test_convert_sharded_to_full(runs, tmp_path):
    """The converted file is what a full save of the same state writes, and resumes identically."""
    out_pth = tmp_path / "converted.pth"
    source = runs.saved("sharded") / ckpt_name("sharded", SPLIT)
    proc = helpers.run_job([str(CONVERT), str(source), str(out_pth)], cwd=tmp_path, env=helpers.job_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and out_pth.is_file()
    converted = load_full(out_pth)
    full = load_full(runs.saved("full") / ckpt_name("full", SPLIT))
    # Same layout as a full save (optimizer state keyed by parameter name, groups holding names) ...
    assert list(converted) == list(full)
    assert structure(converted) == structure(full)
    assert isinstance(next(iter(converted["optimizer"]["state"])), str)
    # ... and, as both runs trained identically, the same content.
    for key in full:
        assert_identical(converted[key], full[key], key)

    out = tmp_path / "resumed"
    proc = runs.train(out, f"--resume_from={out_pth}")
    assert f"loaded checkpoint {out_pth} " in proc.stderr
    baseline = runs.baseline()
    assert losses(out) == {step: baseline[step] for step in range(SPLIT + 1, STEPS + 1)}


def test_convert_errors(runs, tmp_path, capsys):
    convert = converter()
    sharded = runs.saved("sharded") / ckpt_name("sharded", STEPS)
    out = tmp_path / "out.pth"

    def fails(*argv: str, needle: str) -> None:
        assert convert.main([*map(str, argv)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err

    fails(tmp_path / "missing", out, needle=str(tmp_path / "missing"))
    fails(runs.saved("sharded"), out, needle="not a complete sharded checkpoint")  # a run's output dir
    full = runs.saved("full") / ckpt_name("full", STEPS)
    fails(full, out, needle="converts to a sharded one, a folder")  # a .pth name for the sharded output
    fails(full, runs.saved("full"), needle="--force")  # an existing folder
    imported = load_full(full)  # as scripts/import_hf.py writes one: no step taken, no optimizer state
    imported["optimizer"]["state"] = {}
    torch.save(imported, tmp_path / "imported.pth")
    fails(tmp_path / "imported.pth", tmp_path / "sharded", needle="holds no optimizer state")
    assert not (tmp_path / "sharded").exists()
    damaged = copy_checkpoint(sharded, tmp_path / "damaged")
    shard = sorted(damaged.glob("*.distcp"))[0]
    truncate_to_half(shard)
    fails(damaged, out, needle=str(shard))
    shard.write_bytes(b"\xff" * (sharded / shard.name).stat().st_size)  # the right size, undecodable
    fails(damaged, out, needle=f"{shard}: corrupt checkpoint (CRC32")  # its recorded checksum names it
    assert not out.exists()

    assert convert.main([str(sharded), str(out)]) == 0
    assert "step 6" in capsys.readouterr().out
    before = out.stat().st_mtime_ns, out.stat().st_size
    fails(sharded, out, needle="--force")
    assert (out.stat().st_mtime_ns, out.stat().st_size) == before
    assert convert.main([str(runs.saved("sharded") / ckpt_name("sharded", SPLIT)), str(out), "--force"]) == 0
    assert load_full(out)["train_state"]["step"] == SPLIT
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")) == []


def test_convert_full_to_sharded(runs, tmp_path):
    """A full checkpoint (2 ranks, step 3) converted to sharded holds all a resume needs: resumed on 2 ranks it
    reproduces the uninterrupted run's steps 4..6 exactly; resumed on 1 rank it trains exactly as a resume from
    the full file on 1 rank does (the same state loaded, the same reduction order)."""
    source = runs.saved("full") / ckpt_name("full", SPLIT)
    converted = tmp_path / "converted" / ckpt_name("sharded", SPLIT)
    proc = helpers.run_job([str(CONVERT), str(source), str(converted)], cwd=tmp_path, env=helpers.job_env(),
                           timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"wrote {converted} (step {SPLIT}, saved at world size 2" in proc.stdout
    # The metadata a sharded save of this state writes: the full file's, the world size it was saved at included.
    full = load_full(source)
    meta = json.loads((converted / "meta.json").read_text())
    assert meta.pop(META_CRC_KEY) == meta_crc32(meta)  # sealed as a save seals it
    assert meta.pop("files") and meta == {k: v for k, v in full.items() if k not in ("model", "optimizer", "rng")}

    baseline = runs.baseline()
    proc = runs.train(tmp_path / "resumed", "--checkpoint.format=sharded", f"--resume_from={converted}")
    assert f"loaded checkpoint {converted} " in proc.stderr and "saved at world size 2" in proc.stderr
    assert losses(tmp_path / "resumed") == {step: baseline[step] for step in range(SPLIT + 1, STEPS + 1)}
    on_one = {}
    for name, path in (("sharded", converted), ("full", source)):
        runs.train(tmp_path / f"one-{name}", f"--resume_from={path}", nproc=1)
        on_one[name] = losses(tmp_path / f"one-{name}")
    assert sorted(on_one["full"]) == list(range(SPLIT + 1, STEPS + 1))
    assert on_one["sharded"] == on_one["full"]


def test_convert_sharded_to_full_to_sharded_loses_nothing(runs, tmp_path):
    """Back and forth: the second sharded checkpoint's metadata is the first's (its files aside), and its
    content, converted to full once more, is the first conversion's, tensor for tensor."""
    convert = converter().convert
    source = runs.saved("sharded") / ckpt_name("sharded", SPLIT)
    back = tmp_path / "back" / ckpt_name("sharded", SPLIT)
    convert(source, tmp_path / "first.pth")
    convert(tmp_path / "first.pth", back)
    convert(back, tmp_path / "second.pth")
    metas = [json.loads((path / "meta.json").read_text()) for path in (source, back)]
    assert all(meta.pop(META_CRC_KEY) == meta_crc32(meta) for meta in metas)  # each sealed over its own files
    assert [meta.pop("files") and meta for meta in metas] == [metas[0], metas[0]]
    first, second = load_full(tmp_path / "first.pth"), load_full(tmp_path / "second.pth")
    assert list(first) == list(second)
    for key in first:
        assert_identical(first[key], second[key], key)


def test_resuming_an_older_checkpoint_over_newer_work_is_refused(tmp_path, corpus, dataset_dir):
    # A 6-step run keeps checkpoints 3 and 6. Resuming from 3 into the same directory would let the
    # new run overwrite fsdp_cpt6 (and retention delete it): refused, with nothing written or removed.
    out = tmp_path / "run"
    run_train("--train.max_steps=6", "--checkpoint.interval=3", "--checkpoint.keep_last_n=0", nproc=1,
              out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
    # run.lock names the newest run that held the directory: every start rewrites it, refused or not.
    state = lambda: {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != LOCK_NAME}  # noqa: E731
    before = state()
    proc = run_train("--train.max_steps=6", "--checkpoint.interval=3", f"--resume_from={out / 'fsdp_cpt3.pth'}",
                     nproc=1, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, check=False)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "fsdp_cpt6.pth" in errors[0] and "fresh run.output_dir" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert state() == before


@pytest.mark.slow
def test_a_fresh_start_over_earlier_checkpoints_is_refused(tmp_path, corpus, dataset_dir):
    """checkpoint.auto_resume=false into a directory that holds checkpoints: the new run's saves would mix
    with them and its retention delete them. Refused, with nothing written."""
    out = tmp_path / "run"
    run_train("--train.max_steps=2", nproc=1, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != LOCK_NAME}
    proc = run_train("--train.max_steps=2", "--checkpoint.auto_resume=false", nproc=1, out_dir=out, corpus=corpus,
                     dataset_dir=dataset_dir, check=False)
    assert_clean_error(proc, f"{out} already holds checkpoints of an earlier run (newest fsdp_cpt2.pth)")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != LOCK_NAME} == before


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_saves_and_loads_print_no_torch_warnings(fmt, tmp_path, corpus, dataset_dir):
    """FSDP1's state dicts warned at every save and load (ShardedTensor's deprecation, the default device
    of a group, NO_SHARD at world size 1): silenced where they are called."""
    for nproc, steps in ((2, 4), (1, 6)):  # two saves; then a resume and two saves on one rank
        proc = run_train(f"--train.max_steps={steps}", "--checkpoint.interval=2", f"--checkpoint.format={fmt}",
                         nproc=nproc, out_dir=tmp_path / "run", corpus=corpus, dataset_dir=dataset_dir)
        warned = [line for line in proc.stderr.splitlines() if "Warning" in line and "NO_SHARD` instead" not in line]
        assert not warned, warned  # (FSDP's one switch to NO_SHARD at world size 1 is said once, at wrap time)

