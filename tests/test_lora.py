"""LoRA (train.lora, fsdp_utils/parallel/lora.py): the adapters' arithmetic, training in-process (a world of
one) and on 2 gloo ranks with FSDP1 and FSDP2, checkpoints that resume exactly and refuse another base, and
the exports (merged, and a PEFT adapter folder that peft loads)."""
from __future__ import annotations

import dataclasses
import json
import math
import typing

import pytest
import torch

import train_fsdp
from config import CheckpointConfig, ConfigError, ModelSection, load_config
from config.sections import LoRATarget
from fsdp_utils.checkpoint import CheckpointMismatch
from fsdp_utils.checkpoint.checksums import file_record
from fsdp_utils.checkpoint.contents import Contents, TrainState, is_adapter_key
from fsdp_utils.checkpoint.errors import CheckpointError
from fsdp_utils.checkpoint.io import read_meta
from fsdp_utils.checkpoint.manager import CheckpointManager
from fsdp_utils.checkpoint.names import sidecar_of, size_of
from fsdp_utils.guards.preemption import StopSignal
from fsdp_utils.parallel.lora import (
    GROUPS,
    PROJECTIONS,
    LoRASettings,
    adapter_initial_value,
    adapters_of,
    attach_adapters,
    base_reference,
    lora_record,
    lora_targets,
    merged_state_dict,
)
from fsdp_utils.train.batch import TrainBatches
from model import ModelConfig, Transformer
from scripts import export_hf, generate
from tests.distributed_harness import cpu_env, run_ranks
from tests.helpers import ROOT, TINY, losses, read_metrics, run_train
from tests.test_step import tiny_cfg

LORA = ["--train.lora.rank=4", "--train.lora.alpha=8"]


def test_the_config_accepts_exactly_the_projections_and_groups():
    assert set(typing.get_args(LoRATarget)) == set(PROJECTIONS) | set(GROUPS)
    # Groups written out in projection order, each once.
    assert lora_targets(["v", "attention", "down"]) == ["q", "k", "v", "o", "down"]
    assert lora_targets(["all"]) == list(PROJECTIONS) == ["q", "k", "v", "o", "gate", "up", "down"]
