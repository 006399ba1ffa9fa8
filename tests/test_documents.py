"""Document masking (data.document_masking) and restarting positions (model.reset_positions): inside a packed
window no token attends across an EOS, for our model (FlexAttention block mask, or a dense mask on the CPU)
and for Hugging Face models (position ids that restart per document). In-process and fp32 on the CPU,
except the multi-rank check (spawned gloo ranks, marked slow) and the compiled bf16 check (GPU)."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from config import ConfigError, load_config
from model import Documents, ModelConfig, Transformer
from model.documents import document_block_mask, document_dense_mask, document_ids, document_positions
from model.transformer import apply_rotary, rotary_tables
from tests.distributed_harness import run_ranks
from tests.helpers import ROOT, TINY, world_of_one

EOS = 0
CFG = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64)

# The CPU runs FlexAttention's unfused reference; torch warns about that once per process.
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")


def words(n: int, seed: int) -> torch.Tensor:
    """(1, n) random tokens without EOS."""
    return torch.randint(1, CFG.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def eos() -> torch.Tensor:
    return torch.full((1, 1), EOS)


def built(documents: Documents | None, cfg: ModelConfig = CFG, seed: int = 0) -> Transformer:
    model = Transformer(cfg, documents=documents)
    model.init_weights(seed)
    return model.eval()


def packed_batch(batch: int, T: int, seed: int, eos_rate: float = 0.1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, CFG.vocab_size, (batch, T), generator=gen)
    tokens[torch.rand(batch, T, generator=gen) < eos_rate] = EOS
    return tokens


# ---- document ids, positions and masks against references computed another way ---------------------


def test_document_ids_and_positions_follow_each_eos():
    tokens = packed_batch(3, 50, seed=1, eos_rate=0.2)
    tokens[0, 0] = tokens[1, -1] = EOS  # an EOS first and last
    doc, pos = document_ids(tokens, EOS), document_positions(document_ids(tokens, EOS))
    for b in range(3):  # a plain loop over the tokens: a new document after each EOS
        d = p = 0
        for t in range(50):
            assert (doc[b, t].item(), pos[b, t].item()) == (d, p), (b, t)
            d, p = (d + 1, 0) if tokens[b, t] == EOS else (d, p + 1)


@pytest.mark.parametrize("T, block", [(16, 4), (37, 8), (64, 16), (100, 4), (300, 128)])
def test_block_mask_equals_create_block_mask(T, block):
    # Reference: torch's create_block_mask, which evaluates the mask function on every (query, key) pair;
    # ours derives the same block lists from per-block document ranges.
    for seed, rate in enumerate([0.0, 0.02, 0.1, 0.5]):
        doc = document_ids(packed_batch(3, T, seed=seed, eos_rate=rate), EOS)

        def mask_mod(b, h, q, kv):
            return (q >= kv) & (doc[b, q] == doc[b, kv])

        ref = create_block_mask(mask_mod, 3, None, T, T, device="cpu", BLOCK_SIZE=block)
        ours = document_block_mask(doc, block_size=block)
        assert torch.equal(ours.to_dense(), ref.to_dense())
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (name, seed)
        for name in ("kv", "full_kv"):  # the chosen blocks (their order inside a row is free)
            count, ours_idx, ref_idx = (getattr(ours, f"{name}_num_blocks"), getattr(ours, f"{name}_indices"),
                                        getattr(ref, f"{name}_indices"))
            for b, i in zip(*torch.nonzero(count[:, 0] > 0, as_tuple=True), strict=True):
                n = count[b, 0, i]
                assert torch.equal(ours_idx[b, 0, i, :n].sort().values, ref_idx[b, 0, i, :n].sort().values)
        # The dense mask of the CPU path is the same relation.
        dense = torch.stack([torch.stack([mask_mod(b, 0, torch.arange(T)[:, None], torch.arange(T)[None])])
                             for b in range(3)])
        assert torch.equal(document_dense_mask(doc), dense)


def test_attention_benchmark_lays_the_documents_end_to_end(capsys):
    # benchmarks/bench_attention.py's variable-length kernel gets each document's start in the flattened
    # window (every row starts one); reference: the starts read off the ids one token at a time.
    from benchmarks import bench_attention

    doc = document_ids(packed_batch(3, 40, seed=2, eos_rate=0.2), EOS)
    starts = [b * 40 + t for b in range(3) for t in range(40) if t == 0 or doc[b, t] != doc[b, t - 1]]
    assert bench_attention.cumulative_lengths(doc).tolist() == [*starts, 120]
    if not torch.cuda.is_available():  # one error line without a GPU
        assert bench_attention.main([]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "error: benchmarks/bench_attention.py times GPU kernels and needs a CUDA GPU"


# ---- our model: a document packed after another sees only itself -------------------------------------


@pytest.mark.parametrize("kernel", ["flex", "sdpa"])
@pytest.mark.parametrize("reset", [True, False], ids=["reset_positions", "window_positions"])
@pytest.mark.slow
def test_packed_document_logits_equal_the_document_alone(kernel, reset):
    a, b, c = words(13, 1), words(20, 2), words(9, 3)
    packed = torch.cat([a, eos(), b, eos(), c], dim=1)  # A, EOS | B, EOS | C
    model = built(Documents(eos_id=EOS, reset_positions=reset, kernel=kernel))
    with torch.no_grad():
        out = model(packed)
        alone_b, alone_c = model(torch.cat([b, eos()], dim=1)), model(c)
        plain = built(None)(packed)
    start_b, start_c = 14, 35
    # Restarted positions: B (with its EOS) and C get exactly the inputs they get alone; only the
    # summation order of attention's reductions may differ (measured: 0 to 3e-7). Window positions:
    # rotary attention scores depend on position differences only, so the shift changes nothing but
    # rounding of the rotation (measured up to 6e-8 on the logits, scale ~0.1).
    torch.testing.assert_close(out[:, start_b:start_c], alone_b, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, start_c:], alone_c, rtol=0, atol=1e-5)
    # The first document is plain causal attention; and without masking B sees A (a control
    # for the equality above: measured differences ~0.08).
    torch.testing.assert_close(out[:, :start_b], plain[:, :start_b], rtol=0, atol=1e-5)
    assert (plain[:, start_b:start_c] - alone_b).abs().max() > 1e-2


@pytest.mark.parametrize("scaling", [None, 8.0], ids=["plain", "llama3"])
def test_reset_positions_without_masking_restarts_rotary_positions(scaling):
    # Positions alone: B after A's EOS is embedded as if at position 0, but still attends to A. Reference:
    # the rotary tables, computed apart (with Llama 3's scaling: the scaled ones), indexed by the positions
    # counted by hand.
    cfg = dataclasses.replace(CFG, rope_scaling_factor=scaling, rope_original_max_seq_len=4 if scaling else 8192)
    model = built(Documents(eos_id=EOS, mask_attention=False, reset_positions=True), cfg)
    tokens = torch.cat([words(5, 1), eos(), words(7, 2)], dim=1)
    cos, sin, mask = model._document_inputs(tokens, model.documents)
    assert mask is None
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6])
    q = torch.randn(1, 4, 13, CFG.head_dim)
    tables = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, llama3_scaling=cfg.llama3_scaling)
    expected = apply_rotary(q, tables[0][positions], tables[1][positions])
    torch.testing.assert_close(apply_rotary(q, cos, sin), expected, rtol=0, atol=0)
    if scaling:  # a control: the scaled tables are not the plain ones
        assert not torch.equal(tables[0], rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)[0])


def reference_forward(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The plain causal forward written out from the weights: causal SDPA, rotary positions 0..T-1."""
    T, H, K, Hd = tokens.shape[1], CFG.n_heads, CFG.num_kv_heads, CFG.head_dim
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    h = model.tok_embeddings(tokens)
    for layer in model.layers:
        x = layer.attention_norm(h)
        wq, wk, wv = layer.attention.wqkv.weight.split([H * Hd, K * Hd, K * Hd])
        q, k, v = (F.linear(x, w).view(1, T, -1, Hd).transpose(1, 2) for w in (wq, wk, wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, T, H * Hd)
        h = h + layer.attention.wo(out)
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return F.linear(model.norm(h), model.output.weight)


def test_masking_off_is_the_plain_causal_forward_bit_for_bit():
    model = built(None)
    tokens = torch.cat([words(10, 1), eos(), words(20, 2)], dim=1)
    with torch.no_grad():
        assert torch.equal(model(tokens), reference_forward(model, tokens))


@pytest.mark.parametrize("reset", [False, True], ids=["mask", "mask+positions"])
@pytest.mark.parametrize("last_eos", [False, True], ids=["no-eos", "eos-last"])
def test_a_batch_without_a_document_boundary_runs_the_plain_causal_path(reset, last_eos, monkeypatch):
    """Windows that each lie inside one document (no EOS, or one as the last token, which starts nothing inside
    the window) are the plain causal batch: the same loss and gradients bit for bit as without document masking,
    and no document mask is built (on GPUs that mask would send attention to FlexAttention)."""
    import model.transformer as transformer

    tokens = torch.cat([words(31, 1), words(31, 2)])  # (2, 31)
    if last_eos:
        tokens[:, -1] = EOS
    targets = torch.randint(0, CFG.vocab_size, (2, 31), generator=torch.Generator().manual_seed(5))

    def loss_and_grads(documents):
        model = Transformer(CFG, documents=documents)
        model.init_weights(0)
        loss = model(tokens, targets)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    plain_loss, plain = loss_and_grads(None)
    for name in ("document_dense_mask", "document_block_mask", "document_positions"):
        monkeypatch.setattr(transformer, name, lambda *a, name=name: pytest.fail(f"{name} called"))
    for kernel in ("sdpa", "flex"):
        loss, grads = loss_and_grads(Documents(eos_id=EOS, reset_positions=reset, kernel=kernel))
        assert torch.equal(loss, plain_loss)
        assert all(torch.equal(g, p) for g, p in zip(grads, plain, strict=True))


def test_one_window_with_a_boundary_masks_the_whole_batch():
    """The choice is the batch's: a boundary in any window masks them all, each by its own documents (a window
    without one is then masked causally, which is what the plain path computes)."""
    plain_window = words(31, 1)
    packed = torch.cat([words(10, 2), eos(), words(20, 3)], dim=1)
    model = built(Documents(eos_id=EOS))
    with torch.no_grad():
        both = model(torch.cat([plain_window, packed]))
        torch.testing.assert_close(both[:1], built(None)(plain_window), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(both[1:, 11:], model(packed[:, 11:]), rtol=1e-5, atol=1e-6)


def test_masked_loss_and_gradients_equal_the_documents_trained_apart():
    # The packed window's mean loss is the sum of each document's summed loss over the window's token
    # count, and so are its gradients; selective activation checkpointing changes neither.
    from fsdp_utils.parallel.parallelize import apply_activation_checkpointing

    tokens = torch.cat([words(10, 1), eos(), words(21, 2)], dim=1)  # (1, 32)
    targets = torch.randint(0, CFG.vocab_size, (1, 32), generator=torch.Generator().manual_seed(5))

    def grads(documents, pieces, ac="none"):
        model = Transformer(CFG, documents=documents)
        model.init_weights(0)
        apply_activation_checkpointing(list(model.layers), ac, 1)
        loss = sum(model(tokens[:, s], targets[:, s]) * (s.stop - s.start) for s in pieces) / 32
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    docs = Documents(eos_id=EOS, reset_positions=True)
    apart_loss, apart = grads(None, [slice(0, 11), slice(11, 32)])
    for ac in ("none", "selective_op"):
        loss, packed = grads(docs, [slice(0, 32)], ac)
        torch.testing.assert_close(loss, apart_loss, rtol=1e-6, atol=0)
        for g_packed, g_apart in zip(packed, apart, strict=True):
            torch.testing.assert_close(g_packed, g_apart, rtol=1e-5, atol=1e-7)


# ---- Hugging Face models: packed sequences from restarting position ids -------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.slow
def test_hf_packed_document_logits_equal_the_document_alone(attn):
    transformers = pytest.importorskip("transformers")
    from fsdp_utils.parallel.hf import CausalLMAdapter

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation=attn)
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(cfg).eval()
    masked, plain = CausalLMAdapter(lm, eos_id=EOS), CausalLMAdapter(lm)
    a, b = words(13, 1), words(20, 2)
    with torch.no_grad():
        out = masked(torch.cat([a, eos(), b], dim=1))
        alone = plain(b)
        unmasked = plain(torch.cat([a, eos(), b], dim=1))
    torch.testing.assert_close(out[:, 14:], alone, rtol=0, atol=1e-5)
    assert (unmasked[:, 14:] - alone).abs().max() > 1e-2  # control: without it, B sees A


def test_hf_document_masking_needs_restarting_positions_and_a_model_that_takes_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    from fsdp_utils.parallel.hf import hf_problems

    transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2).save_pretrained(tmp_path / "llama")
    transformers.BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2).save_pretrained(tmp_path / "bloom")
    args = ["--model.type=hf", f"--model.hf_config={tmp_path / 'llama'}"]
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "config/train_tiny_fsdp.yaml", [*args, "--data.document_masking=true"])
    (line,) = err.value.problems
    assert line.startswith("model.type=hf: data.document_masking=True needs model.reset_positions=True"), line
    both = load_config(ROOT / "config/train_tiny_fsdp.yaml",
                       [*args, "--data.document_masking=true", "--model.reset_positions=true"])
    assert hf_problems(both.model, document_masking=True) == []
    both.model.hf_config = str(tmp_path / "bloom")
    (line,) = hf_problems(both.model, document_masking=True)
    assert line.startswith("data.document_masking: model.hf_config=") and "takes no position_ids" in line, line
    assert hf_problems(both.model, document_masking=False) == []


