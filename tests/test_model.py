"""Tests for model/: causality, parameter count, meta-device build, independence from torch.distributed,
and the FLOP estimate. In-process and CPU only; every model here is a few thousand to a few hundred
thousand parameters."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "model"


def small_cfg(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=24)
    return ModelConfig(**{**base, **overrides})


def built(cfg: ModelConfig, seed: int = 0, **options) -> Transformer:
    model = Transformer(cfg, **options)
    model.init_weights(seed)
    return model.eval()


# ---- causality --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4], ids=["gqa1", "gqa2", "mha"])
def test_logits_depend_only_on_earlier_tokens(tie, n_kv_heads):
    cfg = small_cfg(tie_embeddings=tie, n_kv_heads=n_kv_heads)
    model = built(cfg, seed=3)
    T = 16
    tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        for t in (0, 5, T - 1):
            changed = tokens.clone()
            changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
            out = model(changed)
            # Positions before t never see token t: bitwise the same (masked scores contribute exp(-inf) = 0).
            torch.testing.assert_close(out[:, :t], ref[:, :t], rtol=0, atol=1e-6)
            # Position t sees the new token through its own embedding; every later one attends to it
            # (measured: the smallest per-position change is ~1e-2 at init, far above 1e-4).
            per_position = (out[:, t:] - ref[:, t:]).abs().amax(dim=(0, 2))
            assert (per_position > 1e-4).all(), f"perturbing token {t} left positions unchanged: {per_position}"


def test_model_rejects_sequences_longer_than_rotary_table():
    cfg = small_cfg()
    model = built(cfg)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_loss_at_init_is_log_vocab():
    # Weights ~ N(0, 0.02) give near-uniform logits, so cross-entropy ~ ln(V) = ln(97) = 4.575.
    cfg = small_cfg()
    model = built(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = model(tokens[:, :-1], tokens[:, 1:]).item()
        logits = model(tokens[:, :-1])
    assert abs(loss - torch.log(torch.tensor(97.0)).item()) < 0.05
    # With targets the model returns the mean cross-entropy of its own logits.
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert loss == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk", [7, 16, 1000], ids=["uneven", "even", "larger-than-batch"])
def test_chunked_loss_equals_full_loss_and_gradients(chunk, tie):
    cfg = small_cfg(tie_embeddings=tie)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    x, y = tokens[:, :-1], tokens[:, 1:]  # 2 x 16 = 32 target tokens: chunks of 7 leave a remainder of 4

    def loss_and_grads(chunk_tokens):
        model = built(cfg, seed=9, loss_chunk_tokens=chunk_tokens).train()
        loss = model(x, y)
        (loss * 0.25).backward()  # a scaled loss, as with gradient accumulation
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    full_loss, full_grads = loss_and_grads(0)
    loss, grads = loss_and_grads(chunk)
    # Same sum of per-token losses in a different order: equal to float32 rounding.
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=0)
    for name in full_grads:
        torch.testing.assert_close(grads[name], full_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_loss_in_bf16_matches_fp32_reference():
    """The compute dtype of GPU runs: loss and gradients close to an fp32 computation of the same inputs."""
    from model.loss import chunked_cross_entropy

    gen = torch.Generator().manual_seed(5)
    h32 = torch.randn(96, 32, generator=gen)
    w32 = torch.randn(200, 32, generator=gen) * 0.2
    targets = torch.randint(0, 200, (96,), generator=gen)

    def run(dtype, chunk):
        h, w = (t.detach().to(dtype, copy=True).requires_grad_() for t in (h32, w32))
        loss = chunked_cross_entropy(h, w, targets, chunk_tokens=chunk)
        loss.backward()
        return loss.double(), h.grad.double(), w.grad.double()

    reference = run(torch.float32, 0)
    for got, want in zip(run(torch.bfloat16, 40), reference, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    # and no-grad evaluation gives the same loss through its own path
    with torch.no_grad():
        chunked = chunked_cross_entropy(h32, w32, targets, chunk_tokens=40).item()
        assert chunked == pytest.approx(reference[0].item(), rel=1e-6)


# ---- parameter count --------------------------------------------------------------------------------

PARAM_CONFIGS = {
    "tied-gqa": small_cfg(tie_embeddings=True, n_kv_heads=2),
    "untied-mha": small_cfg(tie_embeddings=False, n_kv_heads=None),
    "untied-gqa1-ffn100": small_cfg(tie_embeddings=False, n_kv_heads=1, ffn_hidden_dim=100),
    "tied-mha-ffn48-3layers": small_cfg(tie_embeddings=True, n_kv_heads=4, ffn_hidden_dim=48, n_layers=3),
    "defaults": ModelConfig(vocab_size=512, n_layers=1),
}


@pytest.mark.parametrize("cfg", PARAM_CONFIGS.values(), ids=PARAM_CONFIGS.keys())
def test_num_params_matches_module(cfg):
    with torch.device("meta"):  # only shapes matter: no memory, no init
        model = Transformer(cfg)
    # Tied embeddings: parameters() yields the shared weight once, and num_params counts it once.
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_num_params_by_hand():
    cfg = ModelConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, tie_embeddings=False)
    # head_dim = 32/4 = 8, kv width = 2*8 = 16; hidden = int(2*4*32/3) = 85 -> rounded up to 32s = 96.
    # Per block: wqkv 32*(32+2*16) = 2048, wo 32*32 = 1024, w13 32*2*96 = 6144, w2 96*32 = 3072,
    #            two RMSNorms 2*32 = 64                              -> 12352; two blocks -> 24704.
    # Embedding 100*32 = 3200, untied output 100*32 = 3200, final norm 32 -> total 31136.
    assert cfg.hidden_dim == 96
    assert cfg.num_params() == 31136
    # Tying removes exactly the output projection: 31136 - 3200.
    cfg.tie_embeddings = True
    assert cfg.num_params() == 27936


def test_tied_model_shares_embedding_and_output():
    model = built(small_cfg(tie_embeddings=True))
    assert model.output is None
    # The gradient of the shared weight gets contributions from both the lookup and the output matmul:
    # rows of tokens never fed as input still get gradient (through the output projection).
    tokens = torch.tensor([[1, 2, 3, 4]])
    model(tokens, tokens).backward()
    grad = model.tok_embeddings.weight.grad
    assert grad[50].abs().sum() > 0 and grad[1].abs().sum() > 0
    # Untied, the embedding of a token never fed as input gets no gradient: the check above tells them apart.
    untied = built(small_cfg(tie_embeddings=False))
    untied(tokens, tokens).backward()
    assert untied.tok_embeddings.weight.grad[50].abs().sum() == 0
    assert untied.output.weight.grad[50].abs().sum() > 0


# ---- meta-device build ------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_meta_build_then_init_equals_direct_build(tie):
    cfg = small_cfg(tie_embeddings=tie)
    direct = built(cfg, seed=11)

    with torch.device("meta"):
        lazy = Transformer(cfg)
    assert all(t.is_meta for t in [*lazy.parameters(), *lazy.buffers()])
    lazy.to_empty(device="cpu")
    # to_empty leaves uninitialised memory; poison it so that anything init_weights forgets stays NaN
    # (uninitialised memory may by chance hold the right values from an earlier allocation).
    with torch.no_grad():
        for t in [*lazy.parameters(), *lazy.buffers()]:
            t.fill_(float("nan"))
    lazy.init_weights(11)
    lazy.eval()

    direct_sd, lazy_sd = direct.state_dict(), lazy.state_dict()
    assert direct_sd.keys() == lazy_sd.keys()
    for name in direct_sd:
        assert torch.equal(direct_sd[name], lazy_sd[name]), name
    # The rotary tables are non-persistent (never in a checkpoint) yet must be rebuilt by init_weights.
    assert "rope_cos" not in direct_sd and "rope_sin" not in direct_sd
    assert torch.equal(lazy.rope_cos, direct.rope_cos) and torch.equal(lazy.rope_sin, direct.rope_sin)
    # Row 0 is position 0: cos(0) = 1, sin(0) = 0 -- a check that the reference itself is not garbage.
    assert torch.equal(direct.rope_cos[0], torch.ones(cfg.head_dim))
    assert torch.equal(direct.rope_sin[0], torch.zeros(cfg.head_dim))

    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(lazy(tokens), direct(tokens))


def test_to_empty_without_init_leaves_buffers_wrong():
    cfg = small_cfg()
    direct = built(cfg)
    with torch.device("meta"):
        lazy = Transformer(cfg)
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        lazy.rope_cos.fill_(float("nan"))  # stands in for whatever to_empty's memory held
    # Weights alone (init of parameters without reset_buffers) would leave the tables broken...
    with torch.no_grad():
        for name, p in lazy.named_parameters():
            p.copy_(dict(direct.named_parameters())[name])
    assert not torch.equal(lazy.rope_cos, direct.rope_cos)
    # ...and reset_buffers is what repairs them.
    lazy.reset_buffers()
    assert torch.equal(lazy.rope_cos, direct.rope_cos)


def test_init_weights_depends_on_seed_only():
    cfg = small_cfg()
    a, b, c = built(cfg, seed=5), built(cfg, seed=5), built(cfg, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):  # norms start at ones whatever the seed
            assert not torch.equal(pa, pc), name


# ---- rotary tables ----------------------------------------------------------------------------------

# Llama 3.2's scaling, with a pretraining context of 16 so that a 24-token table reaches past it.
LLAMA3 = dict(rope_scaling_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_seq_len=16)


def test_rotary_tables_without_scaling_are_the_plain_ones_bit_for_bit():
    # Reference: the plain Llama tables written out (theta^(-2i/Hd) times the position, each angle twice).
    cfg = small_cfg(rope_theta=500000.0)
    model = built(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    angles = torch.arange(cfg.max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    assert torch.equal(model.rope_cos, angles.cos()) and torch.equal(model.rope_sin, angles.sin())


def llama3_reference(inv_freq: list[float], *, factor, low_freq_factor, high_freq_factor, original_max_seq_len):
    """Llama 3's frequency scaling, one frequency at a time by its wavelength, in Python floats (float64)."""
    import math

    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize("theta, head_dim", [(10000.0, 8), (500000.0, 64)])
