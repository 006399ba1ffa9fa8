"""scripts/render_profile.py on hand-made inputs: a CPU trace's busy time per thread where ops nest, and
memory snapshots read as plain data only (a pickle that would run code is refused before it runs)."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from scripts import render_profile


def op(name: str, ts: int, dur: int, tid: int, cat: str = "cpu_op") -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_cpu_trace_busy_time_counts_nested_ops_once(tmp_path, capsys):
    """Step 1 runs from 0 to 10 ms (train_step#2 starts at 10 ms). Thread 1: aten::linear 1-5 ms holding
    aten::mm 1.5-4.5 ms, then aten::add_ 6-7 ms holding aten::copy_ 6.2-6.5 ms. Busy: the union, 4 + 1 = 5 ms
    (the durations add up to 8.3 ms). Own time by kind: matmul 3 (mm), memory copy 0.3 (copy_), other
    1 (linear less mm) + 0.7 (add_ less copy_) = 1.7; together 5 ms. Thread 2: aten::addmm 8-8.5 ms and
    aten::mm from 9 ms for 2.5 ms, cut at the window's end: 0.5 + 1 = 1.5 ms of matmul. Step 2's op is left out."""
    events = [op("train_step#1", 0, 9_000, 1, cat="user_annotation"),
              op("aten::linear", 1_000, 4_000, 1), op("aten::mm", 1_500, 3_000, 1),
              op("aten::add_", 6_000, 1_000, 1), op("aten::copy_", 6_200, 300, 1),
              op("aten::addmm", 8_000, 500, 2), op("aten::mm", 9_000, 2_500, 2),
              op("train_step#2", 10_000, 1_000, 1, cat="user_annotation"), op("aten::mm", 10_500, 100, 1)]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert render_profile.main(["trace", str(path), "--step", "1", "--out", str(tmp_path / "t.png")]) == 0
    printed = capsys.readouterr().out
    # Columns: busy, then communication, attention, matmul, memory copy, optimizer, elementwise / other.
    assert "| thread 1 | 5.00 | 0.00 | 0.00 | 3.00 | 0.30 | 0.00 | 1.70 |" in printed, printed
    assert "| thread 2 | 1.50 | 0.00 | 0.00 | 1.50 | 0.00 | 0.00 | 0.00 |" in printed, printed
    assert "train_step#1: 10.00 ms" in printed


# ---- memory snapshots ----------------------------------------------------------------------------------------

MIB = 2**20
FRAMES = [{"filename": "/repo/model/transformer.py", "line": 88, "name": "forward"}]


def snapshot_like() -> dict:
    """A snapshot with the structure torch.cuda.memory._snapshot() returns: segments (each with its blocks),
    one allocation history per device, and the allocator's settings. 6 MiB are live at the end: 2 MiB from
    before the recording, 4 MiB that the forward allocated (its 8 MiB block was freed)."""
    block = {"address": 0x7F00_0000_0000, "size": 4 * MIB, "requested_size": 4 * MIB, "state": "active_allocated",
             "frames": FRAMES}
    segment = {"device": 0, "address": 0x7F00_0000_0000, "total_size": 20 * MIB, "allocated_size": 6 * MIB,
               "active_size": 6 * MIB, "requested_size": 6 * MIB, "stream": 0, "segment_type": "large",
               "segment_pool_id": (0, 0), "is_expandable": False, "frames": FRAMES, "blocks": [block]}
    trace = [{"action": "alloc", "addr": 1, "size": 8 * MIB, "stream": 0, "time_us": 1_000_000, "frames": FRAMES},
             {"action": "free_requested", "addr": 1, "size": 8 * MIB, "stream": 0, "time_us": 1_500_000,
              "frames": FRAMES},
             {"action": "free_completed", "addr": 1, "size": 8 * MIB, "stream": 0, "time_us": 1_600_000,
              "frames": FRAMES},
             {"action": "alloc", "addr": 2, "size": 4 * MIB, "stream": 0, "time_us": 2_000_000, "frames": FRAMES}]
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "max_split_size": -1,
                "garbage_collection_threshold": 0.0, "expandable_segments": True,
                "roundup_power2_divisions": {"1": 0, "2": 0}}
    return {"segments": [segment], "device_traces": [trace], "allocator_settings": settings}


def test_a_snapshot_loads_as_plain_data_at_every_pickle_protocol(tmp_path, capsys):
    snapshot = snapshot_like()
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{protocol}.pickle"
        path.write_bytes(pickle.dumps(snapshot, protocol=protocol))
        assert render_profile.load_snapshot(path) == snapshot
    # As _dump_snapshot writes it (pickle.dump's default protocol), drawn: at the peak the forward's 8 MiB
    # block (0.008 GiB in the table's rounding) is live beside the 2 MiB from before the recording.
    path, png = tmp_path / "step3_rank0.pickle", tmp_path / "memory.png"
    with path.open("wb") as f:
        pickle.dump(snapshot, f)
    assert render_profile.main(["snapshot", str(path), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| before recording | 0.002 | 0.002 |" in printed and "| forward (activations) | 0.008 | 0.008 |" in printed


class System:
    """Unpickles by calling os.system(command)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_a_snapshot_that_would_run_code_is_refused(tmp_path, capsys):
    """A snapshot whose frame carries an os.system call (creating a marker file): refused with one line
    naming the file and the global, nothing written, the marker never created. Unpickled by pickle itself,
    the same file runs the command: the payload is live."""
    marker = tmp_path / "ran"
    snapshot = snapshot_like()
    snapshot["device_traces"][0][0]["frames"] = [System(f"touch {marker}")]
    path, png = tmp_path / "copied_rank0.pickle", tmp_path / "memory.png"
    path.write_bytes(pickle.dumps(snapshot))

    assert render_profile.main(["snapshot", str(path), "--out", str(png)]) == 1
    line = one_error(capsys)
    assert str(path) in line and "refused: it references" in line and ".system" in line, line
    assert not marker.exists() and not png.exists()

    with path.open("rb") as f:
        pickle.load(f)
    assert marker.exists()


@pytest.mark.parametrize(("content", "needle"), [
    (b"\x80\x05garbage", "not a CUDA memory snapshot"),
    (pickle.dumps([1, 2, 3]), "expected a dict with segments and device_traces"),
], ids=["garbage", "a list"])
def test_a_file_that_is_not_a_snapshot_is_one_line(tmp_path, capsys, content: bytes, needle: str):
    path = tmp_path / "snap.pickle"
    path.write_bytes(content)
    assert render_profile.main(["snapshot", str(path), "--out", str(tmp_path / "m.png")]) == 1
    line = one_error(capsys)
    assert str(path) in line and needle in line, line


def test_snapshot_path_is_named_when_missing(tmp_path: Path, capsys):
    missing = tmp_path / "nothing.pickle"
    assert render_profile.main(["snapshot", str(missing), "--out", str(tmp_path / "m.png")]) == 1
    assert str(missing) in one_error(capsys)


# ---- hostile inputs --------------------------------------------------------------------------------------------

def deeply_nested_frames(depth: int) -> bytes:
    """A snapshot pickle whose one event's frames are lists nested `depth` deep, written opcode by opcode
    (pickle.dumps itself would recurse that deep): EMPTY_LIST `depth` times, then APPEND `depth - 1` times."""
    def text(value: str) -> bytes:
        return b"X" + len(value.encode()).to_bytes(4, "little") + value.encode()  # BINUNICODE

    event = (b"}(" + text("action") + text("alloc") + text("addr") + b"K\x01" + text("size") + b"K\x01"
             + text("frames") + b"]" * depth + b"a" * (depth - 1) + b"u")
    return b"\x80\x02}(" + text("segments") + b"]" + text("device_traces") + b"]]" + event + b"aau."


def step(name: object, ts: object = 0, dur: object = 1_000) -> dict:
    return {"name": name, "cat": "user_annotation", "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 1}


HOSTILE_TRACES = {
    "nested too deeply": ('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}",
                          "not a chrome trace (JSON nested too deeply)"),
    "events not a list": ('{"traceEvents": "x"}', "expected an object with a traceEvents list"),
    "a list at the top": ("[1, 2]", "expected an object with a traceEvents list"),
    "events not objects": ('{"traceEvents": [1, "a", null, [2]]}', "no train_step#N ranges"),
    "a name that is a number": (json.dumps({"traceEvents": [step(5)]}), "no train_step#N ranges"),
    "a start that is text": (json.dumps({"traceEvents": [step("train_step#1", ts="0")]}), "no train_step#N ranges"),
    "not JSON": ("{", "not a chrome trace (not JSON: "),
    # 10,000 steps, none of them step 3, with names of 5 KB: the message lists a few, cut short.
    "many long step names": (json.dumps({"traceEvents": [step(f"train_step#{i + 4}{'0' * 5000}", ts=i)
                                                         for i in range(10_000)]}), "step 3 is not in the trace"),
}


@pytest.mark.parametrize("case", list(HOSTILE_TRACES))
@pytest.mark.parametrize("kind", ["trace", "summary"])
def test_a_hostile_trace_is_one_error_line(tmp_path, capsys, case, kind):
    text, needle = HOSTILE_TRACES[case]
    path, png = tmp_path / "rank0.pt.trace.json", tmp_path / "t.png"
    path.write_text(text)
    args = [kind, str(path)] + (["--out", str(png), "--step", "3"] if kind == "trace" else [])
    assert render_profile.main(args) == 1
    line = one_error(capsys)
    assert str(path) in line and len(line) < 600 and not png.exists(), line[:1000]
    if kind == "trace" or needle.startswith("not a chrome trace") or "expected" in needle:
        assert needle in line, line[:1000]


HOSTILE_SNAPSHOTS = {
    "frames nested too deeply": (deeply_nested_frames(100_000), "device_traces[0][0] has frames that are not"),
    "a segment that is a number": (pickle.dumps({"segments": [1], "device_traces": []}),
                                   "a segment is not a dict with a numeric allocated_size"),
    "an event that is a number": (pickle.dumps({"segments": [], "device_traces": [[1]]}),
                                  "device_traces[0][0] is not an event"),
    "a history that is text": (pickle.dumps({"segments": [], "device_traces": ["abc"]}),
                               "device_traces[0] is not a list of events"),
    "frames that are numbers": (pickle.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 1, "size": 1, "frames": [1]}]]}), "has frames that are not"),
    "a file name that is a number": (pickle.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 1, "size": 1, "frames": [{"filename": 3}]}]]}), "has frames that are not"),
    "times that are text": (pickle.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 1, "size": 1, "time_us": "x"}]]}), "has a time_us that is not a number"),
    "a size that is text": (pickle.dumps({"segments": [], "device_traces": [[
        {"action": "free_completed", "addr": 1, "size": "1"}]]}), "has no integer addr and numeric size"),
}


@pytest.mark.parametrize("case", list(HOSTILE_SNAPSHOTS))
def test_a_hostile_snapshot_is_one_error_line(tmp_path, capsys, case):
    content, needle = HOSTILE_SNAPSHOTS[case]
    path, png = tmp_path / "snap.pickle", tmp_path / "m.png"
    path.write_bytes(content)
    assert render_profile.main(["snapshot", str(path), "--out", str(png)]) == 1
    line = one_error(capsys)
    assert line.startswith(f"error: {path}: not a CUDA memory snapshot (") and needle in line, line
    assert not png.exists()


@pytest.mark.parametrize("kind", ["trace", "snapshot"])
def test_a_fifo_or_a_folder_is_refused_without_reading_it(tmp_path, capsys, kind):
    # Reading a FIFO would block until a writer comes: named in one line at once.
    for what, make in (("a FIFO", os.mkfifo), ("a folder", os.mkdir)):
        path = tmp_path / f"input-{what[2:]}"
        make(path)
        assert render_profile.main([kind, str(path), "--out", str(tmp_path / "out.png")]) == 1
        assert one_error(capsys) == f"error: {path}: {what}, not a file"