# ---- the whole path: config -> tokenizer's EOS -> model; and several ranks ---------------------------


def short_documents(path):
    """A .jsonl corpus of documents a few dozen tokens long: most 32-token windows cross a boundary."""
    sentences = ["the quick fox", "seven wizards box", "a lazy dog", "jugs of amber"]
    path.write_text("".join(json.dumps({"text": f"{i}: {sentences[i % 4]}."}) + "\n"
                            for i in range(200)))
    return path


@pytest.mark.slow
def test_the_run_builds_the_masked_model_with_the_tokenizer_eos(tmp_path):
    import train_fsdp
    from data.tokenizer import load_sentencepiece
    from fsdp_utils.guards.preemption import StopSignal

    cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml", [
        *TINY, f"--run.output_dir={tmp_path / 'out'}", f"--data.files=[{short_documents(tmp_path / 'docs.jsonl')}]",
        f"--data.dataset_dir={tmp_path / 'ds'}", "--fsdp.version=2", "--train.max_steps=2",
        "--data.document_masking=true", "--model.reset_positions=true"])
    with world_of_one() as env:
        stop = StopSignal([], grace_s=60)
        run = train_fsdp.set_up(cfg, env, stop=stop)
        eos_id = load_sentencepiece(cfg.output_dir / "tokenizer.model").eos_id()
        assert run.model.documents == Documents(eos_id=eos_id, mask_attention=True, reset_positions=True)
        x, _ = run.train_data.batch(0, 8)
        assert (x == eos_id).any(dim=1).all(), "every window holds a document boundary"
        assert train_fsdp.train(run, stop)["step"] == 2