def test_llama3_scaling_follows_its_definition(theta, head_dim):
    from model.transformer import llama3_scaled

    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ours = llama3_scaled(inv_freq, **scaling)
    expected = torch.tensor(llama3_reference(inv_freq.double().tolist(), **scaling), dtype=torch.float64)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=0)
    # Wavelengths 2 pi / inv_freq below 64 / 4 are kept and above 64 / 1 slowed by the factor, exactly; each of
    # the three kinds occurs at both sizes (the first wavelength is 2 pi, the last is above 64).
    wavelen = 2 * torch.pi / inv_freq
    kept, slowed = wavelen < 16, wavelen > 64
    assert torch.equal(ours[kept], inv_freq[kept]) and torch.equal(ours[slowed], inv_freq[slowed] / 8)
    between = ~kept & ~slowed
    assert kept.any() and slowed.any() and between.any()
    assert (ours[between] < inv_freq[between]).all() and (ours[between] > inv_freq[between] / 8).all()


def test_scaled_rotary_tables_in_every_build():
    # The model's tables are the scaled ones, after a direct build and after a meta build's reset_buffers.
    # With a pretraining context of 16 every frequency of head_dim 8 is scaled (the fastest, wavelength 2 pi,
    # interpolated), so every column differs from the plain table but at position 0.
    from model.transformer import rotary_tables

    cfg = small_cfg(**LLAMA3)
    direct = built(cfg)
    cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, llama3_scaling=cfg.llama3_scaling)
    assert torch.equal(direct.rope_cos, cos) and torch.equal(direct.rope_sin, sin)
    with torch.device("meta"):
        lazy = Transformer(cfg)
    lazy.to_empty(device="cpu")
    lazy.init_weights(0)
    assert torch.equal(lazy.rope_cos, cos) and torch.equal(lazy.rope_sin, sin)
    plain = built(small_cfg())
    assert torch.equal(direct.rope_cos[0], plain.rope_cos[0])
    assert (direct.rope_cos[1:] != plain.rope_cos[1:]).any(dim=0).all()
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(lazy(tokens), direct(tokens))


