"""The one training step (fsdp_utils/train/step.py) and train_fsdp.py's loop, in-process (a world of one on gloo).

The training loop, benchmarks/benchmark.py and the micro-batch search's trial steps must run the same step, and
the benchmark must build what train_fsdp.py builds: a copy of either drifts. Here each is run and seen to call
`train_step`, the benchmark's objects are compared with train_fsdp.py's and its step is checked to change the
weights exactly as `train_step` does, and the loop trains in-process.
"""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

import train_fsdp
from config import load_config
from fsdp_utils.guards.preemption import StopSignal
from fsdp_utils.train import microbatch, step
from fsdp_utils.train.batch import BatchSplit
from tests.helpers import ROOT, TINY, read_metrics

TINY_CONFIG = ROOT / "config/train_tiny_fsdp.yaml"


def tiny_cfg(tmp_path, corpus, dataset_dir, *extra: str):
    overrides = [*TINY, f"--run.output_dir={tmp_path / 'out'}", f"--data.files=[{corpus}]",
                 f"--data.dataset_dir={dataset_dir}", "--fsdp.version=2", *extra]
    return load_config(TINY_CONFIG, overrides)


class Spy:
    """Wraps train_step and records each call's keyword arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, optimizer, batches, **kwargs):
        self.calls.append({"model": model, "optimizer": optimizer, **kwargs})
        return step.train_step(model, optimizer, batches, **kwargs)


def test_loop_benchmark_and_trials_import_the_one_step():
    from benchmarks import benchmark

    assert train_fsdp.train_step is step.train_step
    assert microbatch.train_step is step.train_step
    assert benchmark.train_step is step.train_step


@pytest.mark.slow
def test_the_loop_trains_in_process_through_train_step(tmp_path, corpus, dataset_dir, world_of_one, monkeypatch):
    spy = Spy()
    monkeypatch.setattr(train_fsdp, "train_step", spy)
    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--train.max_steps=4")
    stop = StopSignal([], grace_s=60)
    run = train_fsdp.set_up(cfg, world_of_one, stop=stop)
    last = train_fsdp.train(run, stop)
    # global batch 8 = micro-batch 2 x accumulation 4 on one rank
    assert len(spy.calls) == 4 and {c["grad_accum"] for c in spy.calls} == {4}
    assert all(c["model"] is run.model and c["optimizer"] is run.optimizer for c in spy.calls)
    losses = [row["loss"] for row in read_metrics(cfg.output_dir) if "loss" in row]
    assert len(losses) == 4 and losses[-1] < losses[0] and last["step"] == 4
    assert run.state.step == 4 and run.state.samples_seen == 4 * 8
    assert (cfg.output_dir / "fsdp_cpt4.pth").is_file()  # the final save


@pytest.mark.slow
def test_micro_batch_trials_run_train_step(tmp_path, corpus, dataset_dir, world_of_one, monkeypatch):
    from tests.fault_injection import FakeProbe

    spy = Spy()
    monkeypatch.setattr(microbatch, "train_step", spy)
    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--train.max_steps=1", "--train.warmup_steps=1")
    run = train_fsdp.set_up(cfg, world_of_one, stop=StopSignal([], grace_s=60))  # a fresh start: no optimizer state
    probe = FakeProbe({"capacity_gib": 10, "fixed_gib": 1, "per_sample_gib": 1}, 0)
    choice = microbatch.search_micro_batch(run.model, run.optimizer, fsdp=run.built.fsdp, per_rank=8,
                                           seq_len=cfg.data.seq_len,
                                           vocab_size=run.model.cfg.vocab_size, grad_clip=1.0, margin=0.1,
                                           compile=False, env=world_of_one, probe=probe)
    assert choice.micro_batch_size == 8 and spy.calls  # 1 + 8 GiB fits the 9 GiB budget
    assert all(c["model"] is run.model and c["optimizer"] is run.optimizer for c in spy.calls)


def test_benchmark_step_is_train_step(tmp_path, corpus, dataset_dir, world_of_one, monkeypatch):
    """The benchmark's step changes the weights exactly as train_step on the same batches does."""
    from benchmarks import benchmark

    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--train.micro_batch_size=2", "--model.vocab_size=320")
    args = argparse.Namespace(fused_projections=False, unfused_adamw=True, doc_len=0, search_without_estimate=False)
    spy = Spy()
    monkeypatch.setattr(benchmark, "train_step", spy)
    step_fn, run = benchmark.build_ours(cfg, world_of_one, args, micro_batch=2, grad_accum=None)
    model, optimizer, grad_accum = run.model, run.optimizer, run.split.grad_accum
    assert run.split == BatchSplit(8, 1, 2)

    def weights():
        return [p.to_local().detach().clone() for p in model.parameters()]

    before = weights()
    step_fn()
    after_benchmark = weights()
    with torch.no_grad():  # back to the same start: weights, empty optimizer state
        for p, value in zip(model.parameters(), before, strict=True):
            p.to_local().copy_(value)
    optimizer.state.clear()
    # The benchmark draws its random tokens from a generator seeded by the rank: the same stream here.
    batches = benchmark.random_batches(cfg.model.vocab_size, micro_batch=2, seq_len=cfg.data.seq_len,
                                       device=world_of_one.device, seed=world_of_one.rank)
    step.train_step(model, optimizer, batches, fsdp=run.fsdp, grad_accum=grad_accum, grad_clip=cfg.train.grad_clip,
                    world_size=1)
    assert len(spy.calls) == 1 and spy.calls[0]["grad_accum"] == grad_accum
    for got, want, old in zip(after_benchmark, weights(), before, strict=True):
        assert torch.equal(got, want) and not torch.equal(got, old)
    assert dist.is_initialized()


