"""FP8 training (train.float8, fsdp_utils/float8.py).

Without torchao (CI): the config checks and the clear errors (no torchao, FSDP1, CPU, GPUs without FP8).
With torchao (skipped when it is not importable; locally `PYTHONPATH=/path/to/torchao python -m pytest
tests/test_float8.py`): the conversion, FP8 numerics against fp32, activation checkpointing, and real
2-rank gloo runs through the test-only fault "float8_on_cpu" (torch's CPU FP8 matmul): training,
checkpoints in both formats, resume bit for bit, resume with FP8 switched off and on, export_hf.
The CUDA cases (marked gpu) run the same code on GPUs.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from config import ConfigError, load_config
from fsdp_utils.parallel import float8
from fsdp_utils.parallel.float8 import float8_problems, hardware_problem, torchao_hint
from model import ModelConfig, Transformer
from model.transformer import DecoderBlock, rotary_tables
from tests.helpers import ROOT, job_env, losses, run_job, run_train

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (optional; FP8 only)")
TINY_CONFIG = ROOT / "config/train_tiny_fsdp.yaml"
CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


# ---- configuration and environment checks (no torchao needed) ----------------------------------------


def test_float8_is_off_by_default_and_takes_the_recipes():
    assert load_config(TINY_CONFIG).train.float8 == "none"
    for recipe in ("tensorwise", "rowwise"):
        assert load_config(TINY_CONFIG, [f"--train.float8={recipe}", "--fsdp.version=2"]).train.float8 == recipe


def test_float8_config_errors_name_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config(TINY_CONFIG, ["--train.float8=rowwize", "--fsdp.version=2"])
    assert err.value.problems == ["train.float8='rowwize' is not one of none, tensorwise, rowwise (did you mean "
                                  "'rowwise'?)"]
    with pytest.raises(ConfigError) as err:
        load_config(TINY_CONFIG, ["--train.float8=tensorwise", "--fsdp.version=1"])
    (line,) = err.value.problems
    assert line.startswith("train.float8=tensorwise needs fsdp.version: 2")


def test_hardware_check_with_fake_devices():
    # (8, 9) Ada and (9, 0) Hopper have FP8 tensor cores; (8, 0) A100 and (8, 6) Ampere do not.
    assert hardware_problem("tensorwise", device_type="cuda", capability=(9, 0), name="NVIDIA H100") is None
    assert hardware_problem("rowwise", device_type="cuda", capability=(8, 9), name="NVIDIA L4") is None
    assert hardware_problem("tensorwise", device_type="cuda", capability=(10, 0), name="NVIDIA B200") is None
    for capability in [(8, 0), (8, 6), (7, 0)]:
        problem = hardware_problem("tensorwise", device_type="cuda", capability=capability, name="NVIDIA A100")
        assert "NVIDIA A100 has " + ".".join(map(str, capability)) in problem and "8.9 or later" in problem
    assert "this run is on the CPU" in hardware_problem("rowwise", device_type="cpu", capability=None)


def test_torchao_hint_names_the_release_for_this_torch():
    assert "torchao==0.17.*" in torchao_hint("2.11.0+cu130") and "torch 2.11" in torchao_hint("2.11.0+cu130")
    other = torchao_hint("2.9.1")
    assert "torch 2.9" in other and "torchao 0.17.x for torch 2.11" in other


def test_environment_problems_without_torchao_or_fp8_hardware(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name,
                        *a: None if name == "torchao" else real_find_spec(name, *a))
    assert float8_problems("none", run_device="cpu", local_rank=0) == []
    no_torchao, on_cpu = float8_problems("tensorwise", run_device="cpu", local_rank=0)
    assert no_torchao.startswith("train.float8=tensorwise needs the torchao package, which is not installed: ")
    assert "this run is on the CPU" in on_cpu
    # A visible GPU of capability 8.0 on this rank (LOCAL_RANK 1): the check asks that device.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0) if device.index == 1 else (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"GPU{device.index}")
    problems = float8_problems("rowwise", run_device="auto", local_rank=1)
    assert len(problems) == 2 and "GPU1 has 8.0" in problems[1]
    assert float8_problems("rowwise", run_device="cuda", local_rank=0) == [no_torchao.replace("tensorwise", "rowwise")]


@pytest.mark.slow
def test_cli_float8_on_cpu_exits_2_before_the_process_group(tmp_path):
    # One error line per problem, exit 2, no process group (which would start gloo and write files).
    proc = run_job([str(ROOT / "train_fsdp.py"), str(TINY_CONFIG), "--train.float8=tensorwise", "--fsdp.version=2",
                    "--run.device=cpu", f"--run.output_dir={tmp_path / 'out'}"], env=job_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors[-1].startswith("error: train.float8=tensorwise needs an NVIDIA GPU with FP8 support")
    assert len(errors) == (1 if HAS_TORCHAO else 2) and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ---- conversion and numerics (torchao) ------------------------------------------------------------


def tiny_model(fused: bool = False, **overrides) -> Transformer:
    cfg = ModelConfig(**{**dict(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
                         **overrides})
    model = Transformer(cfg, fused_matmul=fused)  # build_model's default for FP8: not fused
    model.init_weights(seed=1)
    return model


@needs_torchao
def test_conversion_covers_exactly_the_block_linears():
    from torchao.float8.float8_linear import Float8Linear  # the type convert_to_float8_training swaps in

    # ffn_hidden_dim=80: w13 is 64 -> 2 x 80 and w2 80 -> 64 (multiples of 16: FP8); q is 64 wide, k and v 32.
    model = tiny_model(tie_embeddings=False, ffn_hidden_dim=80)
    assert float8.Float8Converter("tensorwise", float8_all_gather=False).convert(list(model.layers)) == 4 * 2
    fp8 = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert fp8 == {f"layers.{i}.{n}" for i in range(2)
                   for n in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")}
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding
    # The fused weights run one FP8 matmul per slice, as the bf16 model runs one per slice.
    layer = model.layers[0]
    assert (layer.attention.wqkv.output_slices, layer.feed_forward.w13.output_slices) == ((64, 32, 32), (80, 80))
    assert type(layer.attention.wo) is Float8Linear
    # A slice that is no multiple of 16 (gate and up of 72 each) keeps its layer in the compute precision;
    # built with fused_matmul (one matmul, split after) the whole 144-wide layer is one FP8 matmul.
    for fused, w13_fp8 in ((False, False), (True, True)):
        model = tiny_model(ffn_hidden_dim=72) if not fused else tiny_model(ffn_hidden_dim=72, fused=True)
        float8.Float8Converter("tensorwise", float8_all_gather=False).convert(list(model.layers))
        w13 = model.layers[0].feed_forward.w13
        assert isinstance(w13, Float8Linear) == w13_fp8 and getattr(w13, "output_slices", None) is None
        assert type(model.layers[0].feed_forward.w2) is nn.Linear  # 72 -> 64


@needs_torchao
def test_sliced_fp8_layers_give_the_fused_fp8_layers_results():
    """One FP8 matmul per slice of wqkv and w13 against one FP8 matmul per fused weight: the results differ
    only by each slice's own scales (of its weight here, without the FP8 all-gather, which casts the whole
    weight with one; of its output gradient in backward), by far less than FP8's error."""
    def run(fused: bool):
        model = tiny_model(fused=fused)
        float8.Float8Converter("tensorwise", float8_all_gather=False).convert(list(model.layers))
        tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    (loss_sliced, sliced), (loss_fused, fused) = run(False), run(True)
    assert torch.allclose(loss_sliced, loss_fused, rtol=1e-3) and not torch.equal(loss_sliced, loss_fused)
    for name, grad in sliced.items():
        assert ((grad - fused[name]).norm() / fused[name].norm()).item() < FP8_TOLERANCE, name
    assert any(not torch.equal(sliced[n], fused[n]) for n in sliced)  # the output gradients' own scales


