"""Hostile and damaged checkpoints, in process: each ends in one CheckpointError-family line
naming the file, or a correct load; nothing the user owns is moved, deleted or written through.

A world-size-1 gloo group and a tiny model make real checkpoints of both formats through the checkpoint
manager in well under a second; every test works on a copy of them. Covered: unsafe pickles refused (not
called corrupt) whatever torch's wording; meta.json and payload validation (keys, types, format version,
the step in the name); DCP storage records that lead out of the folder; the tokenizer each checkpoint
was trained with; symbolic links in the output directory; a crafted planner index for the converter;
misleading messages (a Hugging Face checkpoint into a llama run, a failed background write); and a fuzz
of meta.json, the full checkpoint's checksum record and DCP's .metadata.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import struct
import sys
import time
import types
import warnings
import zipfile
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from config import CheckpointConfig, Config, save_config
from fsdp_utils.checkpoint import io as checkpoint_io
from fsdp_utils.checkpoint.async_save import _InFlight
from fsdp_utils.checkpoint.checksums import file_record, with_meta_crc32
from fsdp_utils.checkpoint.contents import Contents, Snapshot, TrainState, train_state_record
from fsdp_utils.checkpoint.errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointUnsafe
from fsdp_utils.checkpoint.manager import CheckpointManager
from fsdp_utils.checkpoint.names import sidecar_of
from fsdp_utils.checkpoint.safe_read import SafeFileSystemReader
from fsdp_utils.distributed import DistEnv
from fsdp_utils.guards.run_lock import RunLocked, take_run_lock
from model import ModelConfig, Transformer
from scripts import convert_checkpoint
from tests.helpers import ROOT

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16, multiple_of=16)
ENV = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
TOKENIZER = hashlib.sha256(b"the run's tokenizer").hexdigest()


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def model_and_optimizer(seed: int = 0) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Transformer(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    return model, optimizer


def manager(out: Path, fmt: str, contents: Contents | None = None, *, allow_tokenizer_change: bool = False,
            section_keep_last_n: int = 0, **kwargs) -> CheckpointManager:
    """The manager of a run in `out` whose checkpoints hold `contents` (by default a model of seed 1, at step 0)."""
    section = CheckpointConfig(format=fmt, keep_last_n=section_keep_last_n,
                               allow_tokenizer_change=allow_tokenizer_change)
    kwargs = {"model_config": dataclasses.asdict(CONFIG), "tokenizer_sha256": TOKENIZER, **kwargs}
    return CheckpointManager(section, out, env=ENV, contents=contents or Contents(*model_and_optimizer(seed=1)),
                             **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Output directories holding checkpoints of steps 1 and 2, one per format."""
    runs = {}
    for fmt in ("full", "sharded"):
        out = tmp_path_factory.mktemp(fmt)
        model, optimizer = model_and_optimizer()
        for step in (1, 2):
            manager(out, fmt, Contents(model, optimizer, TrainState(step=step, samples_seen=8 * step,
                                                                    tokens_seen=64 * step))).save()
        runs[fmt] = out
    return runs


def run_copy(saved: dict[str, Path], fmt: str, tmp_path: Path) -> Path:
    out = tmp_path / f"run-{fmt}"
    shutil.copytree(saved[fmt], out)
    return out


def newest(out: Path, fmt: str) -> Path:
    return out / ("fsdp_cpt2.pth" if fmt == "full" else "fsdp_sharded_cpt2")


def load(out: Path, fmt: str, resume_from: str = "latest", **kwargs) -> TrainState:
    return manager(out, fmt, **kwargs).load(resume_from)


def one_line(err: BaseException) -> str:
    text = str(err)
    assert text and "\n" not in text, text
    return text


def fix_records(checkpoint: Path) -> None:
    """Record every file's current size and CRC32, as a save would have: only the checks under test stand
    in the way."""
    if checkpoint.is_dir():
        meta = json.loads((checkpoint / "meta.json").read_text())
        meta["files"] = {name: file_record(checkpoint / name) for name in meta["files"]}
        (checkpoint / "meta.json").write_text(json.dumps(with_meta_crc32(meta)))
    else:
        sidecar_of(checkpoint).write_text(json.dumps({"format_version": 1,
                                                      "files": {checkpoint.name: file_record(checkpoint)}}))


# ---- unsafe pickles ------------------------------------------------------------------------------


class Payload:
    """Unpickles by calling `target` (posix.system or builtins.eval) with code that creates `marker`."""

    def __init__(self, target: str, marker: Path):
        self.target, self.marker = target, marker

    def __reduce__(self):
        if self.target == "builtins.eval":
            import builtins
            return builtins.eval, (f"__import__('pathlib').Path({str(self.marker)!r}).touch()",)
        return os.system, (f"touch {self.marker}",)  # pickles as posix.system


