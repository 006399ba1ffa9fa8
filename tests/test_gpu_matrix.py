"""Every option combines with every other: the combination matrix on 2 GPUs (NCCL).

For each valid combination of FSDP version x precision (bf16, FP8 tensorwise with the FP8 all-gather, FP8
rowwise) x checkpoint (full; sharded synchronous; sharded asynchronous with the thread or the process
writer) x activation checkpointing (none, selective_op; selective_op_lean with each value of the others), a
small model trains 6 steps, saving at steps 2 and 4; a fresh job resumes from step 2, profiled (steps 4-5)
and recording its memory history on both ranks. Both checkpoints must be complete and verified, and the resumed
job must continue the uninterrupted one: step 3's loss (the forward pass of the restored weights on the
restored data position) bit for bit, the later steps within the run-to-run variation of GPU kernels.
Document masking (data.document_masking with model.reset_positions) crosses FSDP version x precision x
activation checkpointing, with torch.compile and asynchronous sharded saves (the GPU presets' settings; the
compiled kernels tuned in three FSDP2 jobs, train.compile_tuning), on a corpus of short documents (most windows
cross a boundary); for the Hugging Face model, FSDP version x activation checkpointing in bf16.
For a Hugging Face model (`model.type=hf`) in bf16, and for LoRA (train.lora, base frozen in bf16, fp32
adapters) on both models with torch.compile where activation checkpointing is on, the combinations are a
pairwise cover of the same options (every pair of values of any two options occurs in some job); a Hugging
Face model with LoRA on FSDP1 also saves full checkpoints sharded and unsharded (NO_SHARD).
train.float8_output (the output projection and loss in FP8) joins with each value of FSDP version x precision x
checkpoint x activation checkpointing at least once, compiled in its FSDP2 jobs. train.optimizer=muon runs on FSDP2
in bf16 with each checkpoint writer and activation checkpointing policy, and on a Hugging Face model.
Combinations that cannot run (FP8 with FSDP1, FP8 with LoRA, Muon with FSDP1) are refused before any process
starts: that part runs on the CPU too.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from config import ConfigError, load_config
from tests.helpers import ROOT, losses, run_train

TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")

SAVES = {
    "full": ["--checkpoint.format=full"],
    "sync": ["--checkpoint.format=sharded", "--checkpoint.async_save=false"],
    "thread": ["--checkpoint.format=sharded", "--checkpoint.async_save=true", "--checkpoint.async_writer=thread"],
    "process": ["--checkpoint.format=sharded", "--checkpoint.async_save=true", "--checkpoint.async_writer=process"],
}
PRECISIONS = ["bf16", "tensorwise", "rowwise"]
ACS = ["none", "selective_op"]
# selective_op_lean (selective_op with the feed-forward's gate/up outputs recomputed) joins the product's jobs
# with each value of every other option at least once (cover of strength 1), and the Hugging Face masking product.
LEAN = "selective_op_lean"
STEPS, SAVE_EVERY = 6, 2
# Run-to-run variation of a bf16 run on GPUs (atomics in attention's backward, reduction order): far below
# what a lost optimizer state or a shifted data position does to a loss at lr 1e-2.
LATER_STEPS_RTOL = 2e-3


def cover(rows: list[tuple], strength: int) -> list[tuple]:
    """A subset of `rows` in which every combination of `strength` values (of as many factors) that occurs in
    `rows` still occurs (greedy: each pick covers the most combinations not yet covered). Where a full product
    would cost too much GPU time, strength 2 keeps every two-option interaction while running far fewer jobs;
    strength 1 gives each value of every factor at least one job."""
    def combinations(row):
        return set(itertools.combinations(enumerate(row), strength))

    uncovered = set().union(*(combinations(row) for row in rows))
    chosen = []
    while uncovered:
        best = max(rows, key=lambda row: len(combinations(row) & uncovered))
        chosen.append(best)
        uncovered -= combinations(best)
    return chosen


def combos(*, fp8: bool):
    rows = list(itertools.product([1, 2], PRECISIONS if fp8 else ["bf16"], SAVES, ACS))
    lean = cover([(v, p, s, LEAN) for v, p, s, _ in rows if p == "bf16" or v == 2], 1)
    for version, precision, save, ac in rows + lean:
        valid = precision == "bf16" or version == 2
        yield pytest.param(version, precision, save, ac, valid, id=f"fsdp{version}-{precision}-{save}-{ac}")


def matrix_args(version: int, precision: str, save: str, ac: str) -> list[str]:
    args = ["--run.device=cuda", "--train.precision=bf16", f"--fsdp.version={version}",
            f"--fsdp.activation_checkpointing={ac}", f"--train.max_steps={STEPS}",
            f"--checkpoint.interval={SAVE_EVERY}", "--checkpoint.keep_last_n=0", *SAVES[save],
            "--train.warmup_steps=2"]  # the helper's TINY warmup, for the checks that load the preset (warmup 50) alone
    if precision != "bf16":
        args.append(f"--train.float8={precision}")
    return args


@pytest.mark.parametrize("version, precision, save, ac, valid", [p for p in combos(fp8=True) if not p.values[-1]])
def test_invalid_combinations_are_refused_with_one_line(version, precision, save, ac, valid):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "config/train_tiny_fsdp.yaml", matrix_args(version, precision, save, ac))
    (line,) = err.value.problems
    assert line.startswith(f"train.float8={precision} needs fsdp.version: 2"), line


def masked_combos():
    for version, precision, ac in itertools.product([1, 2], PRECISIONS, ACS):
        if precision == "bf16" or version == 2:
            yield pytest.param(version, precision, ac, id=f"fsdp{version}-{precision}-{ac}")


MASKING = ["--data.document_masking=true", "--model.reset_positions=true"]
# train.compile_tuning (for long runs) in three FSDP2 masking jobs, each precision and each AC once (tuning adds
# 30-40 s of compile to a job here); the other masking jobs compile untuned.
TUNED = {("bf16", "selective_op"), ("tensorwise", "none"), ("rowwise", "selective_op")}


def checkpoint_name(save: str, step: int) -> str:
    return f"fsdp_cpt{step}.pth" if save == "full" else f"fsdp_sharded_cpt{step}"


def train_save_resume(tmp_path, corpus, dataset_dir, args: list[str], save: str) -> None:
    from fsdp_utils.checkpoint import io as checkpoint_io

    first = tmp_path / "first"
    proc = run_train(*args, nproc=2, out_dir=first, corpus=corpus, dataset_dir=dataset_dir)
    if save in ("thread", "process"):
        assert "written in the background" in proc.stderr, proc.stderr[-3000:]
        assert "synchronously instead" not in proc.stderr, proc.stderr[-3000:]
    for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY):
        checkpoint_io.verify(first / checkpoint_name(save, step))
    resumed = tmp_path / "resumed"
    # The resumed job is also profiled and records its memory history (every rank): neither may change a loss.
    observe = ["--logging.profile_steps=[4, 5]", "--logging.profile_ranks=all", "--logging.memory_snapshot=true",
               "--logging.memory_snapshot_step=4"]
    run_train(*args, *observe, f"--resume_from={first / checkpoint_name(save, SAVE_EVERY)}", nproc=2, out_dir=resumed,
              corpus=corpus, dataset_dir=dataset_dir)
    for rank in (0, 1):
        assert (resumed / f"profile/steps4-5/rank{rank}.pt.trace.json").stat().st_size > 0
        assert (resumed / f"memory/step4_rank{rank}.pickle").stat().st_size > 0
    want, got = losses(first), losses(resumed)
    assert sorted(got) == list(range(SAVE_EVERY + 1, STEPS + 1)), got
    assert got[SAVE_EVERY + 1] == want[SAVE_EVERY + 1], (got, want)
    for step in got:
        assert math.isclose(got[step], want[step], rel_tol=LATER_STEPS_RTOL), (step, got, want)
    assert want[STEPS] < want[1], want  # it trains


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
@pytest.mark.parametrize("version, precision, save, ac, valid", [p for p in combos(fp8=True) if p.values[-1]])
def test_combination_saves_and_resumes(tmp_path, corpus, dataset_dir, version, precision, save, ac, valid):
    if precision != "bf16":
        pytest.importorskip("torchao")
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("needs GPUs with FP8 (compute capability 8.9+)")
    train_save_resume(tmp_path, corpus, dataset_dir, matrix_args(version, precision, save, ac), save)


FLOAT8_OUTPUT = ["--train.float8_output=true", "--train.loss_chunk_tokens=32"]  # 64 tokens per micro-batch: 2 chunks


def float8_output_combos():
    rows = [(version, precision, save, ac) for version, precision, save, ac
            in itertools.product([1, 2], PRECISIONS, SAVES, [*ACS, LEAN]) if precision == "bf16" or version == 2]
    for version, precision, save, ac in cover(rows, 1):
        yield pytest.param(version, precision, save, ac, id=f"fsdp{version}-{precision}-{save}-{ac}")


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
@pytest.mark.parametrize("version, precision, save, ac", list(float8_output_combos()))
def test_float8_output_combination_saves_and_resumes(tmp_path, corpus, dataset_dir, version, precision, save, ac):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs GPUs with FP8 (compute capability 8.9+)")
    if precision != "bf16":
        pytest.importorskip("torchao")
    args = [*matrix_args(version, precision, save, ac), *FLOAT8_OUTPUT, f"--train.compile={str(version == 2).lower()}"]
    train_save_resume(tmp_path, corpus, dataset_dir, args, save)


# fsdp.grad_sync under gradient accumulation (micro-batch 2, accumulation 4; the jobs above accumulate
# nothing): every_micro_batch (auto) with every FSDP version and precision, last_micro_batch likewise.
GRAD_SYNC_JOBS = [(1, "bf16", "full", "selective_op", "last_micro_batch"),
                  (2, "tensorwise", "process", "none", "last_micro_batch"),
                  (2, "rowwise", "sync", LEAN, "last_micro_batch"),
                  (1, "bf16", "thread", "none", "every_micro_batch"),
                  (2, "tensorwise", "full", "selective_op", "every_micro_batch"),
                  (2, "rowwise", "process", "none", "every_micro_batch")]


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
@pytest.mark.parametrize("version, precision, save, ac, grad_sync", GRAD_SYNC_JOBS)
def test_grad_sync_combination_saves_and_resumes(tmp_path, corpus, dataset_dir, version, precision, save, ac,
                                                 grad_sync):
    if precision != "bf16":
        pytest.importorskip("torchao")
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("needs GPUs with FP8 (compute capability 8.9+)")
    args = [*matrix_args(version, precision, save, ac), "--train.micro_batch_size=2", f"--fsdp.grad_sync={grad_sync}"]
    train_save_resume(tmp_path, corpus, dataset_dir, args, save)


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
@pytest.mark.parametrize("version, save, ac", cover(list(itertools.product([1, 2], SAVES, ACS)), 2))
def test_hf_combination_saves_and_resumes(tmp_path, corpus, dataset_dir, version, save, ac):
    precision = "bf16"
    from tests.test_hf import save_tiny

    save_tiny("llama", tmp_path / "hf")
    args = ["--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", *matrix_args(version, precision, save, ac)]
    train_save_resume(tmp_path, corpus, dataset_dir, args, save)


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
@pytest.mark.parametrize("version, precision, ac", list(masked_combos()))
def test_document_masking_combination_saves_and_resumes(tmp_path, version, precision, ac):
    from tests.test_documents import short_documents

    if precision != "bf16":
        pytest.importorskip("torchao")
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("needs GPUs with FP8 (compute capability 8.9+)")
    corpus = short_documents(tmp_path / "docs.jsonl")
    tuning = version == 2 and (precision, ac) in TUNED
    args = [*matrix_args(version, precision, "thread", ac), *MASKING, "--train.compile=true",
            f"--train.compile_tuning={str(tuning).lower()}"]
    train_save_resume(tmp_path, corpus, tmp_path / "ds", args, "thread")


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
@pytest.mark.parametrize("version, ac", list(itertools.product([1, 2], [*ACS, LEAN])))
def test_hf_document_masking_combination_saves_and_resumes(tmp_path, version, ac):
    from tests.test_documents import short_documents
    from tests.test_hf import save_tiny

    save_tiny("llama", tmp_path / "hf")
    corpus = short_documents(tmp_path / "docs.jsonl")
    args = ["--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", *matrix_args(version, "bf16", "thread", ac),
            *MASKING]
    train_save_resume(tmp_path, corpus, tmp_path / "ds", args, "thread")
# train.optimizer=muon (FSDP2 only: its exchange of matrix rows over NCCL, Newton-Schulz in bf16): each checkpoint
# writer and each activation checkpointing policy once, compiled in half the jobs; and a Hugging Face model.
MUON_JOBS = [("full", "none", False), ("thread", "selective_op", True), ("process", LEAN, False),
             ("sync", "none", True)]


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
@pytest.mark.parametrize("save, ac, compile", MUON_JOBS)
def test_muon_combination_saves_and_resumes(tmp_path, corpus, dataset_dir, save, ac, compile):
    args = [*matrix_args(2, "bf16", save, ac), "--train.optimizer=muon", f"--train.compile={str(compile).lower()}"]
    train_save_resume(tmp_path, corpus, dataset_dir, args, save)


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
def test_hf_muon_combination_saves_and_resumes(tmp_path, corpus, dataset_dir):
    from tests.test_hf import save_tiny

    save_tiny("qwen2", tmp_path / "hf")  # biases on q, k and v: AdamW's, beside Muon's projection weights
    args = ["--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", *matrix_args(2, "bf16", "thread", "none"),
            "--train.optimizer=muon"]
    train_save_resume(tmp_path, corpus, dataset_dir, args, "thread")


def test_muon_on_fsdp1_is_refused_with_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "config/train_tiny_fsdp.yaml", [*matrix_args(1, "bf16", "full", "none"),
                                                           "--train.optimizer=muon"])
    (line,) = err.value.problems
    assert line.startswith("train.optimizer=muon needs fsdp.version: 2"), line


LORA_ARGS = ["--train.lora.rank=8", "--train.lora.alpha=16", "--train.lora.targets=[all]"]


def lora_combos():
    for model, version, save, ac in cover(list(itertools.product(["ours", "hf"], [1, 2], SAVES, ACS)), 2):
        yield pytest.param(model, version, save, ac, id=f"lora-{model}-fsdp{version}-{save}-{ac}")


def test_lora_with_float8_is_refused_with_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "config/train_tiny_fsdp.yaml", [*LORA_ARGS, *matrix_args(2, "tensorwise", "full", "none")])
    (line,) = err.value.problems
    assert line.startswith("train.float8=tensorwise cannot be combined with train.lora"), line


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
@pytest.mark.parametrize("model, version, save, ac", list(lora_combos()))
def test_lora_combination_saves_and_resumes(tmp_path, corpus, dataset_dir, model, version, save, ac):
    args = [*LORA_ARGS, *matrix_args(version, "bf16", save, ac)]
    if ac != "none":
        args.append("--train.compile=true")
    if model == "hf":
        from tests.test_hf import save_tiny

        save_tiny("llama", tmp_path / "hf")
        args = ["--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", *args]
    train_save_resume(tmp_path, corpus, dataset_dir, args, save)


@pytest.mark.gpu
@pytest.mark.slow
@TWO_GPUS
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_hf_lora_on_fsdp1_saves_full_checkpoints_and_resumes(tmp_path, corpus, dataset_dir, strategy):
    """A Hugging Face model with LoRA on FSDP1, full saves (gathered to rank 0 through host memory on GPUs), outside
    the cover: sharded, and unsharded, where FSDP1 leaves the frozen base out of its units."""
    from tests.test_hf import save_tiny

    save_tiny("llama", tmp_path / "hf")
    args = ["--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", *LORA_ARGS,
            *matrix_args(1, "bf16", "full", "none"), f"--fsdp.sharding_strategy={strategy}"]
    train_save_resume(tmp_path, corpus, dataset_dir, args, "full")