def block_fwd_bwd(block: DecoderBlock, x: torch.Tensor, grad_out: torch.Tensor,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Forward and backward of one block in `dtype`: its two branch outputs (attention and feed-forward,
    before the residual adds, which would hide their error), the input's and every weight's gradient."""
    block = block.to(dtype)
    captured = {}
    for name in ("attention", "feed_forward"):
        getattr(block, name).register_forward_hook(
            lambda _m, _i, out, name=name: captured.__setitem__(name, out.detach()))
    x = x.detach().to(dtype).requires_grad_()
    cos, sin = (t.to(x.device, dtype) for t in rotary_tables(block.attention.head_dim, x.shape[1], 10000.0))
    block(x, cos, sin).backward(grad_out.to(dtype))
    got = {**captured, "input grad": x.grad, **{f"{n} grad": p.grad for n, p in block.named_parameters()}}
    return {k: v.double().cpu() for k, v in got.items()}


def relative_errors(device: str, recipe: str | None, dtype: torch.dtype) -> dict[str, float]:
    """Norm-wise relative error of each block_fwd_bwd result against fp32 without FP8."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=64)
    reference = Transformer(cfg)  # as build_model makes it for FP8
    reference.init_weights(seed=2)  # the model's own initialisation: std 0.02, residual projections smaller
    block = reference.layers[0].to(device)
    x, grad_out = torch.randn(4, 64, cfg.dim, device=device), torch.randn(4, 64, cfg.dim, device=device)
    want = block_fwd_bwd(copy.deepcopy(block), x, grad_out, torch.float32)
    candidate = copy.deepcopy(block)
    if recipe:
        float8.Float8Converter(recipe, float8_all_gather=False).convert([candidate])
    got = block_fwd_bwd(candidate, x, grad_out, dtype)
    return {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}


# Rounding to e4m3 (3 mantissa bits) has a relative RMS error of 2^-4 / sqrt(3) = 3.6%, to e5m2 (2 bits)
# 7.2%. A matmul of two rounded operands errs by about their quadrature sum: 5.1% for e4m3 x e4m3 (every
# forward matmul; rowwise's gradients too) and 8.1% for e5m2 x e4m3 (tensorwise's gradients, whose
# grad_output is e5m2). Measured on this block (CPU, fp32 and bf16 compute): branch outputs 5.3-6.5%,
# weight gradients 7-9% (tensorwise) and 5-6.6% (rowwise), the input's gradient 0.3% (the residual
# path carries most of it); bf16 alone 0.7% at most. Bound: 15% for every result, and each FP8
# matmul's weight gradient must err by more than 2%, or FP8 did not run (a bypassed FP8 module leaves
# the plain dtype's error).
FP8_TOLERANCE, FP8_FLOOR = 0.15, 0.02
FP8_WEIGHT_GRADS = ("attention.wqkv.weight grad", "attention.wo.weight grad", "feed_forward.w13.weight grad",
                    "feed_forward.w2.weight grad")


@pytest.mark.parametrize("device, dtype", [
    pytest.param("cpu", torch.float32, id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not CUDA_FP8, reason="needs a GPU of compute capability 8.9+")]),
])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@needs_torchao
def test_fp8_block_matches_fp32_within_fp8_tolerance(device, dtype, recipe):
    errors = relative_errors(device, recipe, dtype)
    assert max(errors.values()) < FP8_TOLERANCE, errors
    assert min(errors[k] for k in FP8_WEIGHT_GRADS) > FP8_FLOOR, errors
    # For scale: the same block in plain `dtype` errs by far less (fp32: 0; bf16: about 1%).
    plain = relative_errors(device, None, dtype)
    assert max(plain.values()) < (1e-6 if dtype == torch.float32 else 0.02), plain