def torch_save_calling(obj: object, target: str) -> bytes:
    """torch.save(obj) with its Payload's global written as `target`: os.system is pickled as posix.system,
    so for os.system the name is rewritten in the archive's data.pkl."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    if target != "os.system":
        return buf.getvalue()
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(out, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            if name.endswith("data.pkl"):
                assert b"posix\nsystem\n" in data
                data = data.replace(b"posix\nsystem\n", b"os\nsystem\n")
            zout.writestr(name, data)
    return out.getvalue()


def plant(checkpoint: Path, where: str, target: str, marker: Path) -> Path:
    """Put a Payload calling `target` into the checkpoint; return the file that holds it."""
    payload = Payload(target, marker)
    if where == "pth":
        obj = torch.load(checkpoint, weights_only=True)
        obj["train_state"] = payload
        checkpoint.write_bytes(torch_save_calling(obj, target))
        fix_records(checkpoint)
        return checkpoint
    if where == "rng":
        (checkpoint / "rng.pt").write_bytes(torch_save_calling({"rng": payload}, target))
        fix_records(checkpoint)
        return checkpoint / "rng.pt"
    point_lr_at(checkpoint, torch_save_calling(payload, target))
    fix_records(checkpoint)
    return checkpoint


def point_lr_at(checkpoint: Path, blob: bytes) -> None:
    """Make a non-tensor entry of a .distcp file (the optimizer's lr) the bytes `blob`, appended to its shard."""
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own checkpoint: trusted here
    index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[index]
    shard = checkpoint / info.relative_path
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(blob)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("target", ["os.system", "posix.system", "builtins.eval"])
@pytest.mark.parametrize("where", ["pth", "rng", "distcp"])
@pytest.mark.slow
def test_an_unsafe_checkpoint_is_refused_and_left_alone(saved, tmp_path, where, target):
    """Refused naming what it asked for, neither moved aside nor skipped for the previous checkpoint (torch
    words its refusal of os/posix globals otherwise than of builtins.eval; the words must not matter)."""
    fmt = "full" if where == "pth" else "sharded"
    out = run_copy(saved, fmt, tmp_path)
    marker = tmp_path / "ran"
    checkpoint = newest(out, fmt)
    named = plant(checkpoint, where, target, marker)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(CheckpointUnsafe) as caught:
        load(out, fmt)
    line = one_line(caught.value)
    assert str(named) in line and f"refused: it references {target}" in line, line
    assert sorted(p.name for p in out.iterdir()) == before and not marker.exists()


def torch_save_with_pickle(data_pkl: bytes) -> bytes:
    """A torch.save archive whose data.pkl is `data_pkl` (the archive's other records are torch's own)."""
    buf, out = io.BytesIO(), io.BytesIO()
    torch.save({"rng": None}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(out, "w") as zout:
        for name in zin.namelist():
            zout.writestr(name, data_pkl if name.endswith("data.pkl") else zin.read(name))
    return out.getvalue()


def crafted_pickle(how: str, marker: Path) -> bytes:
    """A pickle that calls os.system(f"touch {marker}") when unpickled, written by hand: `inst` by protocol 0's
    INST opcode; `decoys` by STACK_GLOBAL with two decoy strings pushed above the real names and popped
    before it (a reader that takes the last two strings pushed sees `safe.names`)."""
    command = f"touch {marker}".encode()
    if how == "inst":
        return b"(S'" + command + b"'\nios\nsystem\n."
    strings = b"".join(b"\x8c" + bytes([len(s)]) + s for s in (b"os", b"system", b"safe", b"names"))
    return strings + b"00\x93" + b"\x8c" + bytes([len(command)]) + command + b"\x85R."


def plant_pickle(checkpoint: Path, where: str, data_pkl: bytes) -> Path:
    """Put a torch.save archive holding `data_pkl` where a checkpoint loads one; return the file that holds it."""
    blob = torch_save_with_pickle(data_pkl)
    if where == "pth":
        checkpoint.write_bytes(blob)
    elif where == "rng":
        (checkpoint / "rng.pt").write_bytes(blob)
    else:
        point_lr_at(checkpoint, blob)
    fix_records(checkpoint)
    return checkpoint / "rng.pt" if where == "rng" else checkpoint


@pytest.mark.parametrize("how", ["inst", "decoys"])
@pytest.mark.parametrize("where", ["pth", "rng", "distcp"])
def test_a_hand_written_unsafe_pickle_is_refused_not_called_corrupt(saved, tmp_path, where, how):
    """What the unpickler would import decides, whatever opcodes lead there: neither moved aside as corrupt
    nor skipped for the previous checkpoint, and never run."""
    fmt = "full" if where == "pth" else "sharded"
    out = run_copy(saved, fmt, tmp_path)
    marker = tmp_path / "ran"
    named = plant_pickle(newest(out, fmt), where, crafted_pickle(how, marker))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(CheckpointUnsafe) as caught:
        load(out, fmt)
    line = one_line(caught.value)
    assert str(named) in line and "refused: it references os.system" in line, line
    assert sorted(p.name for p in out.iterdir()) == before and not marker.exists()


def protocol_4_pickle(target: str, marker: Path) -> bytes:
    """A protocol-4 pickle calling `target` with `touch marker`: STACK_GLOBAL of its module and (dotted) name, as
    pickle.dumps writes one. torch.serialization.os.system is os.system, reached through torch's own module."""
    module, _, name = target.partition(".")

    def string(text: str) -> bytes:  # SHORT_BINUNICODE
        return b"\x8c" + bytes([len(text)]) + text.encode()

    return b"\x80\x04" + string(module) + string(name) + b"\x93" + string(f"touch {marker}") + b"\x85R."


@pytest.mark.parametrize("target", ["torch.serialization.os.system", "posix.system"])
@pytest.mark.parametrize("where", ["pth", "rng"])
def test_a_protocol_4_payload_is_refused_as_foreign_code_in_one_line(saved, tmp_path, where, target):
    """Torch stops a protocol-4 pickle at its first SHORT_BINUNICODE, before reading the global, and its words
    then name an opcode: what the pickle imports decides, so it is refused, never moved aside as damage, never
    run, and the refusal is the one line (no torch warnings about the protocol beside it)."""
    fmt = "full" if where == "pth" else "sharded"
    out = run_copy(saved, fmt, tmp_path)
    marker = tmp_path / "ran"
    named = plant_pickle(newest(out, fmt), where, protocol_4_pickle(target, marker))
    before = sorted(p.name for p in out.iterdir())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointUnsafe) as refused:
            load(out, fmt)
    assert one_line(refused.value).startswith(f"{named}: refused: it references {target}, "), refused.value
    assert sorted(p.name for p in out.iterdir()) == before and not marker.exists()
    assert [str(w.message) for w in caught] == []


def test_every_global_torch_save_writes_into_a_checkpoint_counts_as_data(saved):
    """A failed load is called unsafe as soon as its pickle imports a global outside the data torch.save writes:
    the checkpoints' own globals, and those of the other tensors and values a state may hold, are inside."""
    from fsdp_utils.checkpoint.safe_read import _holds_only_data, _pickle_of, pickle_globals

    buf = io.BytesIO()
    torch.save({"bf16": torch.zeros(2, dtype=torch.bfloat16), "fp8": torch.zeros(2, dtype=torch.float8_e4m3fn),
                "parameter": torch.nn.Parameter(torch.ones(2)), "bytes": b"xy", "size": torch.Size([2]),
                "device": torch.device("cpu"), "ordered": collections.OrderedDict(a=1)}, buf)
    files = [newest(saved["full"], "full"), newest(saved["sharded"], "sharded") / "rng.pt", buf]
    found = {name for f in files for name in pickle_globals(_pickle_of(f)) or ["(no pickle)"]}
    assert {"torch._utils._rebuild_tensor_v2", "torch.BFloat16Storage", "torch._utils._rebuild_parameter"} <= found
    assert [name for name in sorted(found) if not _holds_only_data(name)] == []


@pytest.mark.parametrize("target", ["pty spawn", "ctypes CDLL", "operator attrgetter", "marshal loads"])
def test_an_inst_pickle_of_a_module_no_checkpoint_imports_is_unsafe(saved, tmp_path, target):
    """INST's refusal does not name its global in torch's words (an unsupported opcode): the module decides."""
    out = run_copy(saved, "full", tmp_path)
    plant_pickle(newest(out, "full"), "pth", b"(S'x'\ni" + target.replace(" ", "\n").encode() + b"\n.")
    with pytest.raises(CheckpointUnsafe, match=f"refused: it references {target.replace(' ', '.')}"):
        load(out, "full")


@pytest.mark.parametrize(("global_", "python3"), [("commands\nPopen", "subprocess.Popen"),
                                                  ("__builtin__\nexec", "builtins.exec"),
                                                  ("copy_reg\n_reconstructor", "copyreg._reconstructor")])
@pytest.mark.parametrize("where", ["pth", "metadata"])
def test_a_refusal_names_globals_as_python_3_imports_them(saved, tmp_path, where, global_, python3):
    """Protocol 0-2 pickles may spell globals the Python 2 way; the unpickler maps them, and so does the
    refusal (pickle's own mapping: commands is subprocess, copy_reg is copyreg, __builtin__ is builtins)."""
    data_pkl = b"\x80\x02c" + global_.encode() + b"\nq\x00)\x81q\x01."  # NEWOBJ of that global
    fmt = "full" if where == "pth" else "sharded"
    out = run_copy(saved, fmt, tmp_path)
    checkpoint = newest(out, fmt)
    if where == "pth":
        plant_pickle(checkpoint, "pth", data_pkl)
    else:
        (checkpoint / ".metadata").write_bytes(data_pkl)
        fix_records(checkpoint)
    with pytest.raises(CheckpointUnsafe) as caught:
        load(out, fmt)
    line = one_line(caught.value)
    assert f"refused: it references {python3}" in line, line
    assert global_.replace("\n", ".") not in line, line


# ---- metadata ------------------------------------------------------------------------------------


def mutate_meta(checkpoint: Path, change) -> None:
    """Apply `change` to a checkpoint's metadata: meta.json, or the payload of a full checkpoint."""
    if checkpoint.is_dir():
        meta = json.loads((checkpoint / "meta.json").read_text())
        change(meta)
        (checkpoint / "meta.json").write_text(json.dumps(with_meta_crc32(meta)))
    else:
        payload = torch.load(checkpoint, weights_only=True)
        change(payload)
        torch.save(payload, checkpoint)
        fix_records(checkpoint)


META_CASES = {
    "no train_state": (lambda m: m.pop("train_state"), CheckpointCorrupt, "missing train_state"),
    "no model_config": (lambda m: m.pop("model_config"), CheckpointCorrupt, "missing model_config"),
    "an extra key": (lambda m: m.update(surprise=1), CheckpointCorrupt, "unknown key surprise"),
    "an extra train_state key": (lambda m: m["train_state"].update(epoch=3), CheckpointCorrupt, "unknown key epoch"),
    "a string step": (lambda m: m["train_state"].update(step="2"), CheckpointCorrupt, "train_state.step '2'"),
    "negative samples_seen": (lambda m: m["train_state"].update(samples_seen=-8), CheckpointCorrupt, "samples_seen -8"),
    "format_version 99": (lambda m: m.update(format_version=99), CheckpointMismatch, "format_version 99"),
    # Beyond int64, which every count is where it is used (a step past any max_steps would end the run at once).
    "a step of 10**30": (lambda m: m["train_state"].update(step=10**30), CheckpointCorrupt,
                         "train_state.step 1000000000000000000000000000000 is not an integer from 0 to 2**63-1"),
    "tokens_seen of 2**63": (lambda m: m["train_state"].update(tokens_seen=2**63), CheckpointCorrupt,
                             "train_state.tokens_seen 9223372036854775808"),
    "an infinite lr": (lambda m: m["train_state"].update(lr=float("inf")), CheckpointCorrupt, "train_state.lr inf"),
    "world_size 2**40": (lambda m: m.update(world_size=2**40), CheckpointCorrupt, "world_size 1099511627776"),
    "a step other than the name's": (lambda m: m["train_state"].update(step=7), CheckpointMismatch, "holds step 7"),
    # A LoRA record is read by the tools before they build anything from it (its dtype by name from torch).
    "a lora record of a number": (lambda m: m.update(lora=5), CheckpointCorrupt, "lora is not a mapping"),
    "a lora base_dtype naming a function": (
        lambda m: m.update(lora={"rank": 4, "alpha": 8, "targets": ["q"], "base_dtype": "load",
                                 "base": {"seed": 0, "fingerprint": "0" * 16}}),
        CheckpointCorrupt, "lora.base_dtype 'load' is not a torch dtype"),
}


@pytest.mark.parametrize("fmt", ["full", "sharded"])
@pytest.mark.parametrize("case", sorted(META_CASES))
def test_invalid_metadata_is_one_line_for_every_reader(saved, tmp_path, fmt, case):
    change, kind, needle = META_CASES[case]
    out = run_copy(saved, fmt, tmp_path)
    checkpoint = newest(out, fmt)
    mutate_meta(checkpoint, change)
    for read in (lambda: load(out, fmt, str(checkpoint)), lambda: checkpoint_io.read_meta(checkpoint),
                 lambda: checkpoint_io.load_model(checkpoint)):
        with pytest.raises(kind) as caught:
            read()
        assert needle in one_line(caught.value) and str(checkpoint) in str(caught.value), caught.value
    assert checkpoint.exists()


@pytest.mark.parametrize("fmt", ["full", "sharded"])
@pytest.mark.parametrize("field", ["samples_seen", "tokens_seen"])
def test_a_counter_past_2_63_is_never_saved(tmp_path, fmt, field):
    """2**63 - 1 is the most a checkpoint's counter may hold (every reader refuses more, as above): a save that would
    write more is refused in one line naming the field and the checkpoint, and writes no checkpoint."""
    model, optimizer = model_and_optimizer()
    state = TrainState(step=3, samples_seen=24, tokens_seen=192)
    setattr(state, field, 2**63)
    with pytest.raises(CheckpointError) as caught:
        manager(tmp_path, fmt, Contents(model, optimizer, state)).save()
    final = tmp_path / ("fsdp_cpt3.pth" if fmt == "full" else "fsdp_sharded_cpt3")
    assert one_line(caught.value) == (f"{final}: not saved: train_state.{field} 9223372036854775808 is not an integer "
                                      "from 0 to 2**63-1 (a checkpoint holding it would not load)")
    assert not list(tmp_path.glob("*cpt*"))


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_config_describing_more_than_the_checkpoint_holds_is_never_built(saved, tmp_path, fmt):
    """A whole model's checkpoint holds its weights: 2**16 layers of width 1,024 (8.3 * 10**11 weights) in a
    checkpoint of a few hundred KB are not its own, and load_model refuses them before allocating anything."""
    out = run_copy(saved, fmt, tmp_path)
    checkpoint = newest(out, fmt)
    mutate_meta(checkpoint, lambda m: m["model_config"].update(n_layers=2**16, dim=1024))
    with pytest.raises(CheckpointError) as caught:
        checkpoint_io.load_model(checkpoint)
    assert one_line(caught.value) == (f"{checkpoint}: model_config describes 825,841,812,480 parameters, more than "
                                      f"the {CONFIG.num_params():,} weights of the checkpoint's model tensors")


def test_a_sparse_file_in_a_sharded_checkpoint_does_not_vouch_for_a_larger_model(saved, tmp_path, capsys):
    """A pad file listed without a CRC32 (sparse: 20 GiB of size, no disk) made a config of 1.0 * 10**9 weights
    (2 bytes each: under the folder's size) pass for the checkpoint's own, and load_model allocated 4 GB for it
    before DCP refused the shapes. DCP's metadata lists the tensors the shards hold: 17,504 weights (CONFIG)."""
    from scripts import generate

    out = run_copy(saved, "sharded", tmp_path)
    checkpoint = newest(out, "sharded")
    with (checkpoint / "pad.bin").open("wb") as f:
        f.truncate(20 << 30)
    mutate_meta(checkpoint, lambda m: (m["files"].update({"pad.bin": {"size": 20 << 30, "crc32": None}}),
                                       m["model_config"].update(n_layers=80, dim=1024)))
    described = dataclasses.replace(CONFIG, n_layers=80, dim=1024).num_params()
    assert described * 2 < 20 << 30  # the premise: the folder's size vouched for it
    with pytest.raises(CheckpointError) as caught:
        checkpoint_io.load_model(checkpoint)
    assert one_line(caught.value) == (f"{checkpoint}: model_config describes {described:,} parameters, more than "
                                      f"the {CONFIG.num_params():,} weights of the checkpoint's model tensors")
    tokenizer = ROOT / "tests/fixtures/checkpoints_2026_12/tokenizer.model"  # any SentencePiece model will do
    assert generate.main([str(checkpoint), "--prompt", "x", "--device", "cpu", "--tokenizer", str(tokenizer)]) == 1
    assert capsys.readouterr().err == f"error: {caught.value}\n"


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_checkpoint_renamed_to_a_later_step_is_refused_and_nothing_is_deleted(saved, tmp_path, fmt):
    out = run_copy(saved, fmt, tmp_path)
    renamed = newest(out, fmt).with_name(newest(out, fmt).name.replace("2", "9"))
    os.replace(newest(out, fmt), renamed)
    if fmt == "full":
        os.replace(sidecar_of(newest(out, fmt)), sidecar_of(renamed))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(CheckpointMismatch, match="holds step 2, its name says step 9"):
        load(out, fmt)
    assert sorted(p.name for p in out.iterdir()) == before


# ---- meta.json's own checksum, and the folder holding exactly what it lists ---------------------


def resume_latest_sharded(out: Path) -> tuple[TrainState, list[str]]:
    """Resume from `latest`; the state loaded and the names in the output directory afterwards."""
    state = load(out, "sharded")
    return state, sorted(p.name for p in out.iterdir())


def test_a_flipped_digit_in_meta_json_falls_back_to_the_previous_checkpoint(saved, tmp_path, caplog):
    """samples_seen of step 2 is 16 (8 per step, the `saved` fixture); one digit changed to 76 without its
    CRC32 updated would resume at a shifted data position: it is corrupt, moved aside, step 1 loads."""
    out = run_copy(saved, "sharded", tmp_path)
    meta_path = newest(out, "sharded") / "meta.json"
    text = meta_path.read_text()
    assert text.count('"samples_seen": 16') == 1
    meta_path.write_text(text.replace('"samples_seen": 16', '"samples_seen": 76'))
    state, names = resume_latest_sharded(out)
    assert (state.step, state.samples_seen) == (1, 8)
    assert "corrupt-fsdp_sharded_cpt2" in names and "fsdp_sharded_cpt2" not in names
    warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warned) == 1 and f"{meta_path}: corrupt checkpoint (CRC32 of its contents" in warned[0], warned


