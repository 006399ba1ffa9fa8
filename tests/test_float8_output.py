"""train.float8_output: the output projection and its loss in FP8 (model/float8_projection.py), on the CPU, where
torch emulates torch._scaled_mm: against an fp32 computation of the same inputs, and its config checks."""
from __future__ import annotations

import pytest
import torch

from config import ConfigError, load_config
from model.float8_projection import FLOAT8_ALIGNMENT, LOGIT_GRAD_SCALE, Float8Projection, float8_e4m3
from model.loss import IGNORE_INDEX, chunked_cross_entropy, vocab_slices
from tests.helpers import ROOT, CountOps

TINY_PRESET = ROOT / "config/train_tiny_fsdp.yaml"

GEN_SEED = 11


def inputs(tokens: int = 96, dim: int = 32, vocab: int = 208):
    gen = torch.Generator().manual_seed(GEN_SEED)
    h = torch.randn(tokens, dim, generator=gen)
    w = torch.randn(vocab, dim, generator=gen) * 0.2
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    return h, w, targets


def fp8_loss(h, w, targets, *, chunk: int, float8: Float8Projection | None) -> torch.Tensor:
    """chunked_cross_entropy as the model calls it, with train.float8_output's functions or without."""
    if float8 is None:
        return chunked_cross_entropy(h, w, targets, chunk_tokens=chunk)
    return chunked_cross_entropy(h, w, targets, chunk_tokens=chunk, chunk_loss_fn=float8.chunk_loss,
                                 make_matmuls=float8.matmuls)


def loss_and_grads(h32, w32, targets, *, chunk: int, float8: Float8Projection | None):
    h, w = (t.detach().clone().requires_grad_() for t in (h32, w32))
    loss = fp8_loss(h, w, targets, chunk=chunk, float8=float8)
    (loss * 0.5).backward()  # scaled, as with gradient accumulation
    return loss.detach().double(), h.grad.double(), w.grad.double()


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("chunk", [32, 64, 0], ids=["even", "short-last-chunk", "one-chunk"])
def test_float8_loss_and_gradients_are_close_to_fp32(chunk):
    # e4m3 keeps 3 mantissa bits and e5m2 2: measured 2.7e-2 relative on the gradients, 3e-5 on the loss (and the
    # same at 8B's shapes on an H200). A scale applied the wrong way round, or a gradient left at LOGIT_GRAD_SCALE,
    # is off by orders of magnitude.
    h, w, targets = inputs()
    want = loss_and_grads(h, w, targets, chunk=0, float8=None)
    got = loss_and_grads(h, w, targets, chunk=chunk, float8=Float8Projection())
    assert relative(got[0], want[0]) < 1e-3
    assert 1e-3 < relative(got[1], want[1]) < 6e-2  # FP8 it is: the bf16-free fp32 path would be ~1e-7
    assert 1e-3 < relative(got[2], want[2]) < 6e-2


def test_ignored_targets_add_nothing_in_float8():
    h, w, targets = inputs()
    targets[:40] = IGNORE_INDEX
    _, grad_h, _ = loss_and_grads(h, w, targets, chunk=32, float8=Float8Projection())
    assert grad_h[:40].abs().max().item() == 0.0
    assert grad_h[40:].abs().max().item() > 0.0


def test_float8_is_for_training_only_evaluation_is_unchanged():
    h, w, targets = inputs()
    with torch.no_grad():
        plain = chunked_cross_entropy(h, w, targets, chunk_tokens=32)
        fp8 = fp8_loss(h, w, targets, chunk=32, float8=Float8Projection())
    assert torch.equal(plain, fp8)


@pytest.mark.parametrize("float8", [None, Float8Projection()], ids=["bf16-chunks", "float8"])
def test_a_frozen_output_weight_costs_no_weight_gradient(float8):
    # LoRA freezes the output weight: its V x D gradient would be computed, then dropped by autograd.
    h32, w32, targets = inputs()
    trained = loss_and_grads(h32, w32, targets, chunk=32, float8=float8)
    h, w = h32.clone().requires_grad_(), w32.clone()
    with CountOps() as ops:
        loss = fp8_loss(h, w, targets, chunk=32, float8=float8)
    (loss * 0.5).backward()
    assert torch.equal(loss.double(), trained[0]) and torch.equal(h.grad.double(), trained[1])
    chunks, matmul = 96 // 32, "mm" if float8 is None else "_scaled_mm"
    assert ops.counts[matmul] == 2 * chunks  # the logits and the gradient of h; none for the weight
    h.grad = None
    with CountOps() as ops:
        fp8_loss(h, w.requires_grad_(), targets, chunk=32, float8=float8)
    if float8 is None:  # fp32 here: a chunk's weight gradient is one matmul into the sum (addmm_)
        assert ops.counts["mm"] == 2 * chunks and ops.counts["addmm_"] == chunks
    else:
        slices = vocab_slices(w.shape[0], multiple=FLOAT8_ALIGNMENT)  # the weight's, a chunk
        assert ops.counts[matmul] == (2 + len(slices)) * chunks


