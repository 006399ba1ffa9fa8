"""Observability: the trackers (W&B offline, a local MLflow store, TensorBoard) receive the metrics and the
config and a resumed run continues the same tracked run; a profile trace of chosen steps; memory snapshots
(GPU: an injected out-of-memory error and a chosen step); the peak FLOP/s table behind MFU.

The trackers are read back with their own readers (W&B's record protobufs from the offline run file, the
MLflow client, TensorBoard's event reader) and compared with metrics.jsonl, written by the same run.
"""
from __future__ import annotations

import json
import logging
import pickle
import struct
from pathlib import Path

import pytest
import torch
import yaml

from config import ConfigError, LoggingConfig, load_config
from fsdp_utils.observability import peak_flops
from fsdp_utils.observability.metrics import MetricsWriter
from fsdp_utils.observability.profiling import MemorySnapshots
from fsdp_utils.observability.trackers import tracker_key, tracker_problems
from tests import helpers
from tests.helpers import ROOT, read_metrics, run_train
from tests.test_step import tiny_cfg

TINY_CONFIG = ROOT / "config/train_tiny_fsdp.yaml"


# ---- MFU: the peak FLOP/s table ------------------------------------------------------------------------

@pytest.mark.parametrize("name, model", [
    # torch.cuda.get_device_name() strings as the driver reports them
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB"),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L40", "L40"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA A30", "A30"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", "GB200"),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
    ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090"),
    ("NVIDIA RTX A6000", "RTX A6000"),
])
def test_gpu_names_match_their_exact_model(name, model):
    peak = peak_flops.match_gpu(name)
    assert peak is not None and peak.model == model


@pytest.mark.parametrize("name", [
    "NVIDIA A10G",  # not an A10 (a different clock and peak), not in the table
    "NVIDIA H100 80GB HBM3 MIG 1g.10gb",  # a MIG slice has a fraction of the GPU's peak
    "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
    "Tesla V100-SXM2-16GB",  # no bf16 tensor cores
    "NVIDIA GeForce RTX 4080",
    "NVIDIA H800",
    "AMD Instinct MI300X",
])
def test_gpus_not_in_the_table_are_unknown(name):
    assert peak_flops.match_gpu(name) is None


def test_sxm_pcie_and_nvl_differ_and_sparsity_is_not_counted():
    sxm, pcie, nvl = (peak_flops.match_gpu(f"NVIDIA H100 {s}") for s in ("80GB HBM3", "PCIe", "NVL"))
    assert sxm and pcie and nvl
    assert sxm.bf16 > nvl.bf16 > pcie.bf16
    for _, peak in peak_flops.GPU_PEAKS:
        # FP8 runs at twice the bf16 rate, dense vs dense (within the datasheets' rounding: L40S prints 362.05
        # and 733); a sparse figure mixed into one column would be off by 2x.
        assert peak.fp8 is None or peak.fp8 == pytest.approx(2 * peak.bf16, rel=0.02), peak
    # H100 SXM's datasheet: 1,979 bf16 TFLOP/s with sparsity, half of it dense.
    assert sxm.bf16 == pytest.approx(1979e12 / 2, rel=1e-3)


def test_unknown_gpu_gets_no_mfu_and_says_so():
    value, note = peak_flops.resolve_peak_flops(torch.device("cuda", 0), device_name="NVIDIA A10G")
    assert value is None and "'NVIDIA A10G' is not in the peak FLOP/s table" in note
    value, note = peak_flops.resolve_peak_flops(torch.device("cuda", 0), device_name="NVIDIA L4")
    assert value == 121e12 and "is L4" in note
    value, _ = peak_flops.resolve_peak_flops(torch.device("cpu"), override_flops=5e12)
    assert value == 5e12  # logging.peak_tflops wins, on any device
    assert peak_flops.resolve_peak_flops(torch.device("cpu"))[0] is None


# ---- config ---------------------------------------------------------------------------------------------

