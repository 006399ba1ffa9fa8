"""Activation checkpointing modes: the same gradients, and each recomputes what it promises."""
from __future__ import annotations

import collections

import pytest
import torch

from fsdp_utils.parallel.parallelize import (
    CheckpointPolicy,
    CheckpointSwitch,
    apply_activation_checkpointing,
    apply_switchable_checkpointing,
)
from model import ModelConfig, Transformer
from tests.helpers import CountOps

CFG = ModelConfig(vocab_size=97, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16)


def backward_ops(mode: str) -> tuple[collections.Counter, list[torch.Tensor], float]:
    """Ops run during backward and the resulting gradients, for a model under AC `mode`."""
    torch.manual_seed(0)
    model = Transformer(CFG)
    model.init_weights(seed=3)
    count = apply_activation_checkpointing(list(model.layers), mode, every_n=2)
    assert count == {"none": 0, "full": 4, "selective": 2, "selective_op": 4, "selective_op_lean": 4}[mode]
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    with CountOps() as counter:
        loss.backward()
    return counter.counts, [p.grad.clone() for p in model.parameters()], loss.item()


@pytest.mark.parametrize("mode", ["full", "selective", "selective_op", "selective_op_lean"])
def test_checkpointing_keeps_loss_and_gradients(mode):
    _, grads_ref, loss_ref = backward_ops("none")
    _, grads, loss = backward_ops(mode)
    assert loss == loss_ref
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-7)


def test_each_mode_recomputes_what_it_promises():
    none, _, _ = backward_ops("none")
    full, _, _ = backward_ops("full")
    selective, _, _ = backward_ops("selective")
    by_op, _, _ = backward_ops("selective_op")
    lean, _, _ = backward_ops("selective_op_lean")
    # Each block has 7 matmuls (q, k, v, output, gate, up, down); full recomputes the first six (the
    # down projection's output is not needed, so recomputation stops before it), selective does so in
    # half the blocks, selective_op in none: it kept their outputs.
    assert full["mm"] - none["mm"] == 6 * CFG.n_layers
    assert selective["mm"] - none["mm"] == 6 * CFG.n_layers // 2
    assert by_op["mm"] == none["mm"]
    # ...but it does recompute the elementwise work: the RMSNorms (rsqrt) and the SwiGLU activation.
    assert by_op["rsqrt"] >= none["rsqrt"] + 2 * CFG.n_layers
    assert by_op["silu"] >= none["silu"] + CFG.n_layers
    assert by_op["_scaled_dot_product_flash_attention_for_cpu"] == none["_scaled_dot_product_flash_attention_for_cpu"]
    # selective_op_lean recomputes the gate and up matmuls as well, and nothing else of selective_op's.
    assert lean["mm"] == none["mm"] + 2 * CFG.n_layers
    assert lean["_scaled_dot_product_flash_attention_for_cpu"] == by_op["_scaled_dot_product_flash_attention_for_cpu"]


def test_a_switchable_model_recomputes_and_computes_as_the_policy_it_is_set_to():
    # fsdp.activation_checkpointing=auto: one model, its policy changed between steps by the search.
    torch.manual_seed(0)
    model = Transformer(CFG)
    model.init_weights(seed=3)
    switch = CheckpointSwitch()
    apply_switchable_checkpointing(list(model.layers), switch)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for mode in ("full", "none", "selective_op", "selective", "selective_op_lean"):
        switch.policy = CheckpointPolicy(mode, every_n=2)
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        with CountOps() as counter:
            loss.backward()
        ops, grads, loss_ref = backward_ops(mode)  # the same model with the policy applied for good
        assert loss.item() == loss_ref
        assert {k: counter.counts[k] for k in ("mm", "rsqrt", "silu")} == {k: ops[k] for k in ("mm", "rsqrt", "silu")}
        for p, g_ref in zip(model.parameters(), grads, strict=True):
            torch.testing.assert_close(p.grad, g_ref, rtol=0, atol=0)


def test_policy_names_read_back():
    for policy in (CheckpointPolicy("none"), CheckpointPolicy("full"), CheckpointPolicy("selective_op"),
                   CheckpointPolicy("selective_op_lean"), CheckpointPolicy("selective", 3)):
        assert CheckpointPolicy.parse(policy.name) == policy
    assert CheckpointPolicy("selective", 2).name == "selective/2"
    for bad in ("selective", "full/2", "selective/0", "selective/x", "selective_op/2", "auto", "", None):
        with pytest.raises((ValueError, AttributeError)):
            CheckpointPolicy.parse(bad)