def test_e4m3_cast_scales_to_the_largest_value_and_back():
    x = torch.tensor([[0.5, -2.0], [1e-3, 1.0]])
    x8, inverse = float8_e4m3(x)
    assert x8.dtype == torch.float8_e4m3fn
    assert x8.float().abs().max().item() == torch.finfo(torch.float8_e4m3fn).max  # amax maps to 448
    torch.testing.assert_close(x8.float() * inverse, x, rtol=7e-2, atol=1e-4)
    assert LOGIT_GRAD_SCALE <= torch.finfo(torch.float8_e5m2).max  # |softmax - one-hot| <= 1 stays finite


@pytest.mark.parametrize("override, error", [
    ("--model.dim=72", "train.float8_output=true needs model.dim in a multiple of 16 (FP8 matmuls), got 72: the next "
                       "is 80"),
    ("--data.seq_len=24", "train.float8_output=true needs data.seq_len in a multiple of 16 (FP8 matmuls), got 24: "
                          "the next is 32"),
    ("--train.loss_chunk_tokens=24",
     "train.float8_output=true needs train.loss_chunk_tokens in a multiple of 16 (FP8 matmuls), got 24: the next "
     "is 32"),
    ("--model.vocab_size=321",
     "train.float8_output=true needs model.vocab_size in a multiple of 16 (FP8 matmuls), got 321: the next is 336"),
    ("--model.type=hf", "train.float8_output=true is for our model (model.type: llama), not model.type: hf"),
])
def test_float8_output_sizes_are_checked_with_the_config(override, error):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_PRESET, ["--train.float8_output=true", "--data.seq_len=32", override])
    assert error in err.value.problems


def test_float8_output_vocabulary_of_a_tokenizer_trained_for_the_run_is_checked_with_the_config():
    # model.vocab_size 0 takes the tokenizer's vocabulary: a SentencePiece model trained to data.vocab_size pieces.
    with pytest.raises(ConfigError) as err:
        load_config(TINY_PRESET, ["--train.float8_output=true", "--model.vocab_size=0", "--data.vocab_size=321"])
    assert err.value.problems == [
        "train.float8_output=true needs data.vocab_size (the tokenizer's, which model.vocab_size 0 takes) in a "
        "multiple of 16 (FP8 matmuls), got 321: the next is 336"]
    # A model.vocab_size of its own holds the tokenizer's ids, whatever their count.
    load_config(TINY_PRESET, ["--train.float8_output=true", "--model.vocab_size=336", "--data.vocab_size=321"])


def test_float8_output_vocabulary_of_a_tokenizer_file_is_checked_before_the_process_group(tmp_path):
    """data.tokenizer_model's vocabulary (300 pieces) is known from its file: the launch's checks before any
    process group (and --check) read it, rather than the build after the data is prepared."""
    from config.launch import float8_output_vocabulary_problems
    from data.tokenizer import train_tokenizer
    from fsdp_utils.distributed import read_torchrun_env
    from fsdp_utils.train.launch_checks import launch_checks

    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of amber".split()
    lines = [" ".join(words[(i * 7 + k) % len(words)] for k in range(12)) + f" number {i}" for i in range(500)]
    train_tokenizer(lines, vocab_size=300, out_path=tmp_path / "sp.model")
    overrides = ["--train.float8_output=true", "--model.vocab_size=0",
                 f"--data.tokenizer_model={tmp_path / 'sp.model'}",
                 "--data.vocab_size=321", f"--run.output_dir={tmp_path / 'out'}", "--run.device=cpu"]
    cfg = load_config(TINY_PRESET, overrides)  # data.vocab_size is not the vocabulary here: the file's is
    line = (f"train.float8_output=true needs the vocabulary of data.tokenizer_model ({tmp_path / 'sp.model'}), which "
            "model.vocab_size 0 takes, in a multiple of 16 (FP8 matmuls), got 300: the next is 304")
    assert float8_output_vocabulary_problems(cfg) == [line]
    assert launch_checks(cfg, read_torchrun_env(), None, any_world=True) == [line]
    train_tokenizer(lines, vocab_size=304, out_path=tmp_path / "sp.model")
    assert float8_output_vocabulary_problems(cfg) == []