SMALL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def _randomise_b(model: torch.nn.Module, seed: int = 0) -> None:
    """B starts at zero; a random B makes the adapters' contribution visible."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, adapter in adapters_of(model):
            adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=generator) * 0.1)


def test_config_checks_name_the_field():
    config = ROOT / "config/train_tiny_fsdp.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(config, [*LORA, "--train.lora.targets=[q, vv]", "--train.lora.dropout=1.5"])
    assert any("train.lora.targets='vv'" in p and "did you mean 'v'" in p for p in err.value.problems), err.value
    assert any(p.startswith("train.lora.dropout must be in [0, 1)") for p in err.value.problems)
    with pytest.raises(ConfigError) as err:
        load_config(config, [*LORA, "--fsdp.version=2", "--train.float8=tensorwise"])
    (line,) = err.value.problems
    assert line.startswith("train.float8=tensorwise cannot be combined with train.lora"), line
    assert load_config(config, []).train.lora.rank == 0  # off by default


def test_adapters_start_at_zero_and_merge_into_the_weights():
    torch.manual_seed(0)
    plain = Transformer(SMALL, fused_matmul=True)
    plain.init_weights(seed=3)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    want = plain(tokens)
    adapted = Transformer(SMALL, fused_matmul=True)
    adapted.load_state_dict(plain.state_dict())
    attach_adapters(adapted, LoRASettings(4, 8.0, 0.0, ("q", "v", "down")), seed=1, base_dtype=torch.float32)
    assert torch.equal(adapted(tokens), want)  # B = 0: exactly the base
    assert [p.requires_grad for p in adapted.parameters()].count(True) == 2 * 2 * 2  # A and B, 2 layers x 2 modules
    _randomise_b(adapted)
    got = adapted(tokens)
    assert not torch.allclose(got, want)
    # The reference: a plain model whose weights are W + (alpha / r) B_s A_s on each chosen slice s, built
    # here slice by slice from the stacked A and B (q and v of wqkv; k left alone).
    merged = {k: v.clone() for k, v in plain.state_dict().items()}
    q, kv = SMALL.n_heads * SMALL.head_dim, SMALL.num_kv_heads * SMALL.head_dim
    for name, _, adapter in adapters_of(adapted):
        a, b = adapter.lora_A.detach(), adapter.lora_B.detach()
        if name.endswith("wqkv"):
            merged[f"{name}.weight"][:q] += 2.0 * b[:q] @ a[:4]
            merged[f"{name}.weight"][q + kv:] += 2.0 * b[q:] @ a[4:]
        else:
            merged[f"{name}.weight"] += 2.0 * b @ a
    reference = Transformer(SMALL)
    reference.load_state_dict(merged)
    torch.testing.assert_close(got, reference(tokens), rtol=1e-5, atol=1e-5)
    # merged_state_dict (what --merge_lora writes) computes the same weights.
    for key, value in merged_state_dict(adapted).items():
        torch.testing.assert_close(value, merged[key], rtol=1e-6, atol=1e-6)


def test_initial_values_are_a_function_of_seed_and_name():
    a = adapter_initial_value("layers.0.attention.wqkv.lora.lora_A", (8, 32), rank=4, seed=5)
    assert torch.equal(a, adapter_initial_value("layers.0.attention.wqkv.lora.lora_A", (8, 32), rank=4, seed=5))
    assert not torch.equal(a, adapter_initial_value("layers.1.attention.wqkv.lora.lora_A", (8, 32), rank=4, seed=5))
    assert abs(a.std().item() - 1 / 4) < 0.05  # std 1/r
    assert not adapter_initial_value("x.lora.lora_B", (32, 4), rank=4, seed=5).any()


def _base_weights(run) -> dict[str, torch.Tensor]:
    return {n: p.detach().to_local().clone() for n, p in run.model.named_parameters() if not p.requires_grad}


def _new_run(cfg, env, resume_from=None):
    return train_fsdp.set_up(cfg, env, stop=StopSignal([], grace_s=60), resume_from=resume_from)


def _fit(run) -> None:
    train_fsdp.train(run, StopSignal([], grace_s=60))


@pytest.mark.slow
def test_lora_trains_only_adapters_from_the_base_loss_and_resumes_exactly(tmp_path, corpus, dataset_dir,
                                                                         world_of_one, monkeypatch):
    env = world_of_one
    args = [*LORA, "--train.max_steps=4", "--checkpoint.interval=2", "--checkpoint.format=sharded",
            "--checkpoint.async_save=true", "--model.vocab_size=320"]
    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, *args)
    run = _new_run(cfg, env)
    base_before = _base_weights(run)
    # Step 1's loss is the model before any update. The base model alone (a plain Transformer of the same
    # seed, no adapters), on the same 4 micro-batches, must give it: the adapters start at exactly zero.
    batches = TrainBatches(run.train_data, env, run.built.split, first_step=0, samples_seen=0,
                           max_steps=cfg.train.max_steps)
    plain = Transformer(cfg.model)
    plain.init_weights(cfg.run.seed)
    with torch.no_grad():
        base_loss = sum(plain(*next(batches)).item() for _ in range(4)) / 4
    batches.close()
    _fit(run)
    losses = {row["step"]: row["loss"] for row in read_metrics(cfg.output_dir) if "loss" in row}
    assert math.isclose(losses[1], base_loss, rel_tol=1e-5), (losses, base_loss)
    assert losses[4] < losses[1]
    for name, value in _base_weights(run).items():
        assert torch.equal(value, base_before[name]), name  # bit for bit
    assert all(p.grad is None for p in run.model.parameters() if not p.requires_grad)
    trainable = {id(p) for p in run.model.parameters() if p.requires_grad}
    assert {id(p) for g in run.optimizer.param_groups for p in g["params"]} == trainable
    # The checkpoint holds the adapters only, and its optimizer state only theirs.
    ckpt = cfg.output_dir / "fsdp_sharded_cpt2"
    size = sum(f.stat().st_size for f in ckpt.rglob("*.distcp"))
    assert size < 4 * 4 * sum(p.numel() for p in run.model.parameters() if p.requires_grad) + 200_000

    # Resumed from step 2 in a fresh output directory: steps 3 and 4 as the uninterrupted run.
    resumed_cfg = tiny_cfg(tmp_path / "b", corpus, dataset_dir, *args)
    _fit(_new_run(resumed_cfg, env, resume_from=str(ckpt)))
    resumed = {row["step"]: row["loss"] for row in read_metrics(resumed_cfg.output_dir) if "loss" in row}
    assert resumed == {3: losses[3], 4: losses[4]}

    # Another base (its fingerprint differs), or no LoRA: refused with one line.
    def other_base(*a, **kw):
        record = lora_record(*a, **kw)
        return {**record, "base": {**record["base"], "fingerprint": "0" * 16}}

    with monkeypatch.context() as patch:
        patch.setattr(train_fsdp, "lora_record", other_base)
        with pytest.raises(CheckpointMismatch, match="belong to another base model"):
            _new_run(tiny_cfg(tmp_path / "c", corpus, dataset_dir, *args), env, resume_from=str(ckpt))
    without = tiny_cfg(tmp_path / "d", corpus, dataset_dir, "--train.max_steps=4", "--model.vocab_size=320")
    with pytest.raises(CheckpointMismatch, match="holds LoRA adapters"):
        _new_run(without, env, resume_from=str(ckpt))

    # --merge_lora: the exported LlamaForCausalLM computes our LoRA model's logits.
    from transformers import LlamaForCausalLM

    from scripts.export_hf import export, load_lora_model

    final = cfg.output_dir / "fsdp_sharded_cpt4"
    ours, _ = load_lora_model(final)
    export(final, tmp_path / "merged", merge_lora=True)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_hf_model_lora_and_peft_round_trip(tmp_path, corpus, dataset_dir, world_of_one):
    """An HF Llama fine-tuned with LoRA: its adapters exported as a PEFT folder load with peft onto the base
    folder and give our model's logits; merged, they give the same logits."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from scripts.export_hf import export, export_lora, load_lora_model
    from tests.test_hf import save_tiny

    save_tiny("llama", tmp_path / "hf")
    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}",
                   "--train.lora.rank=4", "--train.lora.targets=[attention, down]", "--train.max_steps=2",
                   "--checkpoint.format=full")
    run = _new_run(cfg, world_of_one)
    base_before = _base_weights(run)
    _fit(run)
    for name, value in _base_weights(run).items():
        assert torch.equal(value, base_before[name]), name
    final = cfg.output_dir / "fsdp_cpt2.pth"
    ours, _ = load_lora_model(final)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(tokens)
    export_lora(final, tmp_path / "adapter", adapter_only=True)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert not torch.allclose(base(tokens).logits, want, atol=1e-4)  # the adapters changed something
        peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        torch.testing.assert_close(peft_model(input_ids=tokens).logits, want, rtol=1e-5, atol=1e-5)
    export(final, tmp_path / "merged", merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, strategy", [(2, "FULL_SHARD"), (2, "NO_SHARD"), (1, "FULL_SHARD")])
def test_hf_model_lora_on_fsdp1_saves_full_checkpoints_and_resumes_exactly(tmp_path, corpus, dataset_dir, nproc,
                                                                          strategy):
    """An HF Llama with LoRA on FSDP1, full checkpoints: each holds the adapters alone, and a job resumed from
    step 2 takes steps 3 and 4 as the uninterrupted job did, bit for bit. Unsharded (NO_SHARD, or one process),
    FSDP1 leaves the frozen base to the ranks (ignored_states); the model, built on the meta device, is then
    materialised before wrapping, so that the ignored parameters are the ones FSDP1 and the saves see."""
    from tests.test_hf import save_tiny

    save_tiny("llama", tmp_path / "hf")
    args = ["--model.type=hf", f"--model.hf_path={tmp_path / 'hf'}", *LORA, "--fsdp.version=1",
            f"--fsdp.sharding_strategy={strategy}", "--checkpoint.format=full", "--train.max_steps=4",
            "--checkpoint.interval=2", "--checkpoint.keep_last_n=0"]
    run_train(*args, nproc=nproc, out_dir=tmp_path / "full", corpus=corpus, dataset_dir=dataset_dir)
    full = losses(tmp_path / "full")
    saved = torch.load(tmp_path / "full" / "fsdp_cpt2.pth", weights_only=True)["model"]
    assert saved and all(is_adapter_key(k) for k in saved), sorted(saved)
    run_train(*args, f"--resume_from={tmp_path / 'full' / 'fsdp_cpt2.pth'}", nproc=nproc, out_dir=tmp_path / "resumed",
              corpus=corpus, dataset_dir=dataset_dir)
    assert losses(tmp_path / "resumed") == {3: full[3], 4: full[4]}, full


def _train_on_ranks(rank: int, world_size: int, runs: list[tuple[int, str]], steps: int) -> list[dict]:
    return [_train_lora(rank, world_size, version, precision, steps) for version, precision in runs]


def _train_lora(rank: int, world_size: int, version: int, precision: str, steps: int) -> dict:
    """Build, shard and train a tiny LoRA model for `steps` steps on fixed random batches (global batch 4:
    2 per rank on 2 ranks, 2 micro-batches of 2 on 1); its losses and full adapter values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdp_utils.parallel.build import build_model
    from fsdp_utils.parallel.fsdp import fsdp_adapter
    from fsdp_utils.parallel.parallelize import resolve_precision
    from fsdp_utils.train.optim import build_optimizer
    from fsdp_utils.train.step import train_step
    from tests.helpers import parallelize

    env = cpu_env(rank, world_size)
    cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml",
                      [*TINY, *LORA, f"--fsdp.version={version}", f"--train.precision={precision}",
                       "--model.vocab_size=320", "--train.lora.dropout=0.0"])
    built = build_model(cfg, env)
    prec = resolve_precision(precision, "fp32", env.device)
    fsdp = fsdp_adapter(cfg.fsdp, env)
    model = parallelize(built.module, fsdp=fsdp, block_classes=built.block_classes, precision=prec, compile=False,
                        init=built.init)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=False)
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 320, (4, 33), generator=generator) for _ in range(steps)]
    losses = []
    for batch in data:
        mine = batch[2 * rank:2 * rank + 2] if world_size == 2 else batch
        micro = [(m[:, :-1], m[:, 1:]) for m in mine.split(2)]
        result = train_step(model, optimizer, iter(micro), fsdp=fsdp, grad_accum=len(micro), grad_clip=1.0,
                            world_size=world_size)
        losses.append(result.loss.item())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    frozen = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    dtypes = sorted({str(v.dtype) for k, v in frozen.items() if k not in full})
    assert {str(v.dtype) for v in full.values()} == {"torch.float32"}, "adapters are stored in fp32"
    # numpy arrays cross the process boundary by value (tensors would by shared memory of an ended process).
    return {"losses": losses, "adapters": {k: v.float().numpy() for k, v in full.items()}, "base_dtypes": dtypes}


@pytest.mark.slow
def test_two_ranks_fsdp1_and_fsdp2_match_one_process():
    steps = 3
    (reference,) = run_ranks(_train_on_ranks, world_size=1, runs=[(2, "fp32")], steps=steps)[0]
    runs = [(1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16")]
    for per_rank in run_ranks(_train_on_ranks, world_size=2, runs=runs, steps=steps):
        for (version, precision), got in zip(runs, per_rank, strict=True):
            if precision == "bf16":
                # The frozen base is stored in bf16, the adapters stay fp32 (FSDP1: units of their own).
                assert got["base_dtypes"] == ["torch.bfloat16"], got["base_dtypes"]
                assert all(math.isfinite(x) for x in got["losses"])
                assert got["losses"][0] == pytest.approx(reference["losses"][0], rel=2e-2)  # the base's loss
                continue
            # The same global batch on 1 and 2 ranks: the same steps, up to the reduction order.
            assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5), (version, got["losses"])
            assert sorted(got["adapters"]) == sorted(reference["adapters"])
            for name, value in got["adapters"].items():
                torch.testing.assert_close(torch.from_numpy(value), torch.from_numpy(reference["adapters"][name]),
                                           rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("version", [1, 2])
def test_full_saves_on_gpus_leave_the_frozen_base_out_on_every_rank(tmp_path, corpus, dataset_dir, world_of_one,
                                                                     version):
    """On GPUs a full checkpoint is gathered to rank 0 through host memory. FSDP1 then gives the other ranks
    empty dicts, where torch's ignore_frozen_params fails (KeyError) looking for the frozen base: for FSDP1 the
    base stays in the gathered dict (FSDP1 gathers it anyway) and the save drops it by name; FSDP2 leaves it
    to torch."""
    import dataclasses

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--train.lora.rank=4", f"--fsdp.version={version}")
    built = _new_run(cfg, world_of_one).built
    model = built.model
    options, frozen = built.fsdp.full_save_options(model, on_gpu=True)
    assert options.full_state_dict and options.cpu_offload
    on_cpu, none_named = built.fsdp.full_save_options(model, on_gpu=False)
    assert on_cpu.ignore_frozen_params and not on_cpu.cpu_offload and none_named == []
    if version == 2:
        assert options.ignore_frozen_params and frozen == []
        return
    assert not options.ignore_frozen_params
    # What the save keeps (gathered here without the host-memory offload, which FSDP1 has only on GPUs).
    full = get_model_state_dict(model, options=dataclasses.replace(options, cpu_offload=False))
    kept = set(full) - set(frozen)
    assert frozen and kept and set(frozen) <= set(full)
    assert all(is_adapter_key(k) for k in kept), kept


# ---- checkpoints far smaller than their base --------------------------------------------------------

# A base of 557,696 weights (ModelConfig.num_params) with rank-2 adapters on q and v: per layer A (2 slices x 2,
# 128) and B (q's 128 + v's 64 rows, 2), 896 weights, 1,792 in all. A checkpoint holds their fp32 values and
# two AdamW moments (21.5 KB plus the framing) against the 1.1 MB the base would take at 2 bytes a weight.
BIG_BASE = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
SMALL_ADAPTERS = ["--train.lora.rank=2", "--train.lora.targets=[q, v]", "--run.seed=5"]


def _seeded_lora_model(seed: int, *, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """BIG_BASE drawn from `seed` as a LoRA run's seeded base, its adapters trained `steps` AdamW steps."""
    settings = LoRASettings(2, 16.0, 0.0, ("q", "v"))
    model = Transformer(BIG_BASE, fused_matmul=True)
    model.init_weights(seed)
    attach_adapters(model, settings, seed=seed, base_dtype=torch.float32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, BIG_BASE.vocab_size, (2, 17), generator=generator)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_lora_checkpoint_far_smaller_than_its_base_resumes_and_generates(tmp_path, world_of_one, fmt):
    run_cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml", SMALL_ADAPTERS)
    signature = dataclasses.asdict(BIG_BASE)
    record = lora_record(run_cfg, signature, base_dtype=torch.float32)

    def manager(contents: Contents) -> CheckpointManager:
        return CheckpointManager(CheckpointConfig(format=fmt, keep_last_n=0), tmp_path, env=world_of_one,
                                 contents=contents, model_config=signature, lora=record)

    trained, optimizer = _seeded_lora_model(run_cfg.run.seed, steps=3)
    path = manager(Contents(trained, optimizer, TrainState(step=3, samples_seen=6))).save()
    assert size_of(path) * 10 < BIG_BASE.num_params() * 2, size_of(path)  # the premise: a small fraction

    # Resumed (`latest`, as Ctrl-C, preemption and elastic restarts do) into a fresh model and optimizer.
    fresh, fresh_optimizer = _seeded_lora_model(run_cfg.run.seed, steps=0)
    assert manager(Contents(fresh, fresh_optimizer)).load("latest").step == 3
    for (name, want), got in zip(trained.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(got, want), name
    saved_moments = [s["exp_avg"] for s in optimizer.state.values()]
    assert [torch.equal(s["exp_avg"], m) for s, m in zip(fresh_optimizer.state.values(), saved_moments,
                                                          strict=True)] == [True] * len(saved_moments)

    # generate.py: the seeded base the checkpoint records, with its adapters, is the trained model.
    model, vocab_size = generate.load_for_generation(path, read_meta(path), device=torch.device("cpu"), base=None)
    tokens = torch.randint(0, BIG_BASE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert vocab_size == BIG_BASE.vocab_size
        torch.testing.assert_close(model(tokens), trained(tokens), rtol=0, atol=0)


def test_a_forged_lora_config_cannot_make_generate_build_an_enormous_base(tmp_path, world_of_one, capsys):
    """The adapters' checkpoint does not hold its seeded base, so its size cannot bound the config; a config
    rewritten to 4,096 layers of width 4,096 (7.3 * 10**11 weights, 2.9 TB in fp32), its records and the base's
    fingerprint made to match, is refused before anything is allocated."""
    run_cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml", SMALL_ADAPTERS)
    signature = dataclasses.asdict(BIG_BASE)
    model, optimizer = _seeded_lora_model(run_cfg.run.seed, steps=1)
    path = CheckpointManager(CheckpointConfig(format="full"), tmp_path, env=world_of_one,
                             contents=Contents(model, optimizer, TrainState(step=1, samples_seen=2)),
                             model_config=signature, lora=lora_record(run_cfg, signature, base_dtype=torch.float32)
                             ).save()
    payload = torch.load(path, weights_only=True)
    forged = {**signature, "dim": 4096, "n_layers": 4096, "n_heads": 32, "n_kv_heads": 8}
    payload["model_config"] = forged
    payload["lora"]["base"] = base_reference(ModelSection(), forged, seed=run_cfg.run.seed)
    torch.save(payload, path)
    sidecar_of(path).write_text(json.dumps({"format_version": 1, "files": {path.name: file_record(path)}}))
    assert ModelConfig(**forged).num_params() > 7 * 10**11
    with pytest.raises(CheckpointError) as caught:  # generate.py's loader
        generate.load_for_generation(path, payload, device=torch.device("cpu"), base=None)
    line = str(caught.value)
    assert line.startswith(f"{path}: model_config describes ") and "of memory free here" in line, line
    assert export_hf.main([str(path), str(tmp_path / "adapter"), "--lora_adapter_only"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {line}"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_two_ranks_resume_latest_of_a_lora_run_far_smaller_than_its_base(tmp_path, corpus, dataset_dir, fmt):
    """A LoRA run far smaller than its base, at a size the CPU runs: a 2-rank run stopped at step 2 and continued with
    --resume_from latest takes steps 3 and 4 as the uninterrupted run did, bit for bit, and generate.py samples
    the same text from both runs' last checkpoints."""
    args = ["--model.dim=128", "--model.vocab_size=320", "--train.lora.rank=2", "--train.lora.targets=[q, v]",
            f"--checkpoint.format={fmt}", "--checkpoint.interval=2", "--checkpoint.keep_last_n=0"]
    whole = tmp_path / "whole"
    run_train(*args, "--train.max_steps=4", nproc=2, out_dir=whole, corpus=corpus, dataset_dir=dataset_dir)
    name = "fsdp_cpt{}.pth" if fmt == "full" else "fsdp_sharded_cpt{}"
    base_weights = ModelConfig(vocab_size=320, dim=128, n_layers=2, n_heads=4, n_kv_heads=2).num_params()
    assert size_of(whole / name.format(2)) * 4 < base_weights * 2  # the adapters: a small fraction of the base
    stopped = tmp_path / "stopped"
    run_train(*args, "--train.max_steps=2", nproc=2, out_dir=stopped, corpus=corpus, dataset_dir=dataset_dir)
    resumed = run_train(*args, "--train.max_steps=4", "--resume_from=latest", nproc=2, out_dir=stopped, corpus=corpus,
                        dataset_dir=dataset_dir)
    assert losses(stopped)[3] == losses(whole)[3] and losses(stopped)[4] == losses(whole)[4]
    # The checkpoint holds no frozen base tensor: loading it leaves them as they are, without torch's warning for
    # each one ("Did not find param with FQN ...") on every rank.
    assert "Did not find param" not in resumed.stderr, resumed.stderr[-2000:]
    texts = {generate.generate(run / name.format(4), "the quick", temperature=0, max_new_tokens=12, device="cpu")
             for run in (whole, stopped)}
    assert len(texts) == 1 and texts.pop().startswith("the quick")


def test_a_lora_base_from_a_checkpoint_is_bounded_by_that_checkpoint(tmp_path, world_of_one):
    """With model.init_from, the base is a checkpoint of its own, which bounds the config: generate.py puts the
    adapters on its weights, and a LoRA config rewritten to a larger model (the base's fingerprint is of its files,
    so it still matches) is refused before the larger model is built."""
    base_model = Transformer(BIG_BASE)
    base_model.init_weights(7)
    signature = dataclasses.asdict(BIG_BASE)
    base = CheckpointManager(CheckpointConfig(format="full"), tmp_path / "base", env=world_of_one,
                             contents=Contents(base_model, torch.optim.AdamW(base_model.parameters())),
                             model_config=signature).save()
    run_cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml", [*SMALL_ADAPTERS, f"--model.init_from={base}"])
    model, optimizer = _seeded_lora_model(run_cfg.run.seed, steps=2)
    model.load_state_dict(base_model.state_dict(), strict=False)  # the adapters, over the checkpoint's base
    path = CheckpointManager(CheckpointConfig(format="full"), tmp_path / "lora", env=world_of_one,
                             contents=Contents(model, optimizer, TrainState(step=2, samples_seen=4)),
                             model_config=signature, lora=lora_record(run_cfg, signature, base_dtype=torch.float32)
                             ).save()
    loaded, _ = generate.load_for_generation(path, read_meta(path), device=torch.device("cpu"), base=None)
    tokens = torch.randint(0, BIG_BASE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)

    payload = torch.load(path, weights_only=True)
    payload["model_config"] = {**signature, "n_layers": 64}
    torch.save(payload, path)
    sidecar_of(path).write_text(json.dumps({"format_version": 1, "files": {path.name: file_record(path)}}))
    with pytest.raises(CheckpointError) as caught:
        generate.load_for_generation(path, payload, device=torch.device("cpu"), base=None)
    larger = ModelConfig(**payload["model_config"]).num_params()
    assert str(caught.value).startswith(f"{path}: its model_config ({larger:,} parameters) is not the model of its "
                                        f"base {base} "), caught.value