def compiled_block_saves(mode: str, convert=None, switchable: bool = False) -> tuple[int, list[str]]:
    """Compile one block under AC `mode` as train_fsdp.py does (`convert(block)` first, if given, as
    parallelize converts to FP8); return the activation bytes the compiled forward keeps for backward
    (compile's partitioner decides, as on GPUs) and the ops of the traced graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from model.transformer import DecoderBlock, rotary_tables

    saved, ops = [], []

    def partition(joint, inputs, **kwargs):
        forward, backward = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        for node in backward.graph.nodes:  # the backward's non-gradient inputs are the saved tensors
            value = node.meta.get("val")
            if node.op == "placeholder" and not node.name.startswith("tangents") and isinstance(value, torch.Tensor):
                saved.append(value.numel() * value.element_size())
        return forward, backward

    def record_ops(gm, _inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)(gm, _inputs)

    torch._dynamo.reset()
    cfg = ModelConfig(vocab_size=97, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, max_seq_len=64)
    block = DecoderBlock(cfg, fused_matmul=convert is not None)  # as build_model makes it for FP8
    if convert is not None:
        convert(block)
    if switchable:
        apply_switchable_checkpointing([block], CheckpointSwitch(CheckpointPolicy(mode)))
    else:
        apply_activation_checkpointing([block], mode, every_n=1)
    block.compile(backend=record_ops, dynamic=False)
    cos, sin = rotary_tables(cfg.head_dim, 64, cfg.rope_theta)
    block(torch.randn(2, 64, 64, requires_grad=True), cos, sin).sum().backward()
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    return sum(saved) - weights, ops


def boxed(gm, _inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


@pytest.mark.slow
def test_compiled_blocks_keep_checkpointing_and_selective_op_saves_less():
    unit = 2 * 64 * 64 * 4  # one (B, T, D) fp32 activation
    modes = ("none", "selective_op", "full")
    (none, ops_none), (by_op, ops_by_op), (full, ops_full) = (compiled_block_saves(m) for m in modes)
    # The checkpointed block is compiled (once it silently ran uncompiled), as one checkpointed region.
    assert "tag_activation_checkpoint" not in ops_none and len(ops_none) > 10
    assert "tag_activation_checkpoint" in ops_by_op and "tag_activation_checkpoint" in ops_full
    # Without AC the block keeps about 21 units here (hidden 4 x dim): x, norm outputs, q, k, v,
    # attention out, residual, gate/up, SwiGLU product. selective_op drops the elementwise results
    # (norm outputs, rotated q/k, SwiGLU product); full keeps little beyond the block's input.
    assert none / unit > 18
    assert by_op / unit < none / unit - 5
    assert full / unit < 3
    # A switchable block (fsdp.activation_checkpointing=auto) compiles to the same region and savings.
    assert compiled_block_saves("selective_op", switchable=True)[0] == by_op
    # selective_op_lean drops the gate and up outputs too (hidden 4 x dim: 8 units), here and switchable.
    lean = compiled_block_saves("selective_op_lean")[0]
    assert by_op - lean >= 7.5 * unit and lean > full
    assert compiled_block_saves("selective_op_lean", switchable=True)[0] == lean


def test_selective_op_lean_needs_a_feed_forward_it_knows():
    class Bare(torch.nn.Module):  # a block with no feed-forward gate/up projection
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="selective_op_lean: Bare has no feed-forward"):
        apply_activation_checkpointing([Bare()], "selective_op_lean", every_n=1)
    switch = CheckpointSwitch()
    apply_switchable_checkpointing([Bare()], switch)
    assert not switch.lean  # auto then leaves selective_op_lean out of its candidates
    model = Transformer(CFG)
    apply_switchable_checkpointing(list(model.layers), switch)
    assert switch.lean
    from fsdp_utils.train.microbatch import auto_policies

    assert [p.name for p in auto_policies(3, lean=False)] == ["none", "selective_op", "selective/3", "full"]
    assert [p.name for p in auto_policies(1)] == ["none", "selective_op", "selective_op_lean", "selective/2", "full"]


@pytest.mark.slow  # builds and shards the model three times
def test_compile_tuning_needs_compile_and_reaches_every_compiled_function(monkeypatch):
    from config import ConfigError, load_config
    from fsdp_utils.parallel.build import build_model
    from fsdp_utils.parallel.parallelize import compile_options, parallelize, resolve_precision
    from tests.helpers import ROOT, world_of_one

    tiny = ROOT / "config/train_tiny_fsdp.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(tiny, ["--train.compile=false", "--train.compile_tuning=true"])
    assert err.value.problems == ["train.compile_tuning=true tunes the compiled kernels and needs train.compile: true"]

    options = []  # what each torch.compile call of a run is given
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: options.append(kw.get("options")) or real_compile(fn, **kw))
    with world_of_one() as env:
        for tuning, version in ((True, 2), (False, 2), (True, 1)):
            options.clear()
            cfg = load_config(tiny, ["--train.compile=true", f"--train.compile_tuning={str(tuning).lower()}",
                                     "--model.vocab_size=96", f"--fsdp.version={version}"])
            built = build_model(cfg, env, eos_id=0)  # the chunked loss's function
            parallelize(built.module, block_classes=built.block_classes, fsdp=cfg.fsdp, env=env, init=built.init,
                        precision=resolve_precision(cfg.train.precision, cfg.fsdp.reduce_dtype, env.device),
                        compile=cfg.train.compile, compile_tuning=cfg.train.compile_tuning)  # each block
            assert options == [compile_options(tuning)] * (1 + cfg.model.n_layers), (tuning, version, options)
    assert compile_options(True) == {"coordinate_descent_tuning": True} and compile_options(False) is None