def masked_losses_on_ranks(rank: int, world_size: int, *, combos: list[tuple[int, str]]) -> list[list[float]]:
    """For each (FSDP version, activation checkpointing): three SGD steps of a masked model sharded over the
    ranks, each rank on its half of the batch."""
    from fsdp_utils.parallel.build import build_model
    from fsdp_utils.parallel.fsdp import fsdp_adapter
    from fsdp_utils.parallel.parallelize import resolve_precision
    from tests.distributed_harness import cpu_env
    from tests.helpers import parallelize

    env = cpu_env(rank, world_size)
    out = []
    for version, ac in combos:
        cfg = masked_config(version, ac)
        built_model = build_model(cfg, env, eos_id=EOS)
        model = parallelize(built_model.module, fsdp=fsdp_adapter(cfg.fsdp, env),
                            block_classes=built_model.block_classes,
                            precision=resolve_precision("fp32", "fp32", env.device), compile=False,
                            init=built_model.init)
        out.append(sgd_losses(model, rows=slice(2 * rank, 2 * rank + 2), world_size=world_size))
    return out


def masked_config(version: int, ac: str, masking: bool = True):
    return load_config(ROOT / "config/train_tiny_fsdp.yaml", [
        *TINY, "--model.vocab_size=97", f"--fsdp.version={version}", f"--fsdp.activation_checkpointing={ac}",
        f"--data.document_masking={masking}", f"--model.reset_positions={masking}", "--train.precision=fp32"])