@needs_torchao
def test_the_op_level_policies_keep_or_recompute_the_fp8_matmuls_of_their_roles():
    from fsdp_utils.parallel.parallelize import apply_activation_checkpointing
    from tests.helpers import CountOps

    def backward(mode: str):
        model = tiny_model()
        float8.Float8Converter("tensorwise", float8_all_gather=False).convert(list(model.layers))
        apply_activation_checkpointing(list(model.layers), mode, every_n=1)
        tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        with CountOps() as counter:
            loss.backward()
        return counter.counts, counter.mm_widths, [p.grad for p in model.parameters()]

    modes = ("none", "selective_op_wide", "full", "selective_op", "selective_op_lean")
    runs = [backward(m) for m in modes]
    (none, none_widths, _), (wide, _, _), (full, _, _), (by_op, by_op_widths, _), (lean, lean_widths, _) = runs
    # In eager mode an FP8 matmul is an `mm` on torchao's FP8 tensors (compile traces it down to
    # `_scaled_mm`, see the compiled test below). Backward runs 2 per FP8 matmul (input and weight
    # gradients), 7 matmuls per block (q, k, v, o, gate, up, down: one per slice of wqkv and w13), plus 2
    # for the output projection.
    assert none["mm"] == 2 * 7 * 2 + 2
    # full reruns the forward of every FP8 matmul (its autograd function runs whole); selective_op_wide
    # kept those outputs, so it runs none again...
    assert full["mm"] == none["mm"] + 7 * 2
    assert wide["mm"] == none["mm"]
    # ...but it does recompute the elementwise work (norms, casts), except the FP8 scales' amax (kept).
    assert wide["rsqrt"] > none["rsqrt"] and wide["abs"] > none["abs"] and wide["max"] == none["max"] < full["max"]
    # selective_op reruns the k, output and up projections of each block, selective_op_lean the output, gate
    # and up projections: told apart by their outputs' widths (k 32, o 64, gate and up the hidden width).
    assert by_op["mm"] == lean["mm"] == none["mm"] + 3 * 2
    hidden = tiny_model().cfg.hidden_dim
    assert by_op_widths - none_widths == collections.Counter({32: 2, 64: 2, hidden: 2}), by_op_widths - none_widths
    assert lean_widths - none_widths == collections.Counter({64: 2, hidden: 4}), lean_widths - none_widths
    for _, _, grads in runs[1:]:
        # Recomputed FP8 casts see the same inputs and amax: the same gradients, bit for bit.
        assert all(torch.equal(g, g_none) for g, g_none in zip(grads, runs[0][2], strict=True))


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_inputs_are_cast_once_for_forward_and_backward(recipe):
    from tests.helpers import CountOps

    def run(cast_once: bool):
        model = tiny_model()
        float8.Float8Converter(recipe, float8_all_gather=False).convert(list(model.layers))
        hooks = [(m, k) for m in model.modules() for k, h in m._forward_pre_hooks.items()
                 if isinstance(h, float8.CastInputOnce)]
        if not cast_once:
            for module, key in hooks:
                del module._forward_pre_hooks[key]
        tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        with CountOps() as counter:
            loss.backward()
        return len(hooks), loss, counter.counts, [p.grad for p in model.parameters()]

    hooked, loss_once, once, grads_once = run(True)
    if recipe == "rowwise":  # rowwise scales the input along another axis for the weight gradient: no hook
        assert hooked == 0
        return
    assert hooked == 4 * 2  # every FP8 linear of the 2 blocks
    _, loss_torchao, torchao, grads_torchao = run(False)
    # Backward reduces only the gradients' maxima: torchao alone also reduces each matmul's saved input
    # again (7 FP8 matmuls a block: wqkv and w13 run one per slice).
    assert torchao["max"] - once["max"] == 7 * 2, (once["max"], torchao["max"])
    # The same scales, so the same bits as torchao's own casts.
    assert loss_once.item() == loss_torchao.item()
    for a, b in zip(grads_once, grads_torchao, strict=True):
        assert torch.equal(a, b)


