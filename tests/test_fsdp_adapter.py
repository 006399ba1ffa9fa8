"""The FSDP adapter (fsdp_utils/parallel/fsdp.py), each version on two gloo ranks against one process without FSDP:
its wrap computes the same losses, its gradient sync skips the reduction before the step's last micro-batch (or
reduces after every one, fsdp.grad_sync=every_micro_batch), and its clipping returns the global gradient norm and
clips to it, so that one SGD step lands on the reference's weights. Also: the state-dict answers it gives the
checkpoints, and that the checkpoints take their state dicts as the run's adapter answers."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fsdp_utils.parallel.parallelize import Precision
from model import DecoderBlock, ModelConfig, Transformer
from tests.helpers import parallelize

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
SEED, LR = 5, 0.1
MAX_NORM = 0.5  # below the reference's gradient norm (the test asserts it), so clipping acts
SYNCS = ("last_micro_batch", "every_micro_batch")
FP32 = Precision(torch.float32, torch.float32, use_grad_scaler=False)


def global_batch() -> torch.Tensor:
    """(rank, micro-batch, sequences, tokens): two ranks' two micro-batches of two sequences of 16 (+1 target)."""
    return torch.randint(0, CFG.vocab_size, (2, 2, 2, CFG.max_seq_len + 1), generator=torch.Generator().manual_seed(0))


def reference() -> dict:
    """One process, no FSDP, on the whole global batch: each micro-batch's loss, the norm of the gradient of their
    mean (what the ranks' FSDP-averaged gradient of their mean over two micro-batches is), and the weights after
    one SGD step on that gradient clipped to MAX_NORM."""
    model = Transformer(CFG)
    model.init_weights(seed=SEED)
    tokens = global_batch()
    losses = [[model(t[:, :-1], t[:, 1:]) for t in rank] for rank in tokens]
    torch.stack([loss for rank in losses for loss in rank]).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {"losses": [[loss.item() for loss in rank] for rank in losses], "norm": norm.item(),
            "weights": {name: p.detach().numpy() for name, p in model.named_parameters()}}


def reductions(counts: dict) -> int:
    """Gradient reductions (reduce-scatters, all-reduces) among a CommDebugMode's collective counts."""
    return sum(n for op, n in counts.items() if "reduce" in str(op))