# ---- model/ knows nothing about torch.distributed ---------------------------------------------------

FORBIDDEN_PACKAGES = ("torch.distributed", "fsdp_utils")


def _forbidden(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FORBIDDEN_PACKAGES)


def distributed_uses(source: str) -> list[str]:
    """Imports of (or attribute access to) torch.distributed / fsdp_utils in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _forbidden(node.module):
                found.append(node.module)
            else:  # from torch import distributed
                found += [f"{node.module}.{a.name}" for a in node.names if _forbidden(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append("torch.distributed")
    return found


def test_distributed_use_detector_catches_each_form():
    # The detector must flag every way of reaching torch.distributed, else the next test proves nothing.
    assert distributed_uses("import torch.distributed as dist") == ["torch.distributed"]
    assert distributed_uses("from torch import distributed") == ["torch.distributed"]
    assert distributed_uses("from torch.distributed.fsdp import fully_shard") == ["torch.distributed.fsdp"]
    assert distributed_uses("import torch\ntorch.distributed.all_reduce(x)") == ["torch.distributed"]
    assert distributed_uses("from fsdp_utils.parallel.parallelize import unwrap") == ["fsdp_utils.parallel.parallelize"]
    assert distributed_uses("import torch\nfrom torch import nn\n'''no torch.distributed here'''") == []


def test_model_package_does_not_import_torch_distributed():
    files = sorted(MODEL_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "config.py", "transformer.py"}
    offenders = {f.name: uses for f in files if (uses := distributed_uses(f.read_text()))}
    assert offenders == {}


@pytest.mark.slow
def test_importing_and_running_model_loads_no_new_distributed_modules():
    # `import torch` itself loads part of torch.distributed, so compare against what torch alone loaded:
    # importing model/ and running forward + backward must add no torch.distributed.* module.
    script = (
        "import sys, json, torch\n"
        "before = set(sys.modules)\n"
        "from model import ModelConfig, Transformer\n"
        "m = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=8))\n"
        "m.init_weights(0)\n"
        "x = torch.randint(0, 32, (1, 8))\n"
        "m(x, x).backward()\n"
        "print(json.dumps(sorted(n for n in set(sys.modules) - before if n.startswith(('torch.distributed', "
        "'fsdp_utils')))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


# ---- FLOPs ------------------------------------------------------------------------------------------


def test_flops_per_token_is_about_six_n():
    # dim 512, seq 128, tied: the attention term 12*L*T*D is 128/(6*512) ~ 4% of 6*N per layer.
    cfg = ModelConfig(vocab_size=1000, dim=512, n_layers=4, n_heads=8, max_seq_len=128, tie_embeddings=True)
    n = cfg.num_params()
    assert 1.0 < cfg.flops_per_token(128) / (6 * n) < 1.10


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_flops_per_token_terms(tie):
    cfg = small_cfg(tie_embeddings=tie)
    L, D, V = cfg.n_layers, cfg.dim, cfg.vocab_size
    # Without attention (seq_len 0) it is 6 x the matmul weights: every parameter except the 2L+1 norm
    # vectors and, when untied, the input embedding (a lookup, no FLOPs; the tied weight is used once
    # as the output matmul).
    matmul_params = cfg.num_params() - (2 * L + 1) * D - (0 if tie else V * D)
    assert cfg.flops_per_token(0) == 6 * matmul_params
    # Attention scores add 3 passes x 2 FLOPs x 2 matmuls (QK^T, AV) x T x D per layer: 12*L*T*D.
    assert cfg.flops_per_token(20) - cfg.flops_per_token(0) == 12 * L * 20 * D


# ---- fused projections (set for FP8 layers) ----------------------------------------------------------


@pytest.mark.parametrize("n_kv_heads", [1, 4], ids=["mqa", "mha"])
def test_fused_matmul_calls_the_modules_and_keeps_outputs_and_gradients(n_kv_heads):
    # fused_matmul (build_model sets it for LoRA, whose adapters add to the layer's output) computes q/k/v and
    # gate/up as one call of wqkv / w13, so a module replacing the nn.Linear runs; the numbers are those of the
    # per-slice matmuls up to float32 summation order.
    cfg = small_cfg(n_kv_heads=n_kv_heads)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    results = []
    for fused in (False, True):
        model = built(cfg, seed=5, fused_matmul=fused)
        calls = []
        for layer in model.layers:
            for linear in (layer.attention.wqkv, layer.feed_forward.w13):
                linear.register_forward_hook(lambda *_: calls.append(1))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        assert len(calls) == (2 * cfg.n_layers if fused else 0)
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_split, grads_split), (loss_fused, grads_fused) = results
    torch.testing.assert_close(loss_fused, loss_split, rtol=1e-6, atol=0)
    for g_fused, g_split in zip(grads_fused, grads_split, strict=True):
        torch.testing.assert_close(g_fused, g_split, rtol=1e-5, atol=1e-7)