def sgd_losses(model, *, rows: slice, world_size: int) -> list[float]:
    import torch.distributed as dist

    tokens = packed_batch(4, 33, seed=7, eos_rate=0.1)
    x, y = tokens[rows, :-1], tokens[rows, 1:]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for _ in range(3):
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(mean)
        out.append(mean.item() / world_size)
    return out


def unsharded_losses(masking: bool) -> list[float]:
    from fsdp_utils.parallel.build import model_documents

    cfg = masked_config(1, "none", masking)
    model = Transformer(cfg.model, documents=model_documents(cfg, EOS))
    model.init_weights(cfg.run.seed)
    return sgd_losses(model, rows=slice(0, 4), world_size=1)


@pytest.mark.slow
def test_masked_model_on_two_ranks_matches_one_process():
    # Reference: the same model unsharded in this process, on the whole batch (4 rows; each rank's loss is
    # the mean over its 2 rows, so the mean over the ranks is the whole batch's). FSDP averages the
    # gradients over the ranks, so the losses after each SGD step match too.
    want = unsharded_losses(masking=True)
    assert want[-1] < want[0]  # the steps changed the weights: the later losses test the gradients
    # The mask matters on this batch: without it every loss differs by far more than the tolerance below
    # (measured: 9e-4 relative at the first, 1% after the steps).
    unmasked = unsharded_losses(masking=False)
    assert all(not math.isclose(u, w, rel_tol=1e-4) for u, w in zip(unmasked, want, strict=True))
    combos = [(1, "full"), (2, "selective_op")]
    results = run_ranks(masked_losses_on_ranks, combos=combos)
    assert results[0] == results[1]
    for combo, got in zip(combos, results[0], strict=True):
        for g, w in zip(got, want, strict=True):
            assert math.isclose(g, w, rel_tol=1e-5), (combo, got, want)