@needs_torchao
def test_compiled_fp8_block_keeps_checkpointing_and_its_fp8_matmul_outputs():
    from tests.test_wrap import compiled_block_saves

    def convert(block):
        float8.Float8Converter("tensorwise", float8_all_gather=False).convert([block])

    unit = 2 * 64 * 64 * 4  # one (B, T, D) fp32 activation, as in tests/test_wrap.py
    modes = ("none", "selective_op_wide", "selective_op", "selective_op_lean")
    (none, ops_none), (wide, ops_wide), (by_op, _), (lean, _) = (compiled_block_saves(m, convert) for m in modes)
    # One graph per block (the FP8 autograd functions traced, no graph break), checkpointed as a region.
    assert len(ops_none) > 40 and "tag_activation_checkpoint" in ops_wide
    # selective_op_wide keeps the FP8 matmul outputs (q, k, v 1 unit each, attention output 1, gate and up 3
    # each, down 1) and attention's: measured 14.3 units against 14.6 without checkpointing, where the
    # partitioner already keeps FP8 copies (a quarter unit each) in place of several fp32 activations. Had the
    # policy missed the FP8 matmuls, they would be recomputed and 2.3 units kept (measured).
    assert 8 * unit < wide <= none, (none / unit, wide / unit)
    # selective_op recomputes the k, output and up projections instead of keeping their outputs (5 units;
    # measured 6.0), selective_op_lean the output, gate and up projections (7; measured 9.0).
    assert wide - by_op >= 5 * unit and by_op - lean >= 2 * unit, (wide / unit, by_op / unit, lean / unit)