def test_benchmark_trains_the_loops_objects(tmp_path, corpus, dataset_dir, world_of_one):
    """benchmarks/benchmark.py and train_fsdp.py build from one config through build_run: the same model and weights,
    optimizer, converters and micro-batch plan, and one step on the same batch gives the same loss and weights."""
    from benchmarks import benchmark

    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--train.max_steps=1", "--train.warmup_steps=1",
                   "--model.vocab_size=320")
    run = train_fsdp.set_up(cfg, world_of_one, stop=StopSignal([], grace_s=60)).built  # a fresh start
    args = argparse.Namespace(fused_projections=False, unfused_adamw=False, doc_len=0, search_without_estimate=False)
    _, ours = benchmark.build_ours(cfg, world_of_one, args, micro_batch=cfg.train.micro_batch_size, grad_accum=None)

    def structure(model):
        return [(name, type(module).__name__) for name, module in model.named_modules()]

    def weights(model):
        return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}

    def groups(model, optimizer):
        names = {id(p): name for name, p in model.named_parameters()}
        return [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
                for g in optimizer.param_groups]

    assert structure(ours.model) == structure(run.model)
    theirs_w, ours_w = weights(run.model), weights(ours.model)
    assert list(ours_w) == list(theirs_w) and all(torch.equal(ours_w[n], theirs_w[n]) for n in theirs_w)
    assert type(ours.optimizer) is type(run.optimizer)
    assert groups(ours.model, ours.optimizer) == groups(run.model, run.optimizer)
    assert [type(c) for c in ours.converters] == [type(c) for c in run.converters]
    assert type(ours.fsdp) is type(run.fsdp) and ours.fsdp.f == run.fsdp.f  # the same FSDP adapter and settings
    assert (ours.precision, ours.scaler, ours.checkpoint_switch) == (run.precision, run.scaler, run.checkpoint_switch)
    # global batch 8 on one rank at the configured micro-batch 2: accumulation 4
    assert ours.split == run.split == BatchSplit(8, 1, 2) and ours.choice == run.choice

    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 320, (2, cfg.data.seq_len + 1), generator=gen) for _ in range(run.split.grad_accum)]
    results = [step.train_step(built.model, built.optimizer, ((t[:, :-1], t[:, 1:]) for t in tokens), fsdp=built.fsdp,
                               grad_accum=4, grad_clip=cfg.train.grad_clip, world_size=1) for built in (run, ours)]
    assert torch.equal(results[0].loss, results[1].loss) and torch.equal(results[0].grad_norm, results[1].grad_norm)
    theirs_w, ours_w = weights(run.model), weights(ours.model)
    assert all(torch.equal(ours_w[n], theirs_w[n]) for n in theirs_w)