def test_meta_json_without_its_own_checksum_still_loads(saved, tmp_path, caplog):
    """A checkpoint written before meta.json carried a CRC32 of its own loads, its fields range-checked; nothing
    tells an edited train state from the saved one, so the run says which one it takes (samples_seen 16 edited
    to 40)."""
    out = run_copy(saved, "sharded", tmp_path)
    meta_path = newest(out, "sharded") / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["meta_crc32"]
    meta["train_state"]["samples_seen"] = 40
    meta_path.write_text(json.dumps(meta))
    state = load(out, "sharded")
    assert (state.step, state.samples_seen) == (2, 40)
    warned = [r.getMessage() for r in caplog.records if "no checksum of its own" in r.getMessage()]
    assert warned == [f"{meta_path} has no checksum of its own (saved before meta.json carried one): its train "
                      "state is taken unverified: step 2, samples_seen 40, tokens_seen 128"], warned


# ---- a full checkpoint that is truncated, or has no checksum record ------------------------------


def largest_record_middle(pth: Path) -> int:
    """The offset of a byte in the middle of the largest record of a torch.save archive (stored uncompressed: a
    record's data follows its 30-byte local header, its name and its extra field)."""
    data = pth.read_bytes()
    with zipfile.ZipFile(pth) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len + info.file_size // 2