# ---- real runs: 2 ranks, FSDP2 with FP8 all-gather, checkpoints (torchao) ------------------------------

FSDP2 = ["--fsdp.version=2", "--train.max_steps=6", "--checkpoint.interval=3"]
ALLOW_CPU = {"float8_on_cpu": True}  # the test-only fault: torch's CPU FP8 matmul (tests/fault_injection.py)
# The production path: per-block compile (inductor; about 35 s a run on the CPU) and selective_op
# checkpointing. On GPUs one case, in bf16, with the fastest recipe and the GPU presets' checkpoint format.
COMPILED = ["--train.compile=true", "--fsdp.activation_checkpointing=selective_op"]
GPU_ARGS = ["--run.device=cuda", "--train.precision=bf16", *COMPILED]
RESUME_CASES = [
    pytest.param("tensorwise", "sharded", [], id="cpu-tensorwise-sharded"),
    pytest.param("tensorwise", "full", COMPILED, id="cpu-tensorwise-full-compiled"),
    pytest.param("rowwise", "sharded", [], id="cpu-rowwise-sharded"),
    pytest.param("tensorwise", "sharded", GPU_ARGS, id="cuda-tensorwise-sharded", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not CUDA_FP8 or torch.cuda.device_count() < 2,
                                            reason="needs 2 GPUs with FP8")]),
]


def checkpoint_path(run_dir: Path, fmt: str, step: int) -> Path:
    return run_dir / (f"fsdp_cpt{step}.pth" if fmt == "full" else f"fsdp_sharded_cpt{step}")


