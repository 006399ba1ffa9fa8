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
    assert count == {"none": 0, "full": 4, "selective": 2}.get(mode, 4)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    with CountOps() as counter:
        loss.backward()
    return counter.counts, [p.grad.clone() for p in model.parameters()], loss.item()


@pytest.mark.parametrize("mode", ["full", "selective", "selective_op_wide", "selective_op", "selective_op_lean"])
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
    wide, _, _ = backward_ops("selective_op_wide")
    by_op, _, _ = backward_ops("selective_op")
    lean, _, _ = backward_ops("selective_op_lean")
    # Each block has 7 matmuls (q, k, v, output, gate, up, down); full recomputes the first six (the
    # down projection's output is not needed, so recomputation stops before it), selective does so in
    # half the blocks, selective_op_wide in none: it kept their outputs.
    assert full["mm"] - none["mm"] == 6 * CFG.n_layers
    assert selective["mm"] - none["mm"] == 6 * CFG.n_layers // 2
    assert wide["mm"] == none["mm"]
    # ...but it does recompute the elementwise work: the RMSNorms (rsqrt) and the SwiGLU activation.
    assert wide["rsqrt"] >= none["rsqrt"] + 2 * CFG.n_layers
    assert wide["silu"] >= none["silu"] + CFG.n_layers
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert wide[attention] == by_op[attention] == lean[attention] == none[attention]
    # selective_op recomputes three matmuls a block (k, output and up projections), selective_op_lean three (output,
    # gate and up).
    assert by_op["mm"] == none["mm"] + 3 * CFG.n_layers
    assert lean["mm"] == none["mm"] + 3 * CFG.n_layers