def test_float8_output_vocabulary_is_checked_at_the_build():
    from fsdp_utils.parallel.build import _float8_projection

    cfg = load_config(TINY_PRESET, ["--train.float8_output=true", "--model.vocab_size=0"])  # the tokenizer's
    cfg.model.vocab_size = 321  # what the tokenizer said
    with pytest.raises(ConfigError) as err:
        _float8_projection(cfg, None)
    assert err.value.problems == ["train.float8_output=true needs model.vocab_size (the tokenizer's) in a multiple of "
                                  "16 (FP8 matmuls), got 321: the next is 336"]
    cfg.model.vocab_size = 320
    assert isinstance(_float8_projection(cfg, None), Float8Projection)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 (compute capability 8.9+)")
def test_float8_loss_on_the_gpu_compiled_in_bf16_is_close_to_fp32():
    # cuBLAS's FP8 matmuls and the compiled cast and per-chunk loss, as training runs them (bf16 h and weight).
    from fsdp_utils.parallel.build import _float8_projection

    cfg = load_config(TINY_PRESET, ["--train.float8_output=true", "--train.compile=true", "--model.vocab_size=320"])
    h, w, targets = (t.cuda() for t in inputs(tokens=256, dim=64, vocab=320))
    projection = _float8_projection(cfg, None)
    want = loss_and_grads(h, w, targets, chunk=0, float8=None)
    got = loss_and_grads(h.bfloat16(), w.bfloat16(), targets, chunk=64, float8=projection)
    assert relative(got[0].cpu(), want[0].cpu()) < 1e-3
    assert relative(got[1].cpu(), want[1].cpu()) < 6e-2 and relative(got[2].cpu(), want[2].cpu()) < 6e-2
    h16, w16 = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")  # compiled by now: the loss never waits for the GPU (one sync a step)
    try:
        fp8_loss(h16, w16, targets, chunk=64, float8=projection).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_benchmark_float8_output_runs_ours_again_with_it():
    from benchmarks import benchmark

    args = benchmark.build_parser().parse_args([str(TINY_PRESET), "--float8_output"])
    cfg, variants, _ = benchmark.load_configs(args, ["--run.device=cpu"], recipes=[], grid=[])
    assert not cfg.train.float8_output and variants["ours_fp8_output"].train.float8_output
    assert ("ours_fp8_output", "ours") in benchmark.ratio_pairs(["ours", "ours_fp8_output"])


def test_benchmark_checks_the_float8_output_vocabulary_before_any_run():
    from benchmarks import benchmark

    args = benchmark.build_parser().parse_args([str(TINY_PRESET), "--float8_output"])
    with pytest.raises(ConfigError) as err:  # ours runs first: its minutes would be lost to the error at the build
        benchmark.load_configs(args, ["--run.device=cpu", "--data.vocab_size=321"], recipes=[], grid=[])
    # The config's own check (model.vocab_size 0 takes data.vocab_size) says it as ours is loaded.
    assert err.value.problems == [
        "train.float8_output=true needs data.vocab_size (the tokenizer's, which model.vocab_size 0 takes) in a "
        "multiple of 16 (FP8 matmuls), got 321: the next is 336"]


def test_float8_output_on_a_gpu_without_fp8_is_one_problem(monkeypatch):
    from fsdp_utils.parallel.float8 import float8_output_problems

    assert float8_output_problems(True, run_device="cpu", local_rank=0) == []  # emulated on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0) if device.index == 1 else (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"GPU{device.index}")
    assert float8_output_problems(False, run_device="cuda", local_rank=1) == []
    assert float8_output_problems(True, run_device="cuda", local_rank=0) == []
    assert float8_output_problems(True, run_device="auto", local_rank=1) == [
        "train.float8_output=true needs a GPU with FP8 support (compute capability 8.9 or later: Ada, Hopper); "
        "GPU1 has 8.0: set train.float8_output: false"]