@pytest.mark.parametrize("record", ["with its record", "without"])
def test_a_truncated_pth_is_called_truncated_and_latest_falls_back(saved, tmp_path, record):
    out = run_copy(saved, "full", tmp_path)
    checkpoint = newest(out, "full")
    checkpoint.write_bytes(checkpoint.read_bytes()[:checkpoint.stat().st_size // 2])
    if record == "without":
        sidecar_of(checkpoint).unlink()
    with pytest.raises(CheckpointCorrupt) as caught:
        load(out, "full", str(checkpoint))
    assert one_line(caught.value).startswith(f"{checkpoint}: truncated or incomplete checkpoint ("), caught.value
    assert load(out, "full").step == 1 and (out / "corrupt-fsdp_cpt2.pth").exists()


def test_a_flipped_bit_in_a_pth_without_its_record_is_caught_by_its_archive(saved, tmp_path):
    """Without the record, the CRC32 torch.save writes for each record of its archive still catches a flipped bit
    inside a tensor's data, which would decode and train on a damaged weight: refused by path (and by the tools),
    moved aside by `latest`, which resumes from step 1."""
    out = run_copy(saved, "full", tmp_path)
    checkpoint = newest(out, "full")
    sidecar_of(checkpoint).unlink()
    data = bytearray(checkpoint.read_bytes())
    data[largest_record_middle(checkpoint)] ^= 0x10
    checkpoint.write_bytes(bytes(data))
    torch.load(checkpoint, weights_only=True)  # the premise: torch reads it without a word
    for read in (lambda: load(out, "full", str(checkpoint)), lambda: checkpoint_io.load_model(checkpoint)):
        with pytest.raises(CheckpointCorrupt) as caught:
            read()
        assert one_line(caught.value).startswith(f"{checkpoint}: corrupt checkpoint (the CRC32 of its record "), \
            caught.value
    assert load(out, "full").step == 1 and (out / "corrupt-fsdp_cpt2.pth").exists()


def test_a_pth_without_its_record_loads_verified_by_its_archive_or_says_it_cannot_be(saved, tmp_path, caplog):
    out = run_copy(saved, "full", tmp_path)
    checkpoint = newest(out, "full")
    sidecar_of(checkpoint).unlink()
    assert load(out, "full", str(checkpoint)).step == 2
    assert not [r for r in caplog.records if "unverified" in r.getMessage()]
    payload = torch.load(checkpoint, weights_only=True)
    torch.serialization.set_crc32_options(False)  # an archive without CRC32s: nothing to check it against
    try:
        torch.save(payload, checkpoint)
    finally:
        torch.serialization.set_crc32_options(True)
    assert load(out, "full", str(checkpoint)).step == 2
    assert [r.getMessage() for r in caplog.records if "unverified" in r.getMessage()] == [
        f"{checkpoint} has no checksum record (.fsdp_cpt2.pth.json) and its archive holds no CRC32s: loading it "
        "unverified"]


def test_meta_json_nested_too_deep_falls_back_to_the_previous_checkpoint(saved, tmp_path):
    out = run_copy(saved, "sharded", tmp_path)
    (newest(out, "sharded") / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    state, names = resume_latest_sharded(out)
    assert state.step == 1 and "corrupt-fsdp_sharded_cpt2" in names


def test_a_file_meta_json_does_not_list_is_not_loaded_unchecked(saved, tmp_path):
    """The shard dropped from meta.json's list (its record with it) would be read without any check."""
    out = run_copy(saved, "sharded", tmp_path)
    checkpoint = newest(out, "sharded")
    meta = json.loads((checkpoint / "meta.json").read_text())
    del meta["files"]["__0_0.distcp"]
    (checkpoint / "meta.json").write_text(json.dumps(with_meta_crc32(meta)))
    with pytest.raises(CheckpointCorrupt) as caught:
        load(out, "sharded", str(checkpoint))
    assert one_line(caught.value).startswith(f"{checkpoint / '__0_0.distcp'}: not listed in meta.json")
    state, names = resume_latest_sharded(out)
    assert state.step == 1 and "corrupt-fsdp_sharded_cpt2" in names


def test_a_link_inside_a_checkpoint_is_refused_and_left_alone(saved, tmp_path):
    """rng.pt replaced by a link to an identical copy outside the folder: same bytes, same records, and yet
    nothing a save writes; reading it would read wherever the link leads."""
    out = run_copy(saved, "sharded", tmp_path)
    checkpoint = newest(out, "sharded")
    outside = tmp_path / "outside-rng.pt"
    shutil.move(checkpoint / "rng.pt", outside)
    (checkpoint / "rng.pt").symlink_to(outside)
    before = sorted(p.name for p in out.iterdir())
    for read in (lambda: load(out, "sharded"), lambda: checkpoint_io.load_model(checkpoint)):
        with pytest.raises(CheckpointUnsafe) as caught:
            read()
        assert one_line(caught.value).startswith(f"{checkpoint / 'rng.pt'}: refused: a symbolic link inside a "
                                                 "checkpoint"), caught.value
    assert sorted(p.name for p in out.iterdir()) == before


# ---- the parts of plain data (contents.PLAIN_PARTS) ---------------------------------------------------------


class Window:
    """A part of plain data as a spike skipper's window of recent losses would be: state_dict / load_state_dict."""

    def __init__(self, losses: tuple[float, ...] = ()):
        self.losses = list(losses)

    def state_dict(self) -> dict:
        return {"losses": self.losses}

    def load_state_dict(self, state: dict) -> None:
        self.losses = list(state["losses"])


@pytest.fixture
def window_part(monkeypatch):
    """PLAIN_PARTS with one more entry, "window", as the checkpoint code and its checks see it."""
    from fsdp_utils.checkpoint import contents, metadata

    for module in (contents, metadata):
        monkeypatch.setattr(module, "PLAIN_PARTS", (*contents.PLAIN_PARTS, "window"))


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_new_plain_part_is_one_entry_and_a_checkpoint_without_it_leaves_it_fresh(saved, tmp_path, fmt,
                                                                                   window_part):
    out = run_copy(saved, fmt, tmp_path)
    window = Window((9.0,))
    run = Contents(*model_and_optimizer(seed=1), window=window)
    assert manager(out, fmt, run).load("latest").step == 2  # saved before the part existed
    assert window.losses == [9.0]
    run.state.advance(samples=8, tokens=64)
    window.losses = [1.5, 2.5]
    path = manager(out, fmt, run).save()
    assert checkpoint_io.read_meta(path)["train_state"]["window"] == {"losses": [1.5, 2.5]}
    resumed = Window()
    assert manager(out, fmt, Contents(*model_and_optimizer(seed=1), window=resumed)).load("latest").step == 3
    assert resumed.losses == [1.5, 2.5]
    mutate_meta(path, lambda m: m["train_state"].update(window=[1.5]))
    with pytest.raises(CheckpointCorrupt, match="train_state.window is not a mapping"):
        checkpoint_io.read_meta(path)


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_the_grad_scaler_is_a_part_of_the_checkpoint(tmp_path, fmt):
    """The scale is saved with the checkpoint and restored into the resumed run's scaler, the loop doing nothing for
    it; a run without a scaler saves None there."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=1024.0)  # as after backoffs: the value a resume must give back, not the initial one
    model, optimizer = model_and_optimizer()
    path = manager(tmp_path, fmt, Contents(model, optimizer, TrainState(step=1), grad_scaler=scaler)).save()
    assert checkpoint_io.read_meta(path)["train_state"]["grad_scaler"]["scale"] == 1024.0
    resumed = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    manager(tmp_path, fmt, Contents(*model_and_optimizer(seed=1), grad_scaler=resumed)).load("latest")
    assert resumed.get_scale() == 1024.0
    plain = manager(tmp_path / "fp32", fmt, Contents(model, optimizer, TrainState(step=1))).save()
    assert checkpoint_io.read_meta(plain)["train_state"]["grad_scaler"] is None


# ---- what a save replaces or removes: only what the run's saves made ---------------------------


def save_step(out: Path, fmt: str, step: int, **kwargs) -> Path:
    model, optimizer = model_and_optimizer()
    state = TrainState(step=step, samples_seen=8 * step, tokens_seen=64 * step)
    return manager(out, fmt, Contents(model, optimizer, state), **kwargs).save()


def users_folder(path: Path) -> dict[str, str]:
    """A folder of the user's at `path` (its contents, for comparing later)."""
    path.mkdir()
    (path / "notes.txt").write_text("the user's notes")
    return {"notes.txt": "the user's notes"}


def contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def test_a_sharded_folder_without_meta_json_is_moved_aside_and_named_never_deleted(saved, tmp_path, caplog):
    """`latest` names a folder under a newer sharded checkpoint's name that has no meta.json and moves it aside
    (it was passed over in silence, then deleted by the save of its step); the step-3 save then writes its own."""
    out = run_copy(saved, "sharded", tmp_path)
    held = users_folder(out / "fsdp_sharded_cpt3")
    assert load(out, "sharded").step == 2
    warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"{out / 'fsdp_sharded_cpt3'}: not a complete sharded "
                                                     "checkpoint (no meta.json"), warned
    save_step(out, "sharded", 3)
    assert contents(out / "corrupt-fsdp_sharded_cpt3") == held
    assert load(out, "sharded").step == 3


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_users_file_under_a_checkpoints_name_is_kept_aside_by_the_save_of_its_step(tmp_path, fmt, caplog):
    """fsdp_sharded_cpt1/ (a folder of the user's) at the step-1 save, or fsdp_cpt1.pth (a file of the user's,
    with a checksum record of its own): kept as kept-<name>, byte for byte, with one warning naming both; the
    save writes its checkpoint, which loads."""
    out = tmp_path / "run"
    out.mkdir()
    name = "fsdp_cpt1.pth" if fmt == "full" else "fsdp_sharded_cpt1"
    if fmt == "full":
        (out / name).write_bytes(b"the user's weights")
        sidecar_of(out / name).write_text("the user's record")
    else:
        held = users_folder(out / name)
    save_step(out, fmt, 1)
    kept = out / f"kept-{name}"
    if fmt == "full":
        assert kept.read_bytes() == b"the user's weights" and sidecar_of(kept).read_text() == "the user's record"
    else:
        assert contents(kept) == held
    warned = [r.getMessage() for r in caplog.records if "is in the way" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"{name} is in the way of the save of {name} ") and \
        f"kept as kept-{name}" in warned[0], warned
    assert load(out, fmt).step == 1


def test_a_users_tmp_folder_stays_and_a_leftover_of_an_interrupted_save_goes(tmp_path, monkeypatch):
    """A save stopped (Ctrl-C) after writing its `.tmp-` file leaves it, recorded in the journal: the next save
    removes it. The user's `.tmp-mybackup/` and a `.tmp-` file of the user's under a save's own temporary name
    are not the run's: they stay (the latter kept aside when a save needs its name)."""
    from fsdp_utils.checkpoint import full

    out = tmp_path / "run"
    out.mkdir()
    held = users_folder(out / ".tmp-mybackup")
    (out / ".tmp-fsdp_cpt3.pth").write_bytes(b"the user's")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(full, "install", interrupted)
        with pytest.raises(KeyboardInterrupt):
            save_step(out, "full", 2)
    assert (out / ".tmp-fsdp_cpt2.pth").is_file()  # what the interrupted save left
    save_step(out, "full", 3)
    names = sorted(p.name for p in out.iterdir())
    assert names == [".checkpoint_journal.jsonl", ".fsdp_cpt3.pth.json", ".tmp-mybackup", "fsdp_cpt3.pth",
                     "kept-.tmp-fsdp_cpt3.pth"], names
    assert contents(out / ".tmp-mybackup") == held and (out / "kept-.tmp-fsdp_cpt3.pth").read_bytes() == b"the user's"


def test_retention_deletes_the_runs_checkpoints_only(tmp_path):
    """keep_last_n=1 over steps 1 to 3: the run's steps 1 and 2 go; a checkpoint copied in from another run
    (step 0: a complete checkpoint of this very format) is never counted or deleted."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    copied = save_step(elsewhere, "full", 0)
    out.mkdir()
    shutil.copy(copied, out / copied.name)
    shutil.copy(sidecar_of(copied), sidecar_of(out / copied.name))
    for step in (1, 2, 3):
        save_step(out, "full", step, section_keep_last_n=1)
    assert sorted(p.name for p in out.glob("fsdp_cpt*")) == ["fsdp_cpt0.pth", "fsdp_cpt3.pth"]
    assert (out / "fsdp_cpt0.pth").read_bytes() == copied.read_bytes()


# ---- DCP storage records -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/hostname", "sub/../../outside.distcp"])
def test_a_storage_record_outside_the_folder_is_refused(saved, tmp_path, where):
    out = run_copy(saved, "sharded", tmp_path)
    checkpoint = newest(out, "sharded")
    shutil.copy(checkpoint / "__0_0.distcp", out / "outside.distcp")  # real data: only the path is wrong
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = dataclasses.replace(info, relative_path=where)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    fix_records(checkpoint)
    for read in (lambda: load(out, "sharded"), lambda: SafeFileSystemReader(str(checkpoint)).read_metadata(),
                 lambda: convert_checkpoint.convert(checkpoint, tmp_path / "out.pth")):
        with pytest.raises(CheckpointUnsafe, match="outside the checkpoint's folder") as caught:
            read()
        one_line(caught.value)
    assert checkpoint.exists()


# ---- the run's tokenizer -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_resuming_with_another_tokenizer_is_refused_unless_allowed(saved, tmp_path, fmt):
    out = run_copy(saved, fmt, tmp_path)
    other = hashlib.sha256(b"another tokenizer").hexdigest()
    assert checkpoint_io.read_meta(newest(out, fmt))["tokenizer_sha256"] == TOKENIZER
    with pytest.raises(CheckpointMismatch,
                       match=f"another tokenizer \\(sha256 {TOKENIZER[:8]}, this run's is {other[:8]}\\)"):
        load(out, fmt, tokenizer_sha256=other)
    assert load(out, fmt, tokenizer_sha256=other, allow_tokenizer_change=True).step == 2
    assert load(out, fmt).step == 2


def test_a_checkpoint_from_before_tokenizers_were_recorded_still_loads(tmp_path):
    model, optimizer = model_and_optimizer()
    manager(tmp_path, "sharded", Contents(model, optimizer, TrainState(step=3)), tokenizer_sha256=None).save()
    assert "tokenizer_sha256" not in checkpoint_io.read_meta(tmp_path / "fsdp_sharded_cpt3")
    assert load(tmp_path, "sharded").step == 3


def test_a_changed_tokenizer_is_kept_and_each_checkpoint_finds_its_own(tmp_path):
    source_a, source_b = tmp_path / "a.model", tmp_path / "b.model"
    source_a.write_bytes(b"tokenizer A")
    source_b.write_bytes(b"tokenizer B")
    out = tmp_path / "run"
    out.mkdir()
    model, optimizer = model_and_optimizer()
    hash_a, hash_b = (hashlib.sha256(p.read_bytes()).hexdigest() for p in (source_a, source_b))
    checkpoint_io.install_tokenizer(source_a, out)
    manager(out, "full", Contents(model, optimizer, TrainState(step=1)), tokenizer_sha256=hash_a).save()
    checkpoint_io.install_tokenizer(source_b, out)  # a deliberate vocabulary swap
    manager(out, "full", Contents(model, optimizer, TrainState(step=2)), tokenizer_sha256=hash_b).save()
    assert (out / "tokenizer.model").read_bytes() == b"tokenizer B"
    assert (out / f"tokenizer.{hash_a[:8]}.model").read_bytes() == b"tokenizer A"
    for step, expected in ((1, b"tokenizer A"), (2, b"tokenizer B")):
        checkpoint = out / f"fsdp_cpt{step}.pth"
        found = checkpoint_io.find_tokenizer(checkpoint, None, checkpoint_io.read_meta(checkpoint)["tokenizer_sha256"])
        assert found.read_bytes() == expected
    (out / f"tokenizer.{hash_a[:8]}.model").unlink()
    with pytest.raises(CheckpointError, match=f"no tokenizer with its sha256 {hash_a[:8]}"):
        checkpoint_io.find_tokenizer(out / "fsdp_cpt1.pth", None, hash_a)


# ---- symbolic links in the output directory ------------------------------------------------------


def test_nothing_is_written_through_a_symbolic_link(tmp_path):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    for name in ("run.lock", "config.yaml", "tokenizer.model"):
        (elsewhere / name).write_text("the user's own file")
        (out / name).symlink_to(elsewhere / name)
    with pytest.raises(RunLocked, match="run.lock: a symbolic link"):
        take_run_lock(out, ENV)
    save_config(Config(), out / "config.yaml")
    source = tmp_path / "new.model"
    source.write_bytes(b"the new tokenizer")
    checkpoint_io.install_tokenizer(source, out)
    assert all((elsewhere / n).read_text() == "the user's own file"
               for n in ("run.lock", "config.yaml", "tokenizer.model"))
    assert not (out / "config.yaml").is_symlink() and "model:" in (out / "config.yaml").read_text()
    assert (out / "tokenizer.model").read_bytes() == b"the new tokenizer"


# ---- the converter and a crafted planner index ---------------------------------------------------


@pytest.mark.parametrize("craft", ["list index", "tensor size"])
def test_convert_refuses_a_layout_that_would_allocate_without_bound(saved, tmp_path, craft, capsys):
    out = run_copy(saved, "sharded", tmp_path)
    checkpoint = newest(out, "sharded")
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    if craft == "list index":
        name = next(n for n, path in metadata.planner_data.items() if any(isinstance(k, int) for k in path))
        metadata.planner_data[name] = tuple(10**12 if isinstance(k, int) else k for k in metadata.planner_data[name])
    else:
        name = "model.tok_embeddings.weight"
        md = metadata.state_dict_metadata[name]
        metadata.state_dict_metadata[name] = dataclasses.replace(md, size=torch.Size([10**7, 10**7]))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    fix_records(checkpoint)
    assert convert_checkpoint.main([str(checkpoint), str(tmp_path / "out.pth")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert name in err[0] and "corrupt checkpoint metadata" in err[0], err


USERS = b"the user's own file"


def users_files(folder: Path, *names: str) -> dict[Path, bytes]:
    """Files of the user's in `folder` at `names` (a name ending in `@` becomes a link to a file of the user's
    elsewhere), each with what it holds or leads to."""
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for name in names:
        if name.endswith("@"):
            target = folder.parent / f"users-{name[:-1]}"
            target.write_bytes(USERS)
            (folder / name[:-1]).symlink_to(target)
            made[folder / name[:-1]] = USERS
        else:
            (folder / name).write_bytes(USERS)
            made[folder / name] = USERS
    return made


def unchanged(files: dict[Path, bytes]) -> bool:
    return all(os.path.lexists(path) and path.read_bytes() == data for path, data in files.items())


@pytest.mark.parametrize("fault", [None, OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["written", "disk-full", "interrupted"])
def test_a_conversion_to_full_leaves_no_temporary_file_and_every_file_of_the_users(saved, tmp_path, monkeypatch,
                                                                                  capsys, fault):
    """The converted file is written under a name of its own: the user's files (and links) at `.tmp-` names
    beside OUT stay as they are, and a write that fails or is interrupted leaves nothing of its own behind."""
    out = tmp_path / "out" / "fsdp_cpt2.pth"
    users = users_files(out.parent, ".tmp-fsdp_cpt2.pth", ".tmp-.fsdp_cpt2.pth.json@", "notes.txt")
    if fault is not None:
        def failing_save(obj, f, *args, **kwargs):
            f.write(b"half a checkpoint")
            raise fault
        monkeypatch.setattr(torch, "save", failing_save)
    argv = [str(newest(saved["sharded"], "sharded")), str(out)]
    if isinstance(fault, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            convert_checkpoint.main(argv)
    else:
        assert convert_checkpoint.main(argv) == (0 if fault is None else 1)
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [] if fault is None else len(err) == 1 and "No space left" in err[0], err
    written = {out.name, sidecar_of(out).name} if fault is None else set()
    assert {p.name for p in out.parent.iterdir()} == {p.name for p in users} | written
    assert unchanged(users)
    if fault is None:
        assert torch.load(out, weights_only=True)["train_state"]["step"] == 2
        assert json.loads(sidecar_of(out).read_text())["files"][out.name] == file_record(out)


def test_an_interrupted_conversion_to_sharded_removes_its_folder_and_only_it(saved, tmp_path, monkeypatch):
    out = tmp_path / "out" / "fsdp_sharded_cpt2"
    users = users_files(out.parent, "notes.txt", ".tmp-mybackup@")
    real_save = dist.checkpoint.save

    def interrupted(state_dict, *, checkpoint_id, **kwargs):
        real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)  # the shards are written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(dist.checkpoint, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint.main([str(newest(saved["full"], "full")), str(out)])
    assert {p.name for p in out.parent.iterdir()} == {p.name for p in users} | {".checkpoint_journal.jsonl"}
    assert unchanged(users)


@pytest.mark.parametrize("planted", ["link", "dangling link", "file"])
def test_the_write_check_never_meets_what_is_planted_in_the_output_directory(tmp_path, planted):
    """The write check's probe has a name of its own: whatever stands at a name it could have had (here the
    name a probe of this rank and process would have had without one) is neither opened, nor removed, nor in
    the way of the run."""
    out = tmp_path / "out"
    out.mkdir()
    name = f".tmp-write-check-rank0-{os.getpid()}"
    if planted == "file":
        users = users_files(out, name)
    elif planted == "link":
        users = users_files(out, name + "@")
    else:
        (out / name).symlink_to(tmp_path / "nothing-yet")
        users = {}
    manager(out, "sharded", Contents(*model_and_optimizer())).prepare_saving()
    assert [p.name for p in out.iterdir()] == [name]
    assert unchanged(users) and not (tmp_path / "nothing-yet").exists()


# ---- misleading messages -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_hugging_face_checkpoint_into_a_llama_run_names_the_model_type(saved, tmp_path, fmt):
    out = run_copy(saved, fmt, tmp_path)
    hf = {"type": "hf", "model_type": "gpt2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": CONFIG.vocab_size,
          "tie_word_embeddings": True}
    mutate_meta(newest(out, fmt), lambda m: m.update(model_config=hf))
    with pytest.raises(CheckpointMismatch,
                       match=r"model type differs from the checkpoint: model.type=llama here, hf \(gpt2\)"):
        load(out, fmt, str(newest(out, fmt)))


def test_a_background_write_that_stopped_short_says_why(tmp_path, monkeypatch):
    ckpt = manager(tmp_path, "sharded")
    job = concurrent.futures.Future()
    job.set_exception(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4096 vs 2048"))
    # The synchronous retry from the staged copy fails too, so the background write's cause ends in the error.
    def failing_save(*args, **kwargs):
        raise OSError("injected: the retry fails too")

    monkeypatch.setattr(torch.distributed.checkpoint, "save", failing_save)
    monkeypatch.setattr(ckpt.background, "_writer", types.SimpleNamespace(group=None))
    ckpt.background._in_flight = _InFlight(tmp_path / ".tmp-fsdp_sharded_cpt5", tmp_path / "fsdp_sharded_cpt5",
                                           Snapshot(train_state_record(TrainState(step=5)), {"rng": None}),
                                           time.perf_counter(), job, staged=None, staged_state={})
    with pytest.raises(CheckpointError, match="a full disk, a quota or a file size limit"):
        ckpt.finish()


# ---- fuzz -----------------------------------------------------------------------------------------


class OpenedOutside:
    """An audit hook that records every file opened outside `root` while armed (hooks cannot be removed:
    this one is armed only inside `watch`)."""

    root: Path | None = None
    seen: ClassVar[list[str]] = []

    @classmethod
    def hook(cls, event: str, args: tuple) -> None:
        if cls.root is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = Path(os.fsdecode(args[0])).absolute()
            if not path.is_relative_to(cls.root) and not path.is_relative_to(sys.prefix) and path.suffix != ".py":
                cls.seen.append(str(path))


sys.addaudithook(OpenedOutside.hook)


def damaged(data: bytes, rng: random.Random) -> bytes:
    """Truncated, bit-flipped, or with a span overwritten by random bytes."""
    kind = rng.choice(["truncate", "flip", "flip", "span"])
    if kind == "truncate":
        return data[:rng.randrange(len(data))]
    out = bytearray(data)
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
    else:
        i = rng.randrange(len(out))
        out[i:i + 8] = bytes(rng.randrange(256) for _ in range(8))
    return bytes(out)


FIELD_VALUES = [None, -1, 0, 2, 99, 10**30, "2", "", "../x", "/etc/hostname", [], {}, [1], {"a": 1}, True, 1.5]


def mutated_json(text: str, rng: random.Random) -> str:
    """A field of the JSON set to a hostile value, removed, or a key added."""
    doc = json.loads(text)
    node = doc
    while True:  # walk to a random dict
        children = [v for v in node.values() if isinstance(v, dict)] if isinstance(node, dict) else []
        if not children or rng.random() < 0.4:
            break
        node = rng.choice(children)
    key = rng.choice(list(node) or ["x"])
    action = rng.choice(["set", "set", "drop", "add"])
    if action == "set":
        node[key] = rng.choice(FIELD_VALUES)
    elif action == "drop":
        node.pop(key, None)
    else:
        node[rng.choice(["../outside.distcp", "extra", "files", "step"])] = rng.choice(FIELD_VALUES)
    if "meta_crc32" in doc and rng.random() < 0.8:  # mostly past meta.json's own checksum, to its validation
        doc = with_meta_crc32(doc)
    return json.dumps(doc)


@pytest.mark.slow  # a few hundred cases: the slow tier
@pytest.mark.parametrize("target", ["meta.json", "sidecar", ".metadata"])
def test_fuzz_checkpoint_loaders(saved, tmp_path, target):
    """100 damaged or mutated copies per file: every load ends in a CheckpointError-family error (one line)
    or loads, and no file outside the run's folder is opened."""
    fmt = "full" if target == "sidecar" else "sharded"
    rng = random.Random(f"fuzz-{target}")
    out = run_copy(saved, fmt, tmp_path)
    checkpoint = newest(out, fmt)
    path = sidecar_of(checkpoint) if target == "sidecar" else checkpoint / target
    original = path.read_bytes()
    (tmp_path / "outside.distcp").write_bytes(b"a file outside the run")
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(100):
        if target == ".metadata" or rng.random() < 0.5:
            data = damaged(original, rng)
        else:
            data = mutated_json(original.decode(), rng).encode()
        path.write_bytes(data)
        OpenedOutside.root, OpenedOutside.seen = out.absolute(), []
        try:
            for read in (lambda: load(out, fmt, str(checkpoint)), lambda: checkpoint_io.load_model(checkpoint)):
                try:
                    read()
                    outcomes["loaded"] += 1
                except CheckpointError as err:
                    one_line(err)
                    outcomes["refused"] += 1
        finally:
            OpenedOutside.root = None
        assert not OpenedOutside.seen, (data, OpenedOutside.seen)
        assert checkpoint.exists() and path.exists()
    assert outcomes["refused"] > 0, outcomes