def step_on_ranks(rank: int, world_size: int) -> dict:
    """On this rank, for each version and fsdp.grad_sync: the adapter's wrap of the reference's model, two
    micro-batches of this rank's share under its gradient sync (their losses, the reductions each made), its
    clipping (the norm measured without clipping, then clipped to MAX_NORM), one SGD step, and the full weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor.debug import CommDebugMode

    from config import FSDPConfig
    from fsdp_utils.parallel.fsdp import fsdp_adapter
    from tests.distributed_harness import cpu_env

    env = cpu_env(rank, world_size)
    mine = global_batch()[rank]
    out = {}
    for version in (1, 2):
        for grad_sync in SYNCS:
            fsdp = fsdp_adapter(FSDPConfig(version=version, grad_sync=grad_sync), env)
            module = Transformer(CFG)
            module.init_weights(seed=SEED)
            model = parallelize(module, fsdp=fsdp, block_classes={DecoderBlock}, precision=FP32)
            losses, reduced = [], []
            for micro, tokens in enumerate(mine):
                with CommDebugMode() as comm, fsdp.gradient_sync(model, last=micro == len(mine) - 1):
                    loss = model(tokens[:, :-1], tokens[:, 1:])
                    (loss / len(mine)).backward()
                losses.append(loss.item())
                reduced.append(reductions(comm.get_comm_counts()))
            measured = fsdp.clip_grad_norm(model, 0.0).item()
            norm = fsdp.clip_grad_norm(model, MAX_NORM).item()
            after = fsdp.clip_grad_norm(model, 0.0).item()
            torch.optim.SGD(model.parameters(), lr=LR).step()
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            out[(version, grad_sync)] = {
                "losses": losses, "reduced": reduced, "measured": measured, "norm": norm, "after": after,
                "weights": {name: value.numpy() for name, value in full.items()},
                # Each matrix a 2-D parameter of its own, or flattened into its unit's 1-D shard.
                "matrices_whole": max(p.ndim for p in model.parameters()) == 2, "per_matrix": fsdp.per_matrix}
    return out


@pytest.mark.slow  # spawns two gloo ranks
def test_both_versions_wrap_sync_and_clip_like_one_process():
    from tests.distributed_harness import run_ranks

    ref = reference()
    assert ref["norm"] > MAX_NORM  # clipping acts
    for rank, got in enumerate(run_ranks(step_on_ranks, world_size=2)):
        for (version, grad_sync), run in got.items():
            what = (rank, version, grad_sync)
            # The wrap: the same loss on each micro-batch as the unwrapped model.
            np.testing.assert_allclose(run["losses"], ref["losses"][rank], rtol=1e-6, err_msg=str(what))
            # The sync: last_micro_batch reduces nothing before the last micro-batch; both reduce at the last.
            first, last = run["reduced"]
            assert last > 0 and (first == 0 if grad_sync == "last_micro_batch" else first == last), (what, first, last)
            # Clipping: the norm over all shards and ranks, with max_norm 0 measured only, then clipped to MAX_NORM.
            assert run["measured"] == pytest.approx(ref["norm"], rel=1e-5), what
            assert run["norm"] == pytest.approx(ref["norm"], rel=1e-5), what
            assert run["after"] == pytest.approx(MAX_NORM, rel=1e-4), what
            # Reduced, averaged and clipped as one process: the same weights after the step.
            assert run["weights"].keys() == ref["weights"].keys(), what
            for name, value in run["weights"].items():
                np.testing.assert_allclose(value, ref["weights"][name], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{what} {name}")
            assert run["matrices_whole"] == run["per_matrix"] == (version == 2), what


@pytest.mark.parametrize("version", [1, 2])
def test_the_state_dict_answers_are_each_versions(version, world_of_one):
    # FSDP1 cuts each rank's piece of a sharded state dict anew, so on GPUs it offloads them (docs/checkpoints.md);
    # FSDP2's hold the live shards. Without frozen parameters both gather a full state dict as torch does: through
    # host memory on GPUs only, no names left for the caller to drop (LoRA's frozen base: tests/test_lora.py).
    # The GPU is only a device in the environment: the answers come from its type, and nothing is gathered here.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from config import FSDPConfig
    from fsdp_utils.checkpoint.contents import TorchStateDicts
    from fsdp_utils.parallel.fsdp import fsdp_adapter

    module = Transformer(CFG)
    module.init_weights(seed=SEED)
    model = parallelize(module, fsdp=fsdp_adapter(FSDPConfig(version=version), world_of_one),
                        block_classes={DecoderBlock}, precision=FP32)
    for device in ("cpu", "cuda"):
        fsdp = fsdp_adapter(FSDPConfig(version=version), dataclasses.replace(world_of_one, device=torch.device(device)))
        assert fsdp.offloads_sharded_state_dict() == (version == 1 and device == "cuda"), device
        for on_gpu in (False, True):
            want = StateDictOptions(full_state_dict=True, cpu_offload=on_gpu, ignore_frozen_params=True, strict=True)
            assert fsdp.full_save_options(model, on_gpu=on_gpu) == (want, []), (device, on_gpu)
            assert TorchStateDicts().full_save_options(model, on_gpu=on_gpu) == (want, [])
    assert not TorchStateDicts().offloads_sharded_state_dict()


class RecordedAnswers:
    """State-dict answers that record the questions, and name one parameter for the full save to drop."""

    def __init__(self, drop: str):
        from fsdp_utils.checkpoint.contents import TorchStateDicts

        self.drop, self.torch, self.asked = drop, TorchStateDicts(), []

    def full_save_options(self, model, *, on_gpu):
        self.asked.append(("full", on_gpu))
        return self.torch.full_save_options(model, on_gpu=on_gpu)[0], [self.drop]

    def offloads_sharded_state_dict(self):
        self.asked.append(("sharded",))
        return False


def test_the_checkpoints_take_state_dicts_as_the_run_answers(world_of_one, tmp_path):
    # Both writers ask the answers the contents were given (the run's FSDP adapter), and the full save drops the
    # frozen names they give: the checkpoint holds every weight but that one.
    from config import CheckpointConfig
    from fsdp_utils.checkpoint import CheckpointManager, Contents
    from fsdp_utils.checkpoint.safe_read import load_full

    model = Transformer(CFG)
    model.init_weights(seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters())
    drop = "layers.0.attention.wqkv.weight"
    paths = {}
    for fmt in ("full", "sharded"):
        answers = RecordedAnswers(drop)
        paths[fmt] = CheckpointManager(CheckpointConfig(format=fmt, keep_last_n=0), tmp_path / fmt, env=world_of_one,
                                       contents=Contents(model, optimizer, fsdp=answers), model_config={}).save()
        assert ("full", False) in answers.asked if fmt == "full" else set(answers.asked) == {("sharded",)}, fmt
    assert sorted(load_full(paths["full"])["model"]) == sorted(set(model.state_dict()) - {drop})


@pytest.mark.parametrize("version", [1, 2])
def test_each_version_wraps_its_own_units_in_the_given_precision(version, world_of_one):
    # The run's wrap (build_run's, the same call as train_fsdp.py's set_up: tests/test_architecture.py) makes the
    # units each version has always had. FSDP1: a unit per block, and per LoRA adapter (a unit is one flat tensor of
    # one dtype, and the adapters are fp32 beside a bf16 base), fp32 without casting; FSDP2: the blocks, the output
    # projection's edges where untied, then the root, never the adapters. 2 layers, LoRA on q, k, v, o: 8 adapters.
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    from config import load_config
    from fsdp_utils.parallel.build import describe_model
    from fsdp_utils.train.build_run import build_run
    from tests.helpers import ROOT, TINY

    blocks = {"layers.0", "layers.1"}
    for precision, lora, tied in (("fp32", 0, True), ("bf16", 4, True), ("fp32", 0, False)):
        cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml",
                          [*TINY, f"--fsdp.version={version}", f"--train.precision={precision}",
                           f"--train.lora.rank={lora}", f"--model.tie_embeddings={str(tied).lower()}",
                           "--model.vocab_size=320"])
        vocab_size, signature, _ = describe_model(cfg, 320)
        model = build_run(cfg, world_of_one, vocab_size=vocab_size, model_signature=signature, eos_id=None,
                          use_cache=False).model
        bf16 = precision == "bf16"
        if version == 1:
            units = FullyShardedDataParallel.fsdp_modules(model)
            kinds = sorted(type(unit.module).__name__ for unit in units)
            assert kinds == ["DecoderBlock"] * 2 + ["LoRAAdapter"] * (8 if lora else 0) + ["Transformer"], kinds
            mixed = {(unit.mixed_precision.param_dtype, unit.mixed_precision.reduce_dtype) for unit in units}
            assert mixed == {(torch.bfloat16, torch.float32) if bf16 else (None, None)}, mixed
            continue
        sharded = {name for name, module in model.named_modules() if isinstance(module, FSDPModule)}
        assert sharded == {"", *blocks, *(() if tied else ("tok_embeddings", "norm", "output"))}, sharded
        policies = {(m._get_fsdp_state()._mp_policy.param_dtype, m._get_fsdp_state()._mp_policy.reduce_dtype)
                    for m in model.modules() if isinstance(m, FSDPModule)}
        assert policies == {(torch.bfloat16 if bf16 else torch.float32, torch.float32)}, policies
