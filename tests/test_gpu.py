"""GPU tests (NCCL, bf16/fp16). Marked `gpu`: skipped on machines without CUDA; the 2-GPU cases need two."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import losses, run_train, write_corpus

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
GPU = ["--run.device=cuda", "--train.precision=bf16"]


def needs_gpus(n: int):
    return pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


@needs_gpus(2)
@pytest.mark.parametrize("version", [1, 2])
def test_two_gpus_match_one_gpu_in_bf16(tmp_path, corpus, dataset_dir, version):
    args = [*GPU, f"--fsdp.version={version}", "--train.max_steps=8"]
    run_train(*args, nproc=1, out_dir=tmp_path / "one", corpus=corpus, dataset_dir=dataset_dir)
    run_train(*args, nproc=2, out_dir=tmp_path / "two", corpus=corpus, dataset_dir=dataset_dir)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert one.keys() == two.keys() == set(range(1, 9))
    for step in one:
        # bf16 parameters carry ~3 significant digits; reduction order differs between 1 and 2 GPUs.
        # A wrong data split or a missing gradient average moves the loss by far more than 2%.
        assert math.isclose(one[step], two[step], rel_tol=2e-2), (step, one[step], two[step])
    # It trains (the CPU runs of these settings fall from 5.76 to about 4.8 by step 3): a run whose
    # gradients never reach the optimizer would only drift with the data.
    assert two[8] < 0.85 * two[1], two


@needs_gpus(1)
def test_fp16_with_sharded_grad_scaler_trains_90m(tmp_path, corpus, dataset_dir):
    # The 90M preset's dimensions at a short sequence: fp16 with loss scaling must neither overflow
    # into skipped steps forever nor diverge; the loss must fall.
    run_train("--run.device=cuda", "--train.precision=fp16", "--model.dim=768", "--model.n_layers=12",
              "--model.n_heads=12", "--model.n_kv_heads=12", "--model.max_seq_len=128", "--data.seq_len=128",
              "--train.max_steps=30", "--train.lr=6e-4", "--train.warmup_steps=5",
              "--train.global_batch_size=16", "--train.micro_batch_size=8",
              nproc=min(2, torch.cuda.device_count()), out_dir=tmp_path / "fp16", corpus=corpus,
              dataset_dir=dataset_dir)
    got = losses(tmp_path / "fp16")
    assert all(math.isfinite(v) for v in got.values())
    assert got[30] < 0.7 * got[1], got


@needs_gpus(1)
def test_muon_trains_90m_compiled_in_bf16_and_resumes_from_a_sharded_save(tmp_path, corpus, dataset_dir):
    # The 90M preset's dimensions at a short sequence on one GPU: Muon's Newton-Schulz in bf16 on every block matrix,
    # the blocks compiled; the resumed job's first step is the uninterrupted one's bit for bit, the later ones within
    # the run-to-run variation of GPU kernels.
    args = [*GPU, *MODEL_90M, "--model.max_seq_len=128", "--data.seq_len=128", "--fsdp.version=2",
            "--train.optimizer=muon", "--train.compile=true", "--train.max_steps=12", "--train.warmup_steps=3",
            "--train.global_batch_size=16", "--train.micro_batch_size=8", "--checkpoint.format=sharded",
            "--checkpoint.interval=6", "--checkpoint.keep_last_n=0"]
    run_train(*args, nproc=1, out_dir=tmp_path / "first", corpus=corpus, dataset_dir=dataset_dir)
    run_train(*args, f"--resume_from={tmp_path / 'first' / 'fsdp_sharded_cpt6'}", nproc=1,
              out_dir=tmp_path / "resumed", corpus=corpus, dataset_dir=dataset_dir)
    want, got = losses(tmp_path / "first"), losses(tmp_path / "resumed")
    assert sorted(got) == list(range(7, 13)) and got[7] == want[7], (got, want)
    for step in got:
        assert math.isclose(got[step], want[step], rel_tol=2e-3), (step, got, want)
    assert want[12] < 0.7 * want[1], want


@needs_gpus(2)
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_checkpoint_saved_on_two_gpus_resumes_on_one(tmp_path, corpus, dataset_dir, fmt):
    args = [*GPU, f"--checkpoint.format={fmt}", "--train.max_steps=8", "--checkpoint.interval=4"]
    run_train(*args, nproc=2, out_dir=tmp_path / "two", corpus=corpus, dataset_dir=dataset_dir)
    name = "fsdp_cpt4.pth" if fmt == "full" else "fsdp_sharded_cpt4"
    run_train(*args, f"--resume_from={tmp_path / 'two' / name}", nproc=1, out_dir=tmp_path / "one",
              corpus=corpus, dataset_dir=dataset_dir)
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(one) == [5, 6, 7, 8]  # continued after step 4, not from scratch
    for step in one:
        assert math.isclose(one[step], two[step], rel_tol=2e-2), (step, one[step], two[step])


@pytest.mark.gpu_exclusive  # needs 4 GPUs
@needs_gpus(4)
@pytest.mark.parametrize("version", [1, 2])
def test_sharded_checkpoint_saved_on_four_gpus_resumes_on_two_and_one(tmp_path, corpus, dataset_dir, version):
    # Global batch 8 splits as 2 x 4 GPUs, 4 x 2 and 8 x 1 (no accumulation anywhere): the same samples per
    # step at every world size, so the resumed losses continue the 4-GPU run's, up to bf16 reduction order.
    args = [*GPU, f"--fsdp.version={version}", "--checkpoint.format=sharded", "--train.max_steps=8",
            "--checkpoint.interval=4", "--checkpoint.keep_last_n=0", "--train.global_batch_size=8"]
    run_train(*args, "--train.micro_batch_size=2", nproc=4, out_dir=tmp_path / "four", corpus=corpus,
              dataset_dir=dataset_dir)
    four = losses(tmp_path / "four")
    for nproc in (2, 1):
        out = tmp_path / f"from_four_on_{nproc}"
        run_train(*args, f"--train.micro_batch_size={8 // nproc}",
                  f"--resume_from={tmp_path / 'four' / 'fsdp_sharded_cpt4'}",
                  nproc=nproc, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
        resumed = losses(out)
        assert sorted(resumed) == [5, 6, 7, 8], resumed  # continued after step 4, not from scratch
        for step in resumed:
            assert math.isclose(resumed[step], four[step], rel_tol=2e-2), (nproc, step, resumed[step], four[step])


@needs_gpus(1)
def test_compiled_chunked_loss_in_bf16_matches_fp32_reference():
    # What train.compile uses on GPUs: the chunk loss compiled, bf16 logits, an uneven last chunk.
    from model.loss import chunk_loss_and_grad, chunked_cross_entropy

    compiled = torch.compile(chunk_loss_and_grad, dynamic=False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    h32 = torch.randn(5000, 256, device="cuda", generator=gen)
    w32 = torch.randn(32000, 256, device="cuda", generator=gen) * 0.05
    targets = torch.randint(0, 32000, (5000,), device="cuda", generator=gen)

    def run(dtype, chunk):
        h, w = (t.detach().to(dtype, copy=True).requires_grad_() for t in (h32, w32))
        loss = chunked_cross_entropy(h, w, targets, chunk_tokens=chunk, chunk_loss_fn=compiled)
        (loss * 0.5).backward()
        return loss.double(), h.grad.double(), w.grad.double()

    reference = run(torch.float32, 0)
    for got, want in zip(run(torch.bfloat16, 2048), reference, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 1e-2


# ---- train.micro_batch_size: auto, and out-of-memory retries (fsdp_utils/microbatch.py) -----------------

MODEL_90M = ["--model.dim=768", "--model.n_layers=12", "--model.n_heads=12", "--model.n_kv_heads=12", "--train.lr=6e-4"]


@pytest.mark.gpu_exclusive  # measures GPU memory: alone on its GPUs
@needs_gpus(2)
def test_auto_micro_batch_fits_a_full_step_with_eval_and_is_cached(tmp_path):
    # The 90M shape at sequence 2048, compiled, 64 sequences per GPU, on 2 GPUs held to 6.6 GiB whatever the
    # card (a 6.27 GiB budget at the default margin; a trial past 6.6 GiB would end the run): about 0.6 GiB
    # a sequence, so the search must stop well inside the candidates 1 .. 64; then training and
    # evaluation at the chosen size must stay in the budget. (On one GPU the unsharded states leave too little
    # of the 6.6 GiB for even micro-batch 1: the search refuses, as it should.)
    nproc = 2
    corpus = write_corpus(tmp_path / "corpus.txt", num_docs=800)  # validation split > one 2048-token sequence
    out = tmp_path / "auto"
    args = [*GPU, *MODEL_90M, "--model.max_seq_len=2048", "--data.seq_len=2048", "--train.compile=true",
            f"--train.global_batch_size={64 * nproc}", "--train.micro_batch_size=auto",
            "--train.eval_interval=2", "--train.eval_samples=4", "--checkpoint.interval=2"]
    held = {"gpu_memory_gib": 6.6}
    first = run_train(*args, "--train.max_steps=4", nproc=nproc, out_dir=out, corpus=corpus,
                      dataset_dir=tmp_path / "data", timeout=900, faults=held)
    (entry,) = json.loads((out / "microbatch_cache.json").read_text())["entries"]
    chosen = entry["micro_batch_size"]
    assert f"train.micro_batch_size=auto: micro-batch {chosen} " in first.stderr
    assert 1 < chosen < 64, entry  # a real choice, neither the smallest nor the largest candidate
    # (A size measured over the budget may be in the list too: the one the search stopped at.)
    assert entry["measured_gib"][str(chosen)] <= entry["budget_gib"] <= 6.28
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # peak_mem_gib is max_memory_allocated since the search ended (training and the evaluations at
    # steps 2 and 4); the budget was set on reserved memory, which is at least as large.
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert max(r["peak_mem_gib"] for r in rows if "peak_mem_gib" in r) <= entry["budget_gib"], (rows, entry)
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    # Resumed from step 4: the cached choice, no trial steps.
    second = run_train(*args, "--train.max_steps=6", nproc=nproc, out_dir=out, corpus=corpus,
                       dataset_dir=tmp_path / "data", timeout=900, faults=held)
    assert "measuring trial steps" not in second.stderr and "; no search" in second.stderr
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6]


def both_autos_on_held_gpus(tmp_path, *, nproc: int, global_batch: int, held_gib: float, timed: bool = True):
    """Both autos on the 90M shape at sequence 1024, compiled (each policy compiles anew), 3 steps, on `nproc` GPUs
    held to `held_gib` GiB (a trial past it runs out of memory and ends the run, as on a real card of that size).
    Checks what every such run must hold: the pair that trains is the fastest the search timed (`timed`: it timed
    some), its peak within the budget (at most the default margin's), in the trials and in training. Returns (the
    job, its cache entry)."""
    corpus = write_corpus(tmp_path / "corpus.txt", num_docs=400)
    out = tmp_path / "auto"
    proc = run_train(*GPU, *MODEL_90M, "--model.max_seq_len=1024", "--data.seq_len=1024", "--train.compile=true",
                     f"--train.global_batch_size={global_batch}", "--train.micro_batch_size=auto",
                     "--fsdp.activation_checkpointing=auto", "--train.max_steps=3", nproc=nproc, out_dir=out,
                     corpus=corpus, dataset_dir=tmp_path / "data", timeout=900, faults={"gpu_memory_gib": held_gib})
    (entry,) = json.loads((out / "microbatch_cache.json").read_text())["entries"]
    policy, chosen = entry["activation_checkpointing"], entry["micro_batch_size"]
    assert f"micro-batch {chosen}, activation checkpointing {policy}," in proc.stderr
    if timed:
        assert entry["tokens_per_s"], entry  # a real choice between measured pairs
    if entry["tokens_per_s"]:
        assert entry["tokens_per_s"][f"{policy}@{chosen}"] == max(entry["tokens_per_s"].values())
    assert entry["measured_gib"][str(chosen)] <= entry["budget_gib"] <= 0.95 * held_gib + 0.01
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["peak_mem_gib"] for r in rows if "peak_mem_gib" in r) <= entry["budget_gib"], (rows, entry)
    assert sorted(losses(out)) == [1, 2, 3] and all(math.isfinite(v) for v in losses(out).values())
    return proc, entry


@needs_gpus(2)
def test_auto_checkpointing_and_micro_batch_choose_a_measured_pair_that_fits(tmp_path):
    # On GPUs held to 4.4 GiB (a 4.18 GiB budget at the default margin): without checkpointing only a few sequences
    # fit, so the policies that recompute more are measured at larger micro-batches, and the fitting pairs are timed.
    # Held, not just budgeted: with the margin alone, a trial the search did not predict to fit would finish on a
    # large card.
    proc, entry = both_autos_on_held_gpus(tmp_path, nproc=2, global_batch=64, held_gib=4.4)
    assert "fsdp.activation_checkpointing=auto: tried none: micro-batch 1: " in proc.stderr
    assert len(entry["tried_gib"]) >= 2


@pytest.mark.gpu_exclusive  # measures GPU memory: alone on its GPU
@needs_gpus(1)
def test_the_search_in_the_estimates_order_trains_the_fastest_pair_it_measured_within_the_budget(tmp_path):
    # One GPU the planner knows (H100, H200) held to 8 GiB (a 7.6 GiB budget), 32 sequences: the estimate orders the
    # pairs and each pair measured runs for real; the log holds the estimate of the plan chosen beside what training
    # measures. Where the first pair measured keeps the most at the largest micro-batch (none@32 measured 6.0 GiB on
    # an H200), nothing can beat it and it trains untimed.
    from fsdp_utils.train.planning import gpu_for_device

    if gpu_for_device(torch.cuda.get_device_name()) is None:
        pytest.skip(f"the planner does not know the {torch.cuda.get_device_name()}")
    proc, _ = both_autos_on_held_gpus(tmp_path, nproc=1, global_batch=32, held_gib=8, timed=False)
    assert "the estimate put " in proc.stderr, proc.stderr[-3000:]
    assert "estimate: predicted for " in proc.stderr


@pytest.mark.gpu_exclusive  # measures GPU memory: alone on its GPUs
@needs_gpus(1)
def test_real_out_of_memory_is_retried_at_half_the_micro_batch(tmp_path):
    # One GPU (no other rank to wait for): micro-batch 256 of the 90M shape at sequence 2048, uncompiled,
    # needs far more than 141 GB; train.oom_retry_half halves it (128, 64, ...) until it fits and trains on.
    corpus = write_corpus(tmp_path / "corpus.txt", num_docs=800)  # validation split > one 2048-token sequence
    proc = run_train("--run.device=cuda", "--train.precision=bf16", *MODEL_90M, "--model.max_seq_len=2048",
                     "--data.seq_len=2048", "--train.global_batch_size=256", "--train.micro_batch_size=256",
                     "--train.oom_retry_half=true", "--train.max_steps=2", nproc=1, out_dir=tmp_path / "out",
                     corpus=corpus, dataset_dir=tmp_path / "data", timeout=600)
    assert "out of memory at step 1 (training, micro-batch 256 x accumulation 1, rank 0)" in proc.stderr
    assert "redoing the training of step 1 with micro-batch 128" in proc.stderr
    got = losses(tmp_path / "out")
    assert sorted(got) == [1, 2] and all(math.isfinite(v) for v in got.values())


@needs_gpus(2)
def test_injected_out_of_memory_retry_on_two_gpus_matches_the_reference(tmp_path, corpus, dataset_dir):
    # NCCL and CUDA streams: out of memory (injected) in the backward of step 3's second micro-batch on both
    # GPUs, retried at micro-batch 1. Reference: micro-batch 2 for steps 1-2, then micro-batch 1 resumed
    # from the step-2 checkpoint. Gradients left over from the interrupted attempt would show in step 3's
    # gradient norm (on the CPU: +50%); bf16 noise between the two is about 1%.
    ref, retry = tmp_path / "ref", tmp_path / "retry"
    run_train(*GPU, "--checkpoint.interval=2", "--train.max_steps=2", nproc=2, out_dir=ref, corpus=corpus,
              dataset_dir=dataset_dir)
    run_train(*GPU, "--checkpoint.interval=2", "--train.max_steps=5", "--train.micro_batch_size=1", nproc=2,
              out_dir=ref, corpus=corpus, dataset_dir=dataset_dir)
    proc = run_train(*GPU, "--train.max_steps=5", "--train.oom_retry_half=true", nproc=2, out_dir=retry, corpus=corpus,
                     dataset_dir=dataset_dir, faults={"oom": "3:backward:2"})
    assert "redoing the training of step 3 with micro-batch 1" in proc.stderr
    norms = {}
    for out in (ref, retry):
        rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        norms[out] = {r["step"]: r["grad_norm"] for r in rows if "grad_norm" in r}
    for step in (3, 4, 5):
        assert math.isclose(norms[retry][step], norms[ref][step], rel_tol=5e-2), (step, norms)
    for step, value in losses(ref).items():
        assert math.isclose(losses(retry)[step], value, rel_tol=2e-2), step
@needs_gpus(2)
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_sharded_saves_on_two_gpus_resume(tmp_path, corpus, dataset_dir, mode, version):
    # Synchronous (FSDP1: state dict offloaded to the host piece by piece) and asynchronous saves (pinned
    # staging, thread or process writer) on GPUs: both checkpoints complete and verified, and a resume from
    # step 4 continues the run (bf16 on GPUs: close, as in the tests above, not asserted bit for bit).
    from fsdp_utils.checkpoint import io as checkpoint_io

    save = ["--checkpoint.async_save=false"] if mode == "sync" else ["--checkpoint.async_save=true",
                                                                    f"--checkpoint.async_writer={mode}"]
    args = [*GPU, f"--fsdp.version={version}", "--checkpoint.format=sharded", *save, "--train.max_steps=8",
            "--checkpoint.interval=4"]
    proc = run_train(*args, nproc=2, out_dir=tmp_path / "run", corpus=corpus, dataset_dir=dataset_dir)
    assert ("written in the background" in proc.stderr) == (mode != "sync"), proc.stderr[-3000:]
    for step in (4, 8):
        checkpoint_io.verify(tmp_path / "run" / f"fsdp_sharded_cpt{step}")
    run_train(*args, f"--resume_from={tmp_path / 'run' / 'fsdp_sharded_cpt4'}", nproc=2, out_dir=tmp_path / "resumed",
              corpus=corpus, dataset_dir=dataset_dir)
    first, resumed = losses(tmp_path / "run"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert math.isclose(resumed[step], first[step], rel_tol=2e-2), (step, resumed[step], first[step])


# A small model whose large vocabulary makes the loss's buffers count: the 90M preset (FSDP1, compiled, tied
# embeddings) with 4 blocks of width 1024 (4 kv heads, feed-forward 2816), 32,768 tokens, sequence 1024, micro-batch 4
# per GPU.
MEMORY_MODEL = ["--model.dim=1024", "--model.n_layers=4", "--model.n_heads=16", "--model.n_kv_heads=4",
                "--model.vocab_size=32768", "--model.max_seq_len=1024", "--data.seq_len=1024",
                "--train.micro_batch_size=4", "--data.document_masking=false"]


def benchmark_peak(nproc: int, policy: str, tmp_path) -> tuple[float, int]:
    """benchmarks/benchmark.py's peak GPU memory (bytes, after two warm-up steps) and the model's parameter count."""
    import subprocess

    from tests.helpers import ROOT, torchrun_cmd

    out = tmp_path / f"{policy}-{nproc}.jsonl"
    benchmark, preset = ROOT / "benchmarks/benchmark.py", ROOT / "config/train90M_fsdp.yaml"
    subprocess.run([*torchrun_cmd(nproc), str(benchmark), str(preset), *MEMORY_MODEL,
                    f"--train.global_batch_size={4 * nproc}", f"--fsdp.activation_checkpointing={policy}",
                    "--steps", "2", "--warmup", "2", "--json", str(out)], check=True, cwd=ROOT, timeout=400)
    record = json.loads(out.read_text().splitlines()[-1])
    return record["rows"][0]["peak_mem_gib"] * 2**30, record["params"]


@needs_gpus(2)  # each process's own peak (max_memory_allocated): other tests on the same GPUs do not move it
def test_peak_memory_is_the_sharded_states_plus_what_the_policy_keeps(tmp_path):
    from model import ModelConfig

    cfg = ModelConfig(vocab_size=32768, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, max_seq_len=1024)
    d, kv, hidden, vocab = cfg.dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_dim, cfg.vocab_size
    layers = cfg.n_layers
    tokens = 4 * 1024
    block_params = d * (d + 2 * kv) + d * d + 3 * d * hidden
    # selective_op keeps per token and block, in bf16: its input, q, v, the gate projection and attention's output;
    # selective_op_wide also the k, output and up projections.
    kept = 2 * tokens * layers * (3 * d + kv + hidden)
    wide_extra = 2 * tokens * layers * (kv + d + hidden)
    # Beside them: the loss's weight gradient (an fp32 sum, which each chunk's matmul adds to in place, and the bf16
    # copy kept for backward), the gathered bf16 embedding (the preset ties the output projection to it), and two
    # blocks' gathered weights and gradient buffers.
    beside = (4 + 2) * vocab * d + 2 * vocab * d + 2 * 12 * block_params
    for nproc in (1, 2):
        peak, params = benchmark_peak(nproc, "selective_op", tmp_path)
        wide, _ = benchmark_peak(nproc, "selective_op_wide", tmp_path)
        states = 16 * params / nproc  # fp32 parameters, gradients and AdamW's two moments, sharded
        # What selective_op drops is exactly the outputs it recomputes (measured equal to a few MiB).
        assert abs((wide - peak) - wide_extra) < 0.1 * wide_extra, (nproc, (wide - peak) / 2**20, wide_extra / 2**20)
        # Nothing more than the states, the activations the policy keeps and the buffers beside them: a second
        # sharded copy of the parameters, fp32 copies of the loss's gradient or more kept activations exceed it.
        assert peak - states < 1.2 * (kept + beside), (nproc, (peak - states) / 2**20, (kept + beside) / 2**20)