# ---- fsdp.grad_sync: when accumulation reduces the gradients -------------------------------------------
def gradient_numel(model) -> int:
    """Gradient elements this rank holds between micro-batches: FSDP1's flat gradients (sharded or whole),
    FSDP2's sharded .grad plus the unsharded gradients it accumulates internally when not reducing."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_utils.parallel.fsdp import fsdp2_param_groups

    held = sum(p.grad.numel() if not hasattr(p.grad, "to_local") else p.grad.to_local().numel()
               for p in model.parameters() if p.grad is not None)
    if isinstance(model, FSDPModule):
        for group in fsdp2_param_groups(model):
            for param in group.fsdp_params:
                grad = param.unsharded_accumulated_grad
                if grad is None and hasattr(param, "_unsharded_param"):
                    grad = param._unsharded_param.grad
                held += grad.numel() if grad is not None else 0
    return held


def accumulate_two_micro_batches(rank: int, world_size: int) -> dict:
    """On each rank, for each FSDP version and fsdp.grad_sync: the gradients' size after the first of two
    micro-batches (sharded: reduced already; whole: held until the last), and the weights after a step."""
    from config import FSDPConfig
    from fsdp_utils.parallel.fsdp import fsdp_adapter
    from fsdp_utils.parallel.parallelize import resolve_precision
    from model import DecoderBlock, ModelConfig, Transformer
    from tests.distributed_harness import cpu_env
    from tests.helpers import parallelize

    env = cpu_env(rank, world_size)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 2, 17), generator=torch.Generator().manual_seed(rank))
    out = {}
    for version in (1, 2):
        for grad_sync in ("every_micro_batch", "last_micro_batch"):
            module = Transformer(cfg)
            module.init_weights(seed=5)
            fsdp = fsdp_adapter(FSDPConfig(version=version, grad_sync=grad_sync), env)
            model = parallelize(module, fsdp=fsdp, block_classes={DecoderBlock},
                                precision=resolve_precision("fp32", "fp32", env.device), compile=False)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with fsdp.gradient_sync(model, last=False):
                model(tokens[0, :, :-1], tokens[0, :, 1:]).backward()
            held = gradient_numel(model)
            with fsdp.gradient_sync(model, last=True):
                model(tokens[1, :, :-1], tokens[1, :, 1:]).backward()
            optimizer.step()
            local = [p.detach() if version == 1 else p.to_local().detach() for p in model.parameters()]
            out[(version, grad_sync)] = {"held": held, "shard": sum(t.numel() for t in local),
                                         "weights": torch.cat([t.flatten() for t in local]).tolist()}
    return out


@pytest.mark.slow  # spawns two gloo ranks
def test_grad_sync_every_micro_batch_keeps_gradients_sharded_and_trains_the_same():
    from tests.distributed_harness import run_ranks

    for rank in run_ranks(accumulate_two_micro_batches, world_size=2):
        for version in (1, 2):
            every, last = rank[(version, "every_micro_batch")], rank[(version, "last_micro_batch")]
            # After the first micro-batch: this rank's shard of the gradients, or the whole model's.
            assert every["held"] == every["shard"], version
            assert last["held"] >= 2 * last["shard"] - 64, version  # whole: the world's shards (padding aside)
            torch.testing.assert_close(torch.tensor(every["weights"]), torch.tensor(last["weights"]), rtol=1e-5,
                                       atol=1e-7)


@pytest.mark.slow
def test_a_spike_skipped_with_a_grad_scaler_leaves_everything_and_the_next_step_runs(tmp_path, corpus, dataset_dir,
                                                                                    world_of_one):
    """train.skip_spikes' skip inside train_step, with fp16's grad scaler (its sharded one, on the CPU): no
    update, no optimizer state, the scaler's step record closed so that the next step unscales and steps as
    usual, and the finite gradients counted towards the scale's growth as any step's."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fsdp_utils.train.spikes import SpikeSkipper
    from tests.helpers import set_up

    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--train.optimizer=muon", "--model.vocab_size=320")
    run = set_up(cfg, world_of_one)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8)
    skipper = SpikeSkipper(window=20, min_values=20)
    for i in range(20):  # a quiet window far below the random tokens' loss, ln(320)
        skipper.check(3.0 + i * 1e-3, 1.0)
    generator = torch.Generator().manual_seed(0)

    def batches():
        while True:
            tokens = torch.randint(0, 320, (2, cfg.data.seq_len + 1), generator=generator)
            yield tokens[:, :-1], tokens[:, 1:]

    stream = batches()
    before = [p.to_local().clone() for p in run.model.parameters()]
    kwargs = dict(fsdp=run.built.fsdp, grad_accum=4, grad_clip=1.0, world_size=1, scaler=scaler)
    result = step.train_step(run.model, run.optimizer, stream, skipper=skipper, **kwargs)
    assert result.applied and result.skipped and result.skipped_steps == 1 and "loss" in result.skip_reason
    assert all(torch.equal(old, p.to_local()) for old, p in zip(before, run.model.parameters(), strict=True))
    assert not run.optimizer.state and all(p.grad is None for p in run.model.parameters())
    assert scaler.get_scale() == 2.0**8 and int(scaler._growth_tracker) == 1
    result = step.train_step(run.model, run.optimizer, stream, **kwargs)
    assert result.applied and not result.skipped and result.skipped_steps is None
    assert run.optimizer.state and not torch.equal(before[0], next(run.model.parameters()).to_local())