@pytest.mark.slow
@needs_torchao
@pytest.mark.parametrize("recipe, fmt, device_args", RESUME_CASES)
def test_fp8_run_resumes_bit_for_bit_and_in_full_precision(tmp_path, corpus, dataset_dir, recipe, fmt, device_args):
    kw = dict(nproc=2, corpus=corpus, dataset_dir=dataset_dir, faults=ALLOW_CPU)
    args = [*FSDP2, *device_args, f"--checkpoint.format={fmt}"]
    run_train(*args, f"--train.float8={recipe}", out_dir=tmp_path / "fp8", **kw)
    saved = checkpoint_path(tmp_path / "fp8", fmt, 3)
    run_train(*args, f"--train.float8={recipe}", f"--resume_from={saved}", out_dir=tmp_path / "again", **kw)
    # Without FP8 (and without compile, to save time): the same weights, full-precision matmuls.
    plain_args = [a for a in args if a != "--train.compile=true"]
    run_train(*plain_args, f"--resume_from={saved}", out_dir=tmp_path / "plain", **kw)
    fp8, again, plain = losses(tmp_path / "fp8"), losses(tmp_path / "again"), losses(tmp_path / "plain")
    assert sorted(fp8) == list(range(1, 7)) and sorted(again) == sorted(plain) == [4, 5, 6]
    assert fp8[6] < 0.8 * fp8[1], fp8  # it trains (gradient accumulation: 2 micro-batches per step)
    # Resumed with FP8: the same run, bit for bit (weights, optimizer state, data position, RNG).
    assert [again[s] for s in (4, 5, 6)] == [fp8[s] for s in (4, 5, 6)]
    # Resumed without FP8: step 4's loss is the trained model's (step 1's was 5.76; a model that lost its
    # weights would be back there) up to FP8's effect on a loss, 4e-5 relative measured on the CPU.
    assert math.isclose(plain[4], fp8[4], rel_tol=2e-2 if "--run.device=cuda" in device_args else 1e-3), (plain, fp8)
    if fmt == "full":
        # Plain tensors only, model and optimizer: the file loads without torchao's classes.
        payload = torch.load(saved, map_location="cpu", weights_only=True)
        tensors = [v for v in payload["model"].values()] + \
            [v for state in payload["optimizer"]["state"].values() for v in state.values()
             if isinstance(v, torch.Tensor)]
        assert tensors and {type(t) for t in tensors} == {torch.Tensor}


@pytest.mark.slow
@needs_torchao
def test_full_precision_checkpoint_resumes_with_fp8(tmp_path, corpus, dataset_dir):
    kw = dict(nproc=2, corpus=corpus, dataset_dir=dataset_dir, faults=ALLOW_CPU)
    args = [*FSDP2, "--train.max_steps=4", "--checkpoint.format=sharded"]
    run_train(*args, out_dir=tmp_path / "plain", **kw)
    run_train(*args, "--train.float8=tensorwise", f"--resume_from={tmp_path / 'plain/fsdp_sharded_cpt3'}",
              out_dir=tmp_path / "fp8", **kw)
    plain, fp8 = losses(tmp_path / "plain"), losses(tmp_path / "fp8")
    assert sorted(fp8) == [4]
    assert math.isclose(fp8[4], plain[4], rel_tol=1e-3) and fp8[4] != plain[4], (plain, fp8)


@pytest.mark.slow
@needs_torchao
def test_export_hf_of_an_fp8_checkpoint_gives_our_logits(tmp_path, corpus, dataset_dir):
    pytest.importorskip("transformers")
    from fsdp_utils.checkpoint.io import load_model
    from scripts import export_hf
    from tests.test_export_hf import assert_same_logits

    run_train("--fsdp.version=2", "--train.float8=tensorwise", "--train.max_steps=2", nproc=1, out_dir=tmp_path / "fp8",
              corpus=corpus, dataset_dir=dataset_dir, faults=ALLOW_CPU)
    checkpoint = tmp_path / "fp8/fsdp_cpt2.pth"
    assert export_hf.main([str(checkpoint), str(tmp_path / "hf")]) == 0
    ours, _ = load_model(checkpoint)
    assert_same_logits(ours, tmp_path / "hf")