# ---- end to end: counters at their limit ---------------------------------------------------------


@pytest.mark.slow
def test_a_resume_whose_counters_have_no_room_for_the_run_is_refused(corpus, dataset_dir, tmp_path):
    """The step-2 checkpoint of the tiny run (8 samples of 32 tokens a step) edited, its checksum recomputed.
    samples_seen 2**63 - 1: the 2 steps to train.max_steps=4 would read past the largest data position and save a
    checkpoint no reader loads (samples_seen 2**63 + 15): refused at the resume in one line naming the field and the
    checkpoint, nothing written. tokens_seen 2**63 - 1 - 2 * 256, room for exactly those 2 steps: the run trains,
    and its last checkpoint holds 2**63 - 1 tokens and loads."""
    from tests.helpers import run_train

    out = tmp_path / "run"
    run_train("--train.max_steps=2", nproc=1, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
    checkpoint = out / "fsdp_cpt2.pth"
    mutate_meta(checkpoint, lambda m: m["train_state"].update(samples_seen=2**63 - 1))
    def files() -> dict[str, bytes]:  # the run's lock aside: every run takes it anew
        return {path.name: path.read_bytes() for path in out.iterdir() if path.is_file() and path.name != "run.lock"}

    before = files()
    proc = run_train("--train.max_steps=4", nproc=1, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors == [f"error: {checkpoint}: train_state.samples_seen 9223372036854775807 leaves no room for the 2 "
                      "steps to train.max_steps=4 (8 each): it would pass 2**63-1, the most a checkpoint holds"]
    assert files() == before

    mutate_meta(checkpoint, lambda m: m["train_state"].update(samples_seen=16, tokens_seen=2**63 - 1 - 2 * 256))
    run_train("--train.max_steps=4", nproc=1, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
    assert checkpoint_io.read_meta(out / "fsdp_cpt4.pth")["train_state"]["tokens_seen"] == 2**63 - 1


# ---- end to end: a run resumed with another tokenizer ---------------------------------------------


@pytest.mark.slow
def test_training_refuses_another_tokenizer_unless_allowed(corpus, dataset_dir, tmp_path):
    """train_fsdp.py records the tokenizer's hash; a resume prepared with another corpus (another tokenizer
    of the same size) is refused with one line, tokenizer.model untouched; allowed, the old tokenizer is
    kept and generate.py picks each checkpoint's own."""
    from scripts import generate
    from tests.helpers import run_train, write_corpus

    out = tmp_path / "run"
    run_train("--train.max_steps=2", nproc=1, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
    first = (out / "tokenizer.model").read_bytes()
    other_corpus = write_corpus(tmp_path / "other.txt", num_docs=90)
    other = {"corpus": other_corpus, "dataset_dir": tmp_path / "other-data"}
    proc = run_train("--train.max_steps=4", nproc=1, out_dir=out, check=False, **other)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert "trained with another tokenizer" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and (out / "tokenizer.model").read_bytes() == first
    run_train("--train.max_steps=4", "--checkpoint.allow_tokenizer_change=true", nproc=1, out_dir=out, **other)
    old_hash = checkpoint_io.read_meta(out / "fsdp_cpt2.pth")["tokenizer_sha256"]
    assert (out / f"tokenizer.{old_hash[:8]}.model").read_bytes() == first
    assert (out / "tokenizer.model").read_bytes() != first
    args = [str(out / "fsdp_cpt2.pth"), "--prompt", "the", "--max_new_tokens", "2", "--device", "cpu"]
    assert generate.main(args) == 0
    found = checkpoint_io.find_tokenizer(out / "fsdp_cpt2.pth", None, old_hash)
    assert found.name == f"tokenizer.{old_hash[:8]}.model"