def weight_matmuls(mode: str, fused: bool) -> collections.Counter:
    """How often one block's backward multiplies by each weight (its parameter's name, and the offset of the slice:
    q/k/v of wqkv, gate/up of w13) under AC `mode`: once for the input gradient, once more where it reruns the
    forward's matmul."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from model.transformer import DecoderBlock, rotary_tables

    torch.manual_seed(0)
    block = DecoderBlock(CFG, fused_matmul=fused)
    apply_activation_checkpointing([block], mode, every_n=1)
    names = {p.untyped_storage().data_ptr(): name.split(".")[-2] for name, p in block.named_parameters()}
    seen = collections.Counter()

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            weight = args[1] if func is torch.ops.aten.mm.default else None
            if weight is not None and weight.untyped_storage().data_ptr() in names:
                seen[names[weight.untyped_storage().data_ptr()], weight.storage_offset()] += 1
            return func(*args, **(kwargs or {}))

    cos, sin = (t[:8] for t in rotary_tables(CFG.head_dim, 16, CFG.rope_theta))
    out = block(torch.randn(1, 8, CFG.dim, requires_grad=True), cos, sin)
    with Matmuls():
        out.sum().backward()
    return seen


@pytest.mark.parametrize("fused", [False, True])
def test_the_op_level_policies_recompute_the_matmuls_of_their_roles(fused):
    # q and the output projection have square weights of the same shape here (dim 32, 4 heads of 8): the policy
    # tells them apart by their order in the forward, and recomputes o, never q.
    q_size, hidden = CFG.dim, CFG.hidden_dim
    o, up, k = ("wo", 0), ("w13", hidden * CFG.dim), ("wqkv", q_size * CFG.dim)
    gate_up = gate = ("w13", 0)
    expected = {"selective_op_wide": set(), "selective_op": {gate_up} if fused else {k, o, up},
                "selective_op_lean": {o, gate_up} if fused else {o, gate, up}}
    plain = weight_matmuls("none", fused)
    assert ("wqkv", 0) in plain and ("wqkv", q_size * CFG.dim) in plain or fused
    for mode, recomputed in expected.items():
        assert set(weight_matmuls(mode, fused) - plain) == recomputed, mode


def test_a_switchable_model_recomputes_and_computes_as_the_policy_it_is_set_to():
    # fsdp.activation_checkpointing=auto: one model, its policy changed between steps by the search.
    torch.manual_seed(0)
    model = Transformer(CFG)
    model.init_weights(seed=3)
    switch = CheckpointSwitch()
    apply_switchable_checkpointing(list(model.layers), switch)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for mode in ("full", "none", "selective_op", "selective", "selective_op_lean", "selective_op_wide"):
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
                   CheckpointPolicy("selective_op_wide"),
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

    from model.transformer import DecoderBlock, rotary_tables

    saved: list[list[torch.Tensor]] = []
    ops: list[str] = []

    def record_ops(gm, _inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed, partition_fn=recording_partition(saved))(gm, _inputs)

    torch._dynamo.reset()
    cfg = ModelConfig(vocab_size=97, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, max_seq_len=64)
    block = DecoderBlock(cfg)  # as build_model makes it, for FP8 too
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
    return sum(v.numel() * v.element_size() for graph in saved for v in graph) - weights, ops


def recording_partition(saved: list[list[torch.Tensor]]):
    """aot_autograd's partition_fn: compile's own min-cut partition, which appends to `saved` what each compiled
    forward keeps for backward (the backward graph's inputs that are not gradients)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, inputs, **kwargs):
        forward, backward = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        saved.append([node.meta["val"] for node in backward.graph.nodes if node.op == "placeholder"
                      and not node.name.startswith("tangents") and isinstance(node.meta.get("val"), torch.Tensor)])
        return forward, backward

    return partition


def boxed(gm, _inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


@pytest.mark.slow
def test_compiled_blocks_keep_checkpointing_and_each_op_level_policy_saves_what_it_promises():
    unit = 2 * 64 * 64 * 4  # one (B, T, D) fp32 activation
    modes = ("none", "selective_op_wide", "full")
    (none, ops_none), (wide, ops_wide), (full, ops_full) = (compiled_block_saves(m) for m in modes)
    # The checkpointed block is compiled (once it silently ran uncompiled), as one checkpointed region.
    assert "tag_activation_checkpoint" not in ops_none and len(ops_none) > 10
    assert "tag_activation_checkpoint" in ops_wide and "tag_activation_checkpoint" in ops_full
    # Without AC the block keeps about 21 units here (hidden 4 x dim): x, norm outputs, q, k, v,
    # attention out, residual, gate/up, SwiGLU product. selective_op_wide drops the elementwise results
    # (norm outputs, rotated q/k, SwiGLU product); full keeps little beyond the block's input.
    assert none / unit > 18
    assert wide / unit < none / unit - 5
    assert full / unit < 3
    # selective_op drops the k (1 unit), output (1) and up projections' (4) outputs, selective_op_lean the output,
    # gate (4) and up projections'; a switchable block (fsdp.activation_checkpointing=auto) compiles to the same.
    by_op, lean = compiled_block_saves("selective_op")[0], compiled_block_saves("selective_op_lean")[0]
    assert wide - by_op == 6 * unit and by_op - lean == 3 * unit and lean > full
    for mode, saved in (("selective_op_wide", wide), ("selective_op", by_op), ("selective_op_lean", lean)):
        assert compiled_block_saves(mode, switchable=True)[0] == saved


@pytest.mark.slow
def test_a_compiled_switchable_block_compiles_each_policy_once_and_runs_the_one_set():
    # The micro-batch search switches policy without dropping compiled graphs: the blocks must guard on the
    # switch (a graph compiled for another policy would run its checkpointing silently) and reuse a policy's
    # graphs when it is set again. Each compile records what its forward keeps for backward.
    from torch._dynamo.backends.common import aot_autograd

    from model.transformer import DecoderBlock, rotary_tables

    saved: list[list[torch.Tensor]] = []

    torch._dynamo.reset()
    cfg = ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=64)
    blocks = [DecoderBlock(cfg) for _ in range(cfg.n_layers)]
    switch = CheckpointSwitch()
    apply_switchable_checkpointing(blocks, switch)
    for block in blocks:
        block.compile(backend=aot_autograd(fw_compiler=boxed, bw_compiler=boxed,
                                           partition_fn=recording_partition(saved)), dynamic=False)
    cos, sin = rotary_tables(cfg.head_dim, 64, cfg.rope_theta)
    new_compiles = {}
    for step, mode in enumerate(("none", "selective_op", "none", "full", "selective_op")):
        switch.policy = CheckpointPolicy(mode)
        before = len(saved)
        x = torch.randn(2, 64, 64, requires_grad=True)
        for block in blocks:
            x = block(x, cos, sin)
        x.sum().backward()
        new_compiles[step] = [sum(v.numel() for v in graph) for graph in saved[before:]]
    # Each policy compiles at its first use only (two graphs: the first block's input is a leaf, the second's
    # is not), and selective_op's keep less than none's.
    none, by_op, again_none, full, again_by_op = new_compiles.values()
    assert len(none) == len(by_op) == len(full) == 2 and again_none == again_by_op == []
    assert none[0] > by_op[0]
    torch._dynamo.reset()


def test_the_policies_by_role_need_projections_they_know():
    class Bare(torch.nn.Module):  # a block with no attention or feed-forward projections
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    for mode in ("selective_op", "selective_op_lean"):
        with pytest.raises(ValueError, match=f"checkpointing={mode}: Bare has no attention and feed-forward"):
            apply_activation_checkpointing([Bare()], mode, every_n=1)
    assert apply_activation_checkpointing([Bare()], "selective_op_wide", every_n=1) == 1
    switch = CheckpointSwitch()
    apply_switchable_checkpointing([Bare()], switch)
    assert not switch.roles_known  # auto then tries selective_op_wide in their place
    model = Transformer(CFG)
    apply_switchable_checkpointing(list(model.layers), switch)
    assert switch.roles_known
    from fsdp_utils.train.microbatch import auto_policies

    assert [p.name for p in auto_policies(3, roles_known=False)] == ["none", "selective_op_wide", "selective/3", "full"]
    assert [p.name for p in auto_policies(1)] == ["none", "selective_op", "selective_op_lean", "full"]


@pytest.mark.slow  # builds and compiles the model three times
def test_compile_tuning_needs_compile_and_reaches_every_compiled_function(monkeypatch):
    from config import ConfigError, load_config
    from fsdp_utils.parallel.parallelize import compile_options
    from fsdp_utils.train.build_run import build
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
            build(cfg, env, eos_id=0)  # the chunked loss's function, then each block
            assert options == [compile_options(tuning)] * (1 + cfg.model.n_layers), (tuning, version, options)
    assert compile_options(True) == {"coordinate_descent_tuning": True} and compile_options(False) is None


def test_matmul_roles_of_our_blocks_and_of_a_llama_like_layer():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from fsdp_utils.parallel.parallelize import matmul_roles
    from model.transformer import DecoderBlock

    d, hidden, q, kv = CFG.dim, CFG.hidden_dim, CFG.n_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
    assert matmul_roles(DecoderBlock(CFG)) == [("q", (d, q)), ("k", (d, kv)), ("v", (d, kv)), ("o", (q, d)),
                                               ("gate", (d, hidden)), ("up", (d, hidden)), ("down", (hidden, d))]
    assert matmul_roles(DecoderBlock(CFG, fused_matmul=True)) == [("qkv", (d, q + 2 * kv)), ("o", (q, d)),
                                                                  ("gate_up", (d, 2 * hidden)), ("down", (hidden, d))]
    hf = Qwen2Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    assert [role for role, _ in matmul_roles(Qwen2DecoderLayer(hf, 0))] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert matmul_roles(torch.nn.Linear(4, 4)) == []