def fp8_all_gather_model(grad_accum: int = 2):
    """A tiny model with FP8 all-gather weights, FSDP2 on a 1-rank gloo mesh (the process group must be up),
    and its AdamW with the FP8 post-step work registered, for steps of `grad_accum` micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_model()
    converter = float8.Float8Converter("tensorwise", float8_all_gather=True)
    converter.convert(list(model.layers))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    converter.register(model, optimizer)
    converter.use_accumulation(model, grad_accum)
    return model, optimizer


def fp8_weights(model: nn.Module) -> list:
    from torchao.float8.float8_linear import Float8Linear

    return [m.weight for m in model.modules() if isinstance(m, Float8Linear)]


@needs_torchao
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_fp8_all_gather_weights_survive_a_checkpoint_load(tmp_path, fmt):
    # Loading must copy into the parameters, not replace them by plain tensors: that would silently turn
    # FP8 all-gather off (the matmuls would still be FP8, so nothing else would notice).
    import torch.distributed as dist

    from config import CheckpointConfig
    from fsdp_utils.checkpoint import CheckpointManager, Contents, TrainState
    from fsdp_utils.distributed import DistEnv

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, optimizer = fp8_all_gather_model()
        tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        weight = model.layers[0].attention.wqkv.weight
        kind, saved = type(weight.to_local()), weight.full_tensor().clone()
        assert kind.__module__.startswith("torchao")
        env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
        manager = CheckpointManager(CheckpointConfig(format=fmt, keep_last_n=0), tmp_path,
                                    contents=Contents(model, optimizer, TrainState(step=1)),
                                    model_config=dataclasses.asdict(model.cfg), env=env)
        manager.save()
        with torch.no_grad():
            weight.zero_()
        manager.load("latest")
        after = model.layers[0].attention.wqkv.weight
        assert after is weight and type(after.to_local()) is kind
        assert torch.equal(after.full_tensor(), saved)
    finally:
        dist.destroy_process_group()


@needs_torchao
def test_fp8_shards_are_cast_once_per_step_with_several_micro_batches_bit_for_bit_and_never_stale():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
        cached, cached_opt = fp8_all_gather_model(grad_accum=2)
        plain, plain_opt = fp8_all_gather_model(grad_accum=1)  # one micro-batch a step: cast at every all-gather
        torchao_casts = 0

        def counted(cast):
            def cast_and_count(mesh):
                nonlocal torchao_casts
                torchao_casts += 1
                return cast(mesh)
            return cast_and_count

        for step in range(3):
            torchao_casts = 0
            loss = cached(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            cached_opt.step()  # its hook casts each shard once, through torchao_cast
            cached_opt.zero_grad()
            reference = plain(tokens[:, :-1], tokens[:, 1:])
            reference.backward()
            plain_opt.step()
            plain_opt.zero_grad()
            assert not any("fsdp_pre_all_gather" in w._local_tensor.__dict__ for w in fp8_weights(plain))
            assert loss.item() == reference.item(), (step, loss.item(), reference.item())
            stand_ins = [w._local_tensor.fsdp_pre_all_gather for w in fp8_weights(cached)]
            assert len(stand_ins) == 4 * 2 and all(type(s) is float8.CastOncePerStep for s in stand_ins)
            # From step 2 on, the step's all-gathers (forward and backward) sent the casts its hook made.
            assert torchao_casts == (0 if step == 0 else len(stand_ins)), (step, torchao_casts)
            if step == 0:
                for s in stand_ins:
                    s.torchao_cast = counted(s.torchao_cast)
        for a, b in zip(cached.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a.full_tensor(), b.full_tensor())

        # Changed in place without a refresh, through the DTensor or the local shard: cast anew, never stale.
        weight = cached.layers[0].attention.wqkv.weight
        stand_in, mesh = weight._local_tensor.fsdp_pre_all_gather, weight.device_mesh
        (data,), (scale,) = stand_in(mesh)
        assert stand_in(mesh)[0][0] is data
        with torch.no_grad():
            weight.neg_()  # the same maximum, so the same scale: the FP8 values flip sign exactly
        (flipped,), (same_scale,) = stand_in(mesh)
        assert torch.equal(flipped.float(), -data.float()) and torch.equal(same_scale, scale)
        stand_in.refresh()
        with torch.no_grad():
            weight._local_tensor.copy_(torch.zeros_like(weight._local_tensor))
        assert not stand_in(mesh)[0][0].float().any()

        # A run found to take one micro-batch a step after its search's trial steps: the kept casts are freed.
        float8.uncast_float8_shards(cached)
        assert not any("fsdp_pre_all_gather" in w._local_tensor.__dict__ for w in fp8_weights(cached))
    finally:
        dist.destroy_process_group()