def problems_of(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(TINY_CONFIG, list(overrides))
    return err.value.problems


def test_logging_options_are_checked_with_one_line_each():
    assert problems_of("--logging.trackers=[tensorbord]") == [
        "logging.trackers='tensorbord' is not one of tensorboard, wandb, mlflow (did you mean 'tensorboard'?)"]
    assert problems_of("--logging.profile_steps=[5, 3]")[0].startswith("logging.profile_steps must be [start, end]")
    assert "ends after train.max_steps" in problems_of("--logging.profile_steps=[3, 5000]")[0]
    assert problems_of("--logging.memory_snapshot_step=3") == [
        "logging.memory_snapshot_step needs logging.memory_snapshot: true (the history is recorded from the start "
        "of training)"]
    assert problems_of("--logging.peak_tflops=-1") == ["logging.peak_tflops must not be negative, got -1.0"]
    assert problems_of("--logging.profile_ranks=rank1")[0].startswith(
        "logging.profile_ranks='rank1' is not one of rank0")


def test_the_peak_is_given_in_tflops():
    assert load_config(TINY_CONFIG, ["--logging.peak_tflops=312"]).logging.peak_override_flops == 312e12
    assert load_config(TINY_CONFIG, []).logging.peak_override_flops == 0  # 0: the GPU's row of the table


def test_a_missing_tracker_package_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert tracker_problems(["tensorboard", "mlflow"]) == []
    assert tracker_problems(["wandb"]) == ["logging.trackers names wandb, but the wandb package is not installed: "
                                           "pip install wandb (or remove wandb from logging.trackers)"]


# ---- readers of what the trackers wrote ---------------------------------------------------------------------

def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file: a 7-byte header, then 32 KiB blocks of records, each with a
    7-byte header (checksum, length, kind: full, first, middle or last piece) and a Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pieces, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def wandb_run(run_dir: Path) -> tuple[str, dict, dict[int, dict]]:
    """(run id, config, step -> logged scalars) of one offline run directory."""
    (run_file,) = run_dir.glob("run-*.wandb")
    run_id, config, history = "", {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "config":
            config |= {u.key: json.loads(u.value_json) for u in record.config.update}
        elif kind == "history":
            # 'train/loss' is stored as the nested key ['train', 'loss']
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[int(items["_step"])] = {k: v for k, v in items.items() if not k.startswith("_")}
    return run_id, config, history


def jsonl_scalars(out: Path) -> dict[int, dict]:
    """step -> {tracker key: value} from metrics.jsonl, the way the trackers must have received them."""
    steps: dict[int, dict] = {}
    for row in read_metrics(out):
        steps.setdefault(row["step"], {}).update({tracker_key(k): v for k, v in row.items()
                                                  if k != "step" and v is not None})
    return steps


# ---- a run tracked by all three, profiled, then resumed --------------------------------------------------------

TRACKED = pytest.mark.slow  # W&B starts its service process; the two jobs with three trackers: 20-30 s on 2 cores


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, corpus, dataset_dir):
    """4 steps (validation at 2 and 4) tracked by TensorBoard, W&B offline and MLflow's local store, steps
    2-3 profiled; then the same output directory resumed to step 6. In-process, one rank."""
    tmp = tmp_path_factory.mktemp("tracked")
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.setenv("WANDB_CONSOLE", "off")  # W&B would wrap pytest's captured stdout
    common = ["--logging.trackers=[tensorboard, wandb, mlflow]", "--logging.wandb_mode=offline",
              "--train.eval_interval=2", "--train.eval_samples=2", "--checkpoint.interval=2", "--run.name=tracked"]
    try:
        with helpers.world_of_one() as env:
            first = tiny_cfg(tmp, corpus, dataset_dir, *common, "--train.max_steps=4",
                             "--logging.profile_steps=[2, 3]")
            helpers.fit(first, env)
            ids_first = json.loads((first.output_dir / "trackers.json").read_text())
            resumed = tiny_cfg(tmp, corpus, dataset_dir, *common, "--train.max_steps=6")
            helpers.fit(resumed, env, resume_from="latest")
    finally:
        mp.undo()
    return first.output_dir, ids_first


@TRACKED
def test_wandb_offline_receives_metrics_config_and_resumes_the_same_run(tracked):
    out, ids_first = tracked
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # the first job and the resumed one
    (id_a, config, hist_a), (id_b, _, hist_b) = wandb_run(runs[0]), wandb_run(runs[1])
    assert id_a == id_b == ids_first["wandb"]  # the resumed job continued the same W&B run
    assert config["train"]["max_steps"] == 4 and config["run"]["name"] == "tracked"
    assert config["logging"]["trackers"] == ["tensorboard", "wandb", "mlflow"]
    expected = jsonl_scalars(out)
    assert sorted(hist_a) == [1, 2, 3, 4] and sorted(hist_b) == [5, 6]
    for step, logged in (hist_a | hist_b).items():
        assert logged.keys() == expected[step].keys() and "train/loss" in logged, step
        assert logged == pytest.approx(expected[step], rel=1e-12), step
    assert "val/loss" in hist_a[2] and "val/loss" in hist_b[6]


@TRACKED
def test_mlflow_local_store_receives_metrics_params_and_resumes_the_same_run(tracked, tmp_path):
    from mlflow.tracking import MlflowClient

    out, ids_first = tracked
    ids = json.loads((out / "trackers.json").read_text())
    assert ids["mlflow"] == ids_first["mlflow"] and ids["mlflow_tracking_uri"] == (out / "mlruns").as_uri()
    client = MlflowClient(tracking_uri=ids["mlflow_tracking_uri"])
    run = client.get_run(ids["mlflow"])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # resumed, not a second run
    assert run.data.params["train.max_steps"] == "4"  # a parameter keeps its first value
    assert run.data.params["logging.wandb_mode"] == "offline"
    expected = jsonl_scalars(out)
    for key in ("train/loss", "train/grad_norm", "val/loss"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == pytest.approx({s: row[key] for s, row in expected.items() if key in row}, rel=1e-12), key
    assert set(history) == {2, 4, 6}
    config = yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text())
    assert config["train"]["max_steps"] == 6  # the artifact is the latest job's resolved config


@TRACKED
def test_tensorboard_holds_both_jobs_scalars(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = tracked
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}  # the last events file: the resumed job's
    expected = jsonl_scalars(out)
    assert losses == pytest.approx({s: expected[s]["train/loss"] for s in losses}, rel=1e-6)


@TRACKED
def test_profile_trace_of_the_chosen_steps(tracked):
    out, _ = tracked
    path = out / "profile/steps2-3/rank0.pt.trace.json"
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = {e["name"]: e for e in events if e["name"].startswith("train_step#")}
    assert sorted(steps) == ["train_step#2", "train_step#3"]  # steps 1 and 4 are outside the profile
    for step in steps.values():
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = {e["name"] for e in events if start <= e["ts"] <= end and e["pid"] == step["pid"]}
        # the step's forward matmuls, its backward and its optimizer step, seen as ops inside the range
        assert {"aten::mm", "autograd::engine::evaluate_function: MmBackward0"} <= inside, sorted(inside)[:50]
        assert any(name.startswith("Optimizer.step#") for name in inside)


@TRACKED
def test_profile_trace_renders_to_a_png(tracked, tmp_path):
    from scripts import render_profile

    out, _ = tracked
    path, png = out / "profile/steps2-3/rank0.pt.trace.json", tmp_path / "timeline.png"
    assert render_profile.main(["trace", str(path), "--out", str(png), "--step", "3"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A CPU trace is drawn per thread from its ops: the matmul lane time is the sum of the step's aten::mm
    # durations (from the first step's range to the end of the trace, step 3 being the last one profiled).
    events = render_profile.load_trace(path)
    name, start, end = render_profile.step_window(events, 3)
    what, lanes = render_profile.lanes_of(events, start, end)
    step3 = next(e for e in events if e["name"] == "train_step#3")
    mm_ms = sum(e["dur"] for e in events if e["name"] in ("aten::mm", "aten::addmm") and e.get("cat") == "cpu_op"
                and e["ts"] >= step3["ts"]) / 1e3
    drawn = sum(d for spans in lanes.values() for _, d, kind in spans if kind == "matmul")
    assert (name, what) == ("train_step#3", "cpu") and mm_ms > 0
    assert drawn >= mm_ms  # the matmul kind also counts bmm, and the backward's matmuls
    assert drawn == pytest.approx(sum(e["dur"] for e in events if e.get("cat") == "cpu_op" and e["ts"] >= start
                                      and render_profile.kind_of(e["name"]) == "matmul") / 1e3)
    # The step's ops nest (aten::linear holds aten::mm): each thread is busy for at most the step's length,
    # and its kinds' own times add up to its busy time.
    for spans in lanes.values():
        busy, kinds = render_profile.lane_figures(spans)
        assert 0 < busy <= (end - start) / 1e3 and sum(kinds.values()) == pytest.approx(busy)


def test_a_gpu_trace_is_windowed_by_the_gpu_side_of_the_step_range():
    """On a GPU the step's CPU range ends once its work is launched; its GPU twin spans the kernels."""
    from scripts import render_profile

    def event(name, cat, ts, dur, tid=7):
        return {"name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    events = [event("train_step#5", "user_annotation", 0, 300, tid=1),
              event("train_step#5", "gpu_user_annotation", 100, 5_000),
              event("ampere_bf16_gemm", "kernel", 200, 4_000),
              event("train_step#6", "user_annotation", 400, 300, tid=1),
              event("train_step#6", "gpu_user_annotation", 5_200, 5_000),
              event("ncclDevKernel_AllGather", "kernel", 5_300, 1_000, tid=9),
              event("ampere_bf16_gemm", "kernel", 6_400, 3_000)]
    assert render_profile.step_window(events, 6) == ("train_step#6", 5_200, 10_200)
    what, lanes = render_profile.lanes_of(events, 5_200, 10_200)
    assert what == "gpu" and {k: [kind for _, _, kind in v] for k, v in lanes.items()} == {
        "GPU 0 stream 7": ["matmul"], "GPU 0 stream 9": ["communication (NCCL)"]}


def test_overlap_summary_splits_a_gpu_step_into_computing_exposed_communication_and_idle(tmp_path):
    """A 5 ms step: an all-gather alone (1 ms, exposed), a 3 ms matmul, a reduce-scatter that overlaps the
    matmul's last 0.4 ms and runs 0.2 ms past it (0.2 ms exposed), then idle to the end (0.8 ms)."""
    from scripts import render_profile

    def event(name, cat, ts, dur, tid=7):
        return {"name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "ph": "X"}

    events = [event("train_step#6", "gpu_user_annotation", 5_200, 5_000),
              event("ncclDevKernel_AllGather", "kernel", 5_300, 1_000, tid=9),
              event("sm90_xmma_gemm_bf16", "kernel", 6_400, 3_000),
              event("ncclDevKernel_ReduceScatter", "kernel", 9_000, 600, tid=9)]
    _, lanes = render_profile.lanes_of(events, 5_200, 10_200)
    assert render_profile.overlap_summary(lanes, 5.0) == pytest.approx(
        {"computing": 3.0, "exposed communication": 1.2, "idle": 0.8})
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert render_profile.main(["summary", str(path)]) == 0
    line = render_profile.summarize_trace(path).splitlines()[0]
    assert line.startswith("train_step#6: 5.0 ms; computing 3.0 ms (60.0%), exposed communication 1.2 ms (24.0%)")


@pytest.mark.slow
def test_memory_snapshot_replayed_by_category(tmp_path):
    from scripts import render_profile

    mib = 2**20
    fwd = [{"filename": "/repo/model/transformer.py", "name": "forward", "line": 1}]
    opt = [{"filename": "/venv/torch/optim/adamw.py", "name": "_init_group", "line": 1}]
    # A hand-made snapshot in torch.cuda.memory._dump_snapshot's format: 10 MiB were live before the recording
    # started; then the optimizer allocates 4 MiB, the forward 8 MiB (freed) and 2 MiB, and 1 MiB from before
    # is freed. At the end 10 - 1 + 4 + 2 = 15 MiB are live, which the segments say.
    trace = [
        {"action": "alloc", "addr": 1, "size": 4 * mib, "frames": opt, "time_us": 1_000_000},
        {"action": "alloc", "addr": 2, "size": 8 * mib, "frames": fwd, "time_us": 1_500_000},
        {"action": "free_requested", "addr": 2, "size": 8 * mib, "frames": fwd, "time_us": 1_900_000},
        {"action": "free_completed", "addr": 2, "size": 8 * mib, "frames": fwd, "time_us": 2_000_000},
        {"action": "alloc", "addr": 3, "size": 2 * mib, "frames": fwd, "time_us": 2_500_000},
        {"action": "free_completed", "addr": 99, "size": 1 * mib, "frames": [], "time_us": 3_000_000},
    ]
    snapshot = {"segments": [{"device": 0, "allocated_size": 15 * mib, "blocks": []}], "device_traces": [trace]}
    times, series = render_profile.memory_timeline(snapshot)
    assert times == [0.0, 0.5, 1.0, 1.5, 2.0]  # the free request changes nothing until it completes
    assert [v / mib for v in series["before recording"]] == [10, 10, 10, 10, 9]
    assert [v / mib for v in series["optimizer state and step"]] == [4, 4, 4, 4, 4]
    assert [v / mib for v in series["forward (activations)"]] == [0, 8, 0, 2, 2]
    path, png = tmp_path / "snap.pickle", tmp_path / "memory.png"
    path.write_bytes(pickle.dumps(snapshot))
    assert render_profile.main(["snapshot", str(path), "--out", str(png)]) == 0 and png.stat().st_size > 0


def test_metrics_writer_sends_any_metric_to_every_tracker(tmp_path):
    class Recorder:
        name = "recorder"

        def __init__(self):
            self.rows, self.closed = [], False

        def log_metrics(self, metrics, step):
            self.rows.append((step, metrics))

        def close(self):
            self.closed = True

    trackers = [Recorder(), Recorder()]
    writer = MetricsWriter(tmp_path, trackers=trackers)
    writer.write({"step": 3, "loss": 2.5, "mfu": None, "lr": 1e-3})
    writer.write({"step": 3, "eval/arc_easy_acc": 0.25, "val_loss": 2.0})
    writer.close()
    for t in trackers:
        assert t.rows == [(3, {"train/loss": 2.5, "train/lr": 1e-3}),
                          (3, {"eval/arc_easy_acc": 0.25, "val/loss": 2.0})] and t.closed


def _log_steps(tmp_path: Path, monkeypatch, caplog, *, compiling: bool, interval: int, ends: dict[int, float]
               ) -> tuple[list[dict], list[str]]:
    """A TrainingLog of 1,000 tokens a step on one rank, on a clock at 0 s at its start and ends[step] at the end
    of each step: the metrics rows and the log lines."""
    import types

    from fsdp_utils.observability import metrics

    tmp_path.mkdir()
    clock = [0.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    with caplog.at_level(logging.INFO, logger="train"):
        training = metrics.TrainingLog(LoggingConfig(interval=interval), tmp_path, max_steps=max(ends), first_step=0,
                                       tokens_per_step=1000, world_size=1, flops_per_token=1.0, peak_flops=None,
                                       device=torch.device("cpu"), compiling=compiling)
        for step, end in ends.items():
            clock[0] = end
            training.on_step(step, loss=torch.tensor(2.0), lr=1e-3, grad_norm=torch.tensor(1.0))
        training.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return rows, [r.getMessage() for r in caplog.records]


def test_the_step_that_compiles_is_said_and_left_out_of_tokens_per_second_and_the_eta(tmp_path, monkeypatch, caplog):
    # Step 1 compiles for 90 s, then each step takes 1 s (1,000 tokens): 1,000 tokens/s from step 2 on.
    ends = {1: 90.0, 2: 91.0, 3: 92.0, 4: 93.0, 5: 94.0, 6: 95.0}
    rows, lines = _log_steps(tmp_path / "compiled", monkeypatch, caplog, compiling=True, interval=2, ends=ends)
    assert lines[0].startswith("compiling: the first step compiles the model (train.compile)")
    assert lines[1] == "compiled in 90.0 s (step 1, with its compute)"
    assert [row["tokens_per_sec_per_gpu"] for row in rows] == [1000.0, 1000.0, 1000.0]
    assert lines[2].endswith(f"| 1,000 tok/s/gpu | mfu n/a | mem {rows[0]['peak_mem_gib']:.2f} GiB | elapsed 0:01:31 | "
                             f"eta 0:00:04"), lines[2]
    # Logged at every step: the step that compiled has no rate of its own.
    caplog.clear()
    rows, lines = _log_steps(tmp_path / "every", monkeypatch, caplog, compiling=True, interval=1, ends=ends)
    assert [row["tokens_per_sec_per_gpu"] for row in rows] == [None, 1000.0, 1000.0, 1000.0, 1000.0, 1000.0]
    assert " n/a tok/s/gpu " in lines[2] and lines[2].endswith("eta n/a"), lines[2]
    # Without train.compile the first window counts every step: 2,000 tokens in 91 s.
    caplog.clear()
    rows, lines = _log_steps(tmp_path / "eager", monkeypatch, caplog, compiling=False, interval=2, ends=ends)
    assert rows[0]["tokens_per_sec_per_gpu"] == 2000 / 91 and not any("compil" in line for line in lines)


# ---- memory snapshots -------------------------------------------------------------------------------------------

def test_memory_snapshot_on_the_cpu_is_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="train"):
        section = LoggingConfig(memory_snapshot=True, memory_snapshot_step=1, memory_snapshot_max_entries=10,
                                profile_ranks="rank0")
        snaps = MemorySnapshots(section, tmp_path, rank=0, device=torch.device("cpu"))
        snaps.on_step_end(1)
        snaps.on_oom(1, "training")
        snaps.close()
    assert [r.getMessage() for r in caplog.records] == [
        "logging.memory_snapshot: the CUDA allocator's history exists only on GPUs; this cpu run records no "
        "memory snapshot"]
    assert not (tmp_path / "memory").exists()


def load_snapshot(path: Path) -> dict:
    with path.open("rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"], "no segments"
    return snapshot


def allocations(snapshot: dict) -> list[dict]:
    return [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]


@pytest.mark.gpu
@pytest.mark.slow
def test_memory_snapshot_on_an_injected_oom_and_at_a_step(tmp_path, corpus, dataset_dir):
    # Step 2 dumps a snapshot; step 3's backward runs out of memory (injected), which dumps another, and
    # train.oom_retry_half carries the run on at half the micro-batch to the end.
    out = tmp_path / "out"
    args = ["--run.device=cuda", "--train.precision=bf16", "--train.max_steps=4", "--train.oom_retry_half=true",
            "--logging.memory_snapshot=true", "--logging.memory_snapshot_step=2"]
    proc = run_train(*args, nproc=1, out_dir=out, corpus=corpus, dataset_dir=dataset_dir,
                     faults={"oom": "3:backward"})
    at_step, on_oom = out / "memory/step2_rank0.pickle", out / "memory/oom_step3_training_rank0.pickle"
    assert f"memory snapshot written to {at_step}" in proc.stderr
    assert f"memory snapshot written to {on_oom}" in proc.stderr
    step_snapshot, oom_snapshot = load_snapshot(at_step), load_snapshot(on_oom)
    # Every allocation recorded carries its stack; the OOM snapshot's history goes further than step 2's.
    assert allocations(step_snapshot) and all(e["frames"] for e in allocations(step_snapshot))
    assert len(allocations(oom_snapshot)) > len(allocations(step_snapshot))
    # Live blocks exist (the model's weights at least) and fit inside the segments reserved from CUDA.
    for snap in (step_snapshot, oom_snapshot):
        live = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
        assert 0 < live <= sum(s["total_size"] for s in snap["segments"])


@pytest.mark.gpu
@pytest.mark.slow
def test_memory_snapshot_and_profile_render(tmp_path, corpus, dataset_dir):
    from scripts import render_profile

    out = tmp_path / "out"
    run_train("--run.device=cuda", "--train.precision=bf16", "--train.max_steps=4", "--logging.memory_snapshot=true",
              "--logging.memory_snapshot_step=3", "--logging.profile_steps=[2, 3]", nproc=1, out_dir=out, corpus=corpus,
              dataset_dir=dataset_dir)
    trace = json.loads((out / "profile/steps2-3/rank0.pt.trace.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])  # CUDA kernels on their streams
    for kind, src in (("trace", out / "profile/steps2-3/rank0.pt.trace.json"),
                      ("snapshot", out / "memory/step3_rank0.pickle")):
        png = tmp_path / f"{kind}.png"
        assert render_profile.main([kind, str(src), "--out", str(png)]) == 0 and png.stat().st_size > 0