# ---- GPU: compiled FlexAttention in bf16 ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_attention_in_bf16_keeps_documents_apart():
    from fsdp_utils.parallel.parallelize import apply_activation_checkpointing, apply_compile

    cfg = ModelConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=512)
    documents = Documents(eos_id=EOS, reset_positions=True)
    flex = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    with torch.device("cuda"):
        model = Transformer(cfg, documents=documents, flex_attention_fn=flex)
    model.init_weights(0)
    apply_activation_checkpointing(list(model.layers), "selective_op", 1)
    apply_compile(list(model.layers))
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(1, 512, (1, 200), generator=gen)
    b = torch.randint(1, 512, (1, 311), generator=gen)
    packed = torch.cat([a, eos(), b], dim=1).cuda()  # 512 tokens: B starts inside the second key block
    with torch.autocast("cuda", dtype=torch.bfloat16), warnings.catch_warnings():
        # An uncompiled FlexAttention warns that it materializes the scores: that warning fails the test
        # (only that one: torch.compile's tracing raises warnings of its own on purpose).
        warnings.filterwarnings("error", message="flex_attention called without torch.compile")
        out = model(packed).float()
        alone = model(b.cuda()).float()
        # bf16 activations: ~3 significant digits, the same for a document alone and packed.
        torch.testing.assert_close(out[:, 201:], alone, rtol=0, atol=3e-2)
        # Training through the compiled kernel and checkpointed blocks: finite gradients everywhere.
        targets = torch.roll(packed, -1, dims=1)
        model(packed, targets).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_masked_model_runs_causal_attention_on_windows_without_a_boundary(monkeypatch):
    """On the GPU a batch without a document boundary takes the unmasked model's compiled path: the same loss and
    gradients bit for bit, and no block mask is built (so FlexAttention does not run); a batch with one builds it."""
    import model.transformer as transformer
    from fsdp_utils.parallel.parallelize import apply_compile

    cfg = ModelConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=512)
    flex = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    masks = []
    monkeypatch.setattr(transformer, "document_block_mask",
                        lambda ids: masks.append(1) or document_block_mask(ids))

    def trained(documents):
        with torch.device("cuda"):
            model = Transformer(cfg, documents=documents, flex_attention_fn=flex)
        model.init_weights(0)
        apply_compile(list(model.layers))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, torch.roll(tokens, -1, dims=1))
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    tokens = torch.randint(1, 512, (2, 512), generator=torch.Generator().manual_seed(0)).cuda()
    plain_loss, plain = trained(None)
    loss, grads = trained(Documents(eos_id=EOS, reset_positions=True))
    assert masks == [] and torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain, strict=True))
    tokens[1, 100] = EOS  # one boundary in one window: the whole batch is masked
    loss, _ = trained(Documents(eos_id=EOS, reset_positions=True))
    assert masks == [1] and torch.isfinite(loss)


@pytest.mark.slow
def test_hf_model_trains_with_document_masking_on_two_ranks(tmp_path):
    # The whole job under torchrun: the config checks, the tokenizer's EOS reaching the HF adapter, and
    # transformers' packed-sequence mask inside FSDP-wrapped decoder layers.
    pytest.importorskip("transformers")
    from tests.helpers import losses, run_train
    from tests.test_hf import save_tiny

    save_tiny("llama", tmp_path / "hf")
    run_train("--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", "--fsdp.version=2", "--train.max_steps=4",
              "--data.document_masking=true", "--model.reset_positions=true", nproc=2, out_dir=tmp_path / "out",
              corpus=short_documents(tmp_path / "docs.jsonl"), dataset_dir=tmp_path / "ds")
    got = losses(tmp_path / "out")
    assert sorted(got) == [1, 2, 3, 4] and got[4] < got[1], got
