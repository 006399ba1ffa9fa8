"""benchmarks/checkpoint_staging.py: our asynchronous checkpoint staging against DCP's own stager.

Quick: the check that reads a checkpoint back (it must tell a copy taken at the save from one taken later, so that
a fast but wrong stager cannot win), the sampling of the tensors it checks, the byte counts of staged copies, the
StagingOptions of each torch release, the refusal of an unknown variant. Slow: the script itself on two CPU ranks,
every variant saving twice, and a variant whose staging fails on one rank only, recorded while the others run.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from benchmarks import checkpoint_staging as bench
from tests.helpers import ROOT, WITH_FAULTS, fault_env, job_env, run_job

SCRIPT = ROOT / "benchmarks/checkpoint_staging.py"
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=32", "--data.seq_len=32", "--data.vocab_size=320", "--logging.trackers=[]"]


def small_state() -> dict:
    """A state dict as FSDP2 gives it on one rank: DTensor weights and moments, a plain step."""
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    weight = DTensor.from_local(torch.randn(8, 4), mesh, [Shard(0)])
    moment = DTensor.from_local(torch.rand(8, 4), mesh, [Shard(0)])
    return {"model": {"w": weight, "b": torch.randn(4)},
            "optimizer": {"state": {"w": {"exp_avg": moment, "step": torch.tensor(3.0)}}}}


def test_the_check_reads_back_what_was_saved(world_of_one, tmp_path):
    state = small_state()
    expected = bench.expect(state, bench.sample_paths(state, 10))
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    assert bench.check_checkpoint(tmp_path / "ckpt", expected, group=None) == ("equal", "")
    # The blanks it read into start as NaN: every checked value came from the file.
    assert torch.equal(expected.blanks["model"]["w"].to_local(), state["model"]["w"].to_local())


def test_the_check_sees_a_copy_taken_after_training_moved_on(world_of_one, tmp_path):
    # A stager that copies late (or not at all) writes the values of a later step: the checksums taken as the save
    # began differ from the file's, and the key is named.
    state = small_state()
    expected = bench.expect(state, bench.sample_paths(state, 10))
    with torch.no_grad():
        state["optimizer"]["state"]["w"]["exp_avg"].to_local()[3, 1] += 1e-3  # one value, a little
    dcp.save(state, checkpoint_id=str(tmp_path / "late"))
    assert bench.check_checkpoint(tmp_path / "late", expected, group=None) == ("different",
                                                                               "optimizer.state.w.exp_avg")


def test_the_check_reports_a_tensor_missing_from_the_checkpoint(world_of_one, tmp_path):
    state = small_state()
    expected = bench.expect(state, bench.sample_paths(state, 10))
    dcp.save({"model": state["model"]}, checkpoint_id=str(tmp_path / "partial"))
    status, detail = bench.check_checkpoint(tmp_path / "partial", expected, group=None)
    assert status == "error" and "optimizer.state.w" in detail


def test_sampling_takes_every_kind_of_tensor_of_model_and_optimizer_first(world_of_one):
    state = small_state()
    # 5 tensors; kinds: model DTensor, model Tensor, optimizer DTensor, optimizer Tensor -> all 4 within 4.
    chosen = bench.sample_paths(state, 4)
    assert {(path[0], bench.kind_of(bench.at(state, path))) for path in chosen} == {
        ("model", ("DTensor", "Tensor")), ("model", ("Tensor",)), ("optimizer", ("DTensor", "Tensor")),
        ("optimizer", ("Tensor",))}
    assert bench.sample_paths(state, 10) == sorted(path for path, _ in bench.tensor_leaves(state))
    assert bench.sample_paths(state, 0) == []


def test_staged_memory_counts_each_storage_once():
    arena = torch.zeros(1000)  # 4000 bytes
    views = {"a": arena[:10], "b": arena[500:], "c": torch.ones(25)}  # two views of one storage, and 100 bytes
    assert bench.staged_memory(views) == {"staged": 4100, "pinned": 0, "shared": 0}
    views["c"].share_memory_()
    assert bench.staged_memory(views)["shared"] == 100


def test_staging_options_name_the_non_blocking_copy_as_each_release_does(monkeypatch):
    @dataclasses.dataclass
    class EarlyOptions:  # the first releases with DefaultStager
        use_pinned_memory: bool = True
        use_shared_memory: bool = True
        use_async_staging: bool = True
        use_cuda_non_blocking_copy: bool = True

    monkeypatch.setattr(bench, "StagingOptions", EarlyOptions)
    assert bench.staging_options(pinned=False, shared=True, async_staging=True, non_blocking=False) == EarlyOptions(
        use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_cuda_non_blocking_copy=False)
    monkeypatch.undo()
    options = bench.staging_options(pinned=True, shared=False, async_staging=False, non_blocking=False)
    assert dataclasses.asdict(options) == {"use_pinned_memory": True, "use_shared_memory": False,
                                           "use_async_staging": False, "use_non_blocking_copy": False}


def test_an_unknown_variant_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "config/train_tiny_fsdp.yaml", "--out", "unused",
                                      "--variants", "ours_thread,dcp_fast"])
    assert bench.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --variants: dcp_fast: each must be one of ours_thread,")


# ---- the script on two CPU ranks --------------------------------------------------------------------------------
def run_bench(*args: str, tmp_path: Path, faults: dict | None = None) -> tuple[subprocess.CompletedProcess, list]:
    """The benchmark on 2 gloo ranks (forked as torchrun would start them); the job and its JSON rows."""
    rows_file = tmp_path / "rows.jsonl"
    script = [str(WITH_FAULTS), str(SCRIPT)] if faults else [str(SCRIPT)]
    argv = [*script, str(ROOT / "config/train_tiny_fsdp.yaml"), *TINY, "--device", "cpu", "--out",
            str(tmp_path / "out"), "--json", str(rows_file), *args]
    proc = run_job(argv, nproc=2, env=job_env(fault_env(faults)), timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc, [json.loads(line) for line in rows_file.read_text().splitlines()]


@pytest.mark.slow
def test_every_variant_saves_twice_and_reads_back_equal(tmp_path):
    variants = list(bench.VARIANTS)
    proc, rows = run_bench("--fsdp.version=2", "--variants", ",".join(variants), tmp_path=tmp_path)
    assert [(r["variant"], r["save"]) for r in rows] == [(v, i) for v in variants for i in (1, 2)]
    state = rows[0]["state_gib"]
    for r in rows:
        kind, form = bench.VARIANTS[r["variant"]].kind, bench.VARIANTS[r["variant"]].form
        assert r["status"] == "ok" and r["check"] == "equal", r
        assert r["checked_tensors"] == 24
        assert 0 < r["stall_s"] <= r["whole_s"] + 1e-6
        assert r["mode"] == form
        if form == "sync":
            assert r["steps_during_save"] == 0 and r["stall_s"] == pytest.approx(r["whole_s"], abs=0.02)
        else:  # training went on while it was written, and the staged copy holds the whole state (in a padded
            # arena for ours), in shared memory exactly for the process writers; nothing pinned without CUDA
            assert r["steps_during_save"] >= 1
            assert state <= r["staged_gib"] <= state * 1.5 + 0.01, r
            assert r["pinned_gib"] == 0
            assert r["shared_gib"] == (r["staged_gib"] if form == "process" else 0)
        # The folder holds the state: DCP's shards, plus rng.pt and meta.json for ours.
        assert state < r["size_gib"] < state * 1.2 + (0.002 if kind == "ours" else 0)
        assert r["rank_rss_peak_gib"] > 0
        if form == "process":
            assert r["writer_rss_peak_gib"] > 0
    first = rows[0]
    assert first["world_size"] == 2 and first["torch"] == torch.__version__ and len(first["commit"]) in (40, 7)
    assert "checkpoint_staging.py" in first["command"] and first["fsdp_version"] == 2
    assert first["writer_start_s"] > 0  # started once, before the first variant
    assert "dcp_process_blocking" in proc.stdout and "check" in proc.stdout  # the table
    assert list((tmp_path / "out").iterdir()) == []  # every checkpoint, and the invocation's folder, removed


@pytest.mark.slow
def test_a_staging_that_fails_on_one_rank_is_recorded_and_the_others_run(tmp_path):
    # DCP stages and writes in one pipeline: rank 1's staging fails in DCP's staging thread while rank 0's write
    # already waits for rank 1's in DCP's collectives. The ranks agree on the failure, the variant's row says it,
    # and the variants after it still measure; the process form's failure leaves DCP's writer process waiting, so
    # the process variants after it are refused with that reason instead of hanging.
    variants = ["dcp_thread", "dcp_process_blocking", "ours_process", "ours_thread", "dcp_sync"]
    _, rows = run_bench("--fsdp.version=2", "--saves=1", "--variants", ",".join(variants), tmp_path=tmp_path,
                        faults={"dcp_stage_fail": 1})
    by_variant = {r["variant"]: r for r in rows}
    assert list(by_variant) == variants
    for name in ("dcp_thread", "dcp_process_blocking"):
        assert by_variant[name]["status"] == "failed"
        assert by_variant[name]["error"] == "rank 1: RuntimeError: injected DCP staging failure on rank 1 (test hook)"
    assert by_variant["ours_process"]["status"] == "failed"
    assert "still waits in the failed save of dcp_process_blocking" in by_variant["ours_process"]["error"]
    for name in ("ours_thread", "dcp_sync"):
        assert by_variant[name]["status"] == "ok" and by_variant[name]["check"] == "equal"
