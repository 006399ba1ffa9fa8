"""Loading a checkpoint never runs code from it, through every entry point: training
(--resume_from and checkpoint.auto_resume), scripts/generate.py, scripts/export_hf.py and
scripts/convert_checkpoint.py. Each tampered checkpoint carries a pickled payload that creates a marker
file and then returns the real object, so that, unpickled, it would load and train with no sign; its
recorded sizes and checksums are fixed up, so that only the restricted unpickling stands in the way.
Every entry point must refuse it with one line naming the file and the refused global, and the marker
must not exist."""
from __future__ import annotations

import builtins
import dataclasses
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from fsdp_utils.checkpoint.checksums import file_record, with_meta_crc32
from fsdp_utils.checkpoint.names import META_NAME, sidecar_of
from scripts import convert_checkpoint, export_hf, generate
from tests.helpers import run_train


class Payload:
    """Unpickles by running `touch marker`, then returning what `real` unpickles to."""

    def __init__(self, marker: Path, real: bytes):
        self.marker, self.real = marker, real

    def __reduce__(self):
        code = f"__import__('pathlib').Path({str(self.marker)!r}).touch() or __import__('pickle').loads({self.real!r})"
        return builtins.eval, (code,)


def fix_records(checkpoint: Path) -> None:
    """Record every file's current size and CRC32, as a save would have."""
    meta_path = checkpoint / META_NAME
    meta = json.loads(meta_path.read_text())
    meta["files"] = {name: file_record(checkpoint / name) for name in meta["files"]}
    meta_path.write_text(json.dumps(with_meta_crc32(meta)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, dataset_dir) -> dict[str, Path]:
    """Run folders (with the tokenizer) holding a 2-step checkpoint of each format."""
    found = {}
    for fmt in ("full", "sharded"):
        out = tmp_path_factory.mktemp(fmt)
        run_train("--train.max_steps=2", f"--checkpoint.format={fmt}", nproc=1, out_dir=out, corpus=corpus,
                  dataset_dir=dataset_dir)
        found[fmt] = out
    return found


def tampered_copy(runs: dict[str, Path], kind: str, tmp_path: Path, marker: Path) -> Path:
    """A copy of a run folder whose checkpoint carries the payload. kind: "metadata" (DCP's .metadata),
    "bytes" (a non-tensor entry of a .distcp file, the optimizer's learning rate) or "full" (a .pth)."""
    fmt = "full" if kind == "full" else "sharded"
    run = tmp_path / f"run-{kind}"
    shutil.copytree(runs[fmt], run)
    if kind == "full":
        path = run / "fsdp_cpt2.pth"
        payload = torch.load(path, weights_only=True)
        payload["train_state"] = Payload(marker, pickle.dumps(payload["train_state"]))
        torch.save(payload, path)
        sidecar_of(path).write_text(json.dumps({"format_version": 1, "files": {path.name: file_record(path)}}))
        return path
    path = run / "fsdp_sharded_cpt2"
    real = (path / ".metadata").read_bytes()
    if kind == "metadata":
        (path / ".metadata").write_bytes(pickle.dumps(Payload(marker, real)))
    else:  # append a torch.save'd payload to a shard and point the lr entry's storage record at it
        metadata = pickle.loads(real)  # our own checkpoint: trusted here
        blob = io.BytesIO()
        torch.save(Payload(marker, pickle.dumps(0.003)), blob)
        index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
        info = metadata.storage_data[index]
        shard = path / info.relative_path
        offset = shard.stat().st_size
        with shard.open("ab") as f:
            f.write(blob.getvalue())
        metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
    fix_records(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["metadata", "bytes", "full"])
def test_the_payload_is_live(runs, kind, tmp_path):
    """The tampered checkpoints are real attacks: the loaders torch offers unpickle them and run the code."""
    marker = tmp_path / "ran"
    checkpoint = tampered_copy(runs, kind, tmp_path, marker)
    if kind == "full":
        torch.load(checkpoint, weights_only=False)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        if kind == "metadata":
            dcp.FileSystemReader(str(checkpoint)).read_metadata()
        else:
            dcp_to_torch_save(checkpoint, tmp_path / "converted.pth")
    assert marker.exists()


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["metadata", "bytes", "full"])
def test_tools_refuse_a_tampered_checkpoint(runs, kind, tmp_path, capsys):
    marker = tmp_path / "ran"
    checkpoint = tampered_copy(runs, kind, tmp_path, marker)
    refused = "refused: it references" if kind != "bytes" else None
    named = checkpoint / ".metadata" if kind == "metadata" else checkpoint

    out = tmp_path / "converted.pth"
    assert convert_checkpoint.main([str(checkpoint), str(out)]) == 1
    line = one_error(capsys)
    assert str(named) in line and (kind == "full" or "refused: it references" in line), line
    assert not out.exists()

    # generate.py and export_hf.py read only the model's tensors of a sharded checkpoint: a payload in the
    # optimizer's entries is never unpickled by them, so they may succeed; they must never run it.
    status = generate.main([str(checkpoint), "--prompt", "x", "--max_new_tokens", "2", "--device", "cpu"])
    if refused:
        assert status == 1 and refused in one_error(capsys)
    status = export_hf.main([str(checkpoint), str(tmp_path / "exported")])
    if refused:
        assert status == 1 and refused in one_error(capsys)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["metadata", "bytes", "full"])
def test_training_refuses_a_tampered_checkpoint(runs, kind, tmp_path, corpus, dataset_dir):
    """--resume_from the checkpoint, and checkpoint.auto_resume into its folder: refused, nothing loaded,
    the checkpoint neither moved nor deleted (a tampered checkpoint is not mere damage)."""
    marker = tmp_path / "ran"
    checkpoint = tampered_copy(runs, kind, tmp_path, marker)
    fmt = "full" if kind == "full" else "sharded"
    named = checkpoint / ".metadata" if kind == "metadata" else checkpoint
    for args, out in (([f"--resume_from={checkpoint}"], tmp_path / "fresh"), ([], checkpoint.parent)):
        proc = run_train("--train.max_steps=4", f"--checkpoint.format={fmt}", *args, nproc=1, out_dir=out,
                         corpus=corpus, dataset_dir=dataset_dir, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
        assert str(named) in errors[0] and "refused: it references" in errors[0], errors
        assert "Traceback" not in proc.stderr and "falling back" not in proc.stderr
        assert checkpoint.exists() and not marker.exists()
